"""The ViT variants after the paper (DeiT's distillation token, DeiT III's LayerScale, registers, q/k norm, GAP with
LayerScale), checked against timm, their reference implementation: parameter names and counts, logits with each
side's weights loaded strictly into the other, the distilled model's averaged heads, offline Hub loading of the
registered weights (files written by timm's own save function), inspection, and fine-tuning a features model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitkit
from vitkit.cli.main import main
from vitkit.interop.registry import PRETRAINED
from vitkit.interop.timm import timm_model

timm = pytest.importorskip("timm")

NEW_PRESETS = ["deit_small_distilled_patch16_224", "deit_base_distilled_patch16_224", "deit3_small_patch16_224",
               "deit3_base_patch16_224", "vit_small_patch14_reg4_dinov2", "vit_base_patch14_reg4_dinov2",
               "vit_medium_patch16_gap_256"]
REQUIRED_ENTRIES = ["deit_small_distilled_patch16_224.fb_in1k", "deit_base_distilled_patch16_224.fb_in1k",
                    "deit3_small_patch16_224.fb_in1k", "deit3_base_patch16_224.fb_in22k_ft_in1k",
                    "vit_small_patch14_reg4_dinov2.lvd142m", "vit_base_patch14_reg4_dinov2.lvd142m"]


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every weight random (the zero-initialised head, tokens and the small LayerScale gains included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms' gains around 1, the rest around 0
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + float("norm" in name and name.endswith("weight")))


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_each_new_preset_has_timms_parameters_and_computes_its_logits(name):
    with torch.device("meta"):
        ours_full, theirs_full = vitkit.create_model(name), timm.create_model(name)
    want = {k: tuple(v.shape) for k, v in theirs_full.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours_full.state_dict().items()} == want  # names, shapes, so counts
    # The logits at a smaller image (the full depth and width; fewer patches, so the test stays quick).
    size = 56 if "patch14" in name else 64
    ours = vitkit.create_model(name, img_size=size, num_classes=7).eval()
    theirs = timm.create_model(name, img_size=size, num_classes=7).eval()
    _randomise(theirs)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    ours.load_state_dict(theirs.state_dict())  # strict: timm's weights into vitkit ...
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    _randomise(ours, seed=2)
    theirs.load_state_dict(ours.state_dict())  # ... and vitkit's into timm
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=1e-5)


def test_every_required_entry_is_registered_with_its_publishers_preprocessing():
    from timm.models import get_pretrained_cfg

    for name in REQUIRED_ENTRIES:
        e = PRETRAINED[name]
        c = get_pretrained_cfg(name)
        assert (e.mean, e.std, e.crop_pct, e.img_size, e.num_classes) == \
            (tuple(c.mean), tuple(c.std), c.crop_pct, c.input_size[1], c.num_classes), name
        assert e.license == c.license
    assert PRETRAINED["vit_small_patch14_reg4_dinov2.lvd142m"].labels is None  # features: no classifier
    assert PRETRAINED["deit3_base_patch16_224.fb_in22k_ft_in1k"].top1 == 85.700  # timm's results-imagenet.csv


def test_the_distilled_model_averages_its_two_heads_as_timm_does():
    kw = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    theirs = timm.models.deit.VisionTransformerDistilled(**kw).eval()
    _randomise(theirs)
    ours = vitkit.VisionTransformer(vitkit.ViTConfig(dist_token=True, **kw)).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        tokens = theirs.forward_features(x)
        averaged = (theirs.head(tokens[:, 0]) + theirs.head_dist(tokens[:, 1])) / 2  # DeiT's inference rule
        torch.testing.assert_close(ours(x), averaged, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                                   theirs.forward_head(tokens, pre_logits=True), atol=1e-5, rtol=1e-5)
    ours.train()  # fine-tuning trains on the average too (timm's default: distilled_training=False)
    assert ours(x).shape == (3, 5)


@pytest.mark.parametrize("kw, theirs_kw", [
    (dict(qk_norm=True), dict(qk_norm=True)),
    (dict(pool="gap", reg_tokens=2, fc_norm=True), dict(class_token=False, global_pool="avg", reg_tokens=2,
                                                         fc_norm=True)),
    (dict(reg_tokens=3, layer_scale=0.1), dict(reg_tokens=3, init_values=0.1)),  # registers inside the table
    (dict(pool="map", reg_tokens=1), dict(class_token=False, global_pool="map", reg_tokens=1)),
])
def test_other_combinations_compute_as_timm(kw, theirs_kw):
    base = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    theirs = timm.models.vision_transformer.VisionTransformer(**base, **theirs_kw).eval()
    _randomise(theirs)
    ours = vitkit.VisionTransformer(vitkit.ViTConfig(**base, **kw)).eval()
    ours.load_state_dict(theirs.state_dict())
    assert timm_model(ours.config).state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    back = vitkit.interop.from_timm(theirs).eval()  # a live timm model: its config read off it and its weights
    assert back.config.after_paper() == ours.config.after_paper()
    with torch.no_grad():
        torch.testing.assert_close(back(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_a_bare_timm_file_is_read_where_its_table_says_which_layout_it_is(tmp_path):
    """timm's files say nothing but shapes. DeiT III's 196-row table is 14x14 patches without a class row, or 195
    patches (not a square) with one: both fit, so the image size is asked for, and decides."""
    from safetensors.torch import save_file

    t = timm.create_model("deit3_small_patch16_224", depth=1).eval()
    _randomise(t)
    f = tmp_path / "deit3.safetensors"
    save_file({k: v.contiguous() for k, v in t.state_dict().items()}, str(f))
    with pytest.raises(ValueError, match=r"196 rows are either a square grid.*no_embed_class.*--img-size H W"):
        vitkit.load(f)
    x = torch.randn(1, 3, 224, 224)
    m = vitkit.load(f, img_size=224).eval()
    assert m.config.no_embed_class and m.config.layer_scale is not None
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), atol=1e-5, rtol=1e-5)
    # DINOv2's 1369 rows (1 + 4 prefix tokens): 37x37 without prefix rows, or 1364 patches with them
    d = timm.create_model("vit_small_patch14_reg4_dinov2", depth=1)
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(tmp_path / "dino.safetensors"))
    with pytest.raises(ValueError, match=r"1369 rows .* or 1364 patches, not a square grid"):
        vitkit.load(tmp_path / "dino.safetensors")
    got = vitkit.load(tmp_path / "dino.safetensors", img_size=518).config
    assert (got.img_size, got.reg_tokens, got.no_embed_class, got.num_classes) == (518, 4, True, 0)
    assert vitkit.load(tmp_path / "dino.safetensors", no_embed_class=True).config.img_size == 518
    # a timm Hub folder names its architecture in config.json: that settles it
    from timm.models._hub import save_for_hf

    save_for_hf(d, str(tmp_path / "dino-folder"), safe_serialization=True)
    assert vitkit.load(tmp_path / "dino-folder").config.no_embed_class


def test_a_table_too_short_for_its_prefix_tokens_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    m = vitkit.VisionTransformer(vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2))
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file({**sd, "reg_token": torch.zeros(1, 1000, 64)}, str(tmp_path / "h.safetensors"))
    with pytest.raises(ValueError, match=r"pos_embed has 17 rows, too few for the 1001 class/distillation/register"):
        vitkit.load(tmp_path / "h.safetensors", num_heads=2)


def _hub_cache(tmp_path: Path, names: list[str]) -> Path:
    from timm.models._hub import save_for_hf

    from test_pretrained import put_in_hub_cache  # tests/ is on sys.path

    hf = tmp_path / "hf"
    for name in names:
        t = timm.create_model(name.split(".")[0], num_classes=PRETRAINED[name].num_classes)
        _randomise(t, seed=len(name))
        save_for_hf(t, str(tmp_path / name), safe_serialization=True)
        put_in_hub_cache(hf, f"timm/{name}", tmp_path / name)
    return hf


def test_registered_weights_load_offline_as_timm_loads_them(tmp_path):
    names = ["deit_small_distilled_patch16_224.fb_in1k", "deit3_small_patch16_224.fb_in1k",
             "vit_small_patch14_reg4_dinov2.lvd142m"]
    hf = _hub_cache(tmp_path, names)
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    code = f"""
import torch, timm, vitkit
for name in {names!r}:
    ours = vitkit.create_model(name, pretrained=True).eval()
    theirs = timm.create_model(name, pretrained=True).eval()
    size = ours.config.img_size
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        print(name, (ours(x) - theirs(x)).abs().max().item(), ours.preprocessing["crop_pct"],
              ours.preprocessing.get("class_names") is not None)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()]
    assert [row[0] for row in rows] == names
    assert all(float(row[1]) < 1e-4 for row in rows), rows
    assert [row[2:] for row in rows] == [["0.9", "True"], ["0.9", "True"], ["1.0", "False"]]


def test_inspect_shows_the_distillation_token_and_leaves_registers_out(tmp_path, capsys):
    from vitkit.inspect.analysis import attention_maps, attention_rollout, readout_rows

    # hand-computed: 1 class + 1 distillation + 2 registers + 4 patches; the head reads tokens 0 and 1
    rel = torch.zeros(1, 8, 8)
    rel[0, 0, 4:] = torch.tensor([1.0, 0, 0, 0])
    rel[0, 1, 4:] = torch.tensor([0.0, 0, 0, 1])
    rel[0, 0, 2:4] = 5.0  # what the class token takes from the registers is never shown as a patch
    assert readout_rows(rel, num_prefix_tokens=4, readout=2).tolist() == [[0.5, 0.0, 0.0, 0.5]]
    assert readout_rows(rel, num_prefix_tokens=4, readout=1).tolist() == [[1.0, 0.0, 0.0, 0.0]]

    cfg = vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=3,
                           dist_token=True, reg_tokens=2)
    model = vitkit.VisionTransformer(cfg).eval()
    _randomise(model)
    x = torch.randn(2, 3, 32, 32)
    attns = attention_maps(model, x)
    assert attns[0].shape == (2, 4, 4 + 16, 4 + 16)
    heat = attention_rollout(model, x)
    assert heat.shape == (2, 4, 4)
    assert abs(float(heat.sum()) - 2.0) < 1e-4  # each image's map sums to 1 over the 16 patches alone
    model.save_pretrained(tmp_path / "ckpt", class_names=["a", "b", "c"])
    img = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (120, 30, 200)).save(img)
    assert main(["inspect", "attention", "--checkpoint", str(tmp_path / "ckpt"), "--image", str(img),
                 "--out", str(tmp_path / "att.png")]) == 0
    assert (tmp_path / "att.png").stat().st_size > 0
    assert main(["inspect", "explain", str(img), "--checkpoint", str(tmp_path / "ckpt"), "--method", "all",
                 "--no-faithfulness", "--out", str(tmp_path / "why")]) == 0
    assert (tmp_path / "why" / "x.png").is_file()


def test_attention_figure_gives_the_distillation_token_its_own_rows(tmp_path, monkeypatch):
    from vitkit.inspect import plots

    seen = {}
    monkeypatch.setattr(plots, "plot_attention_heads", lambda image, maps, out, layer: seen.update(maps))
    cfg = vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, num_classes=3,
                           dist_token=True, reg_tokens=4)
    vitkit.VisionTransformer(cfg).save_pretrained(tmp_path / "ckpt")
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    assert main(["inspect", "attention", "--checkpoint", str(tmp_path / "ckpt"), "--image", str(tmp_path / "x.png"),
                 "--out", str(tmp_path / "a.png")]) == 0
    assert list(seen) == ["class token", "distillation token"]
    assert all(v.shape == (2, 4, 4) for v in seen.values())  # heads x the patch grid: no register columns


def test_writers_that_cannot_hold_an_addition_refuse_it_by_name(tmp_path, capsys):
    cfg = vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, num_classes=3,
                           reg_tokens=4, layer_scale=1e-5)
    vitkit.VisionTransformer(cfg).save_pretrained(tmp_path / "ckpt")
    for fmt, out in (("hf", "hf"), ("jax", "m.npz")):
        assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", fmt,
                     "--out", str(tmp_path / out)]) == 2
        assert "reg_tokens, layer_scale" in capsys.readouterr().err and not (tmp_path / out).exists()
    with pytest.raises(ValueError, match="dist_token .* needs pool='cls'"):
        vitkit.ViTConfig(pool="gap", dist_token=True)


def test_eva_weights_are_refused_by_what_they_are(tmp_path):
    from safetensors.torch import save_file

    t = timm.create_model("vit_base_patch16_rope_reg1_gap_256", depth=1)
    save_file({k: v.contiguous() for k, v in t.state_dict().items()}, str(tmp_path / "rope.safetensors"))
    with pytest.raises(ValueError, match="Eva class.*rotary position embedding"):
        vitkit.load(tmp_path / "rope.safetensors")


ANTS_BEES = next((p for p in (Path(__file__).resolve().parents[2] / "shared/data/ants-bees.zip",
                              Path("/work/shared/data/ants-bees.zip")) if p.is_file()), None)


@pytest.mark.long
@pytest.mark.skipif(ANTS_BEES is None, reason="../shared/data/ants-bees.zip is not here")
def test_fine_tune_and_linear_probe_from_dinov2_features(tmp_path):
    """A features model (no head: DINOv2 with registers, timm's own save in a Hub cache) gets a new head for the
    photos' two classes, trains with the publisher's preprocessing (ImageNet mean/std, no crop), and
    --freeze-body trains that head alone. (The settings are given, not timed: the timing is tested elsewhere.)"""
    name = "vit_small_patch14_reg4_dinov2.lvd142m"
    hf = _hub_cache(tmp_path, [name])
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    for extra, out in (([], "ft"), (["--freeze-body"], "probe")):
        r = subprocess.run([sys.executable, "-m", "vitkit", "train", "--init", name, "--dataset", "folder",
                            "--data-dir", str(ANTS_BEES), "--epochs", "1", "--img-size", "56", "--precision", "fp32",
                            "--attention", "sdpa", "--no-compile", "--threads", "1", "--output", str(tmp_path / out),
                            *extra], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        m = vitkit.from_pretrained(tmp_path / out / "last")
        assert m.config.num_classes == 2 and m.config.reg_tokens == 4 and m.pos_embed.shape == (1, 16, 384)
        assert m.preprocessing["mean"] == [0.485, 0.456, 0.406] and m.preprocessing["crop_pct"] == 1.0
    assert "--freeze-body: only the head trains (770 parameters)" in r.stdout  # 384 x 2 + 2
    start = vitkit.create_model(name, pretrained=str(tmp_path / name / "model.safetensors"), img_size=56)
    probe = vitkit.from_pretrained(tmp_path / "probe" / "last")
    assert torch.equal(probe.blocks[5].ls2.gamma, start.blocks[5].ls2.gamma)  # the body stayed as DINOv2 left it
    assert torch.equal(probe.reg_token, start.reg_token)
