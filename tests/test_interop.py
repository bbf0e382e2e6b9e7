"""Weights in and out, checked against timm, Hugging Face transformers and timm's own .npz reader."""
import os
import pickle

import numpy as np
import pytest
import torch

import vitkit
from vitkit.interop import (detect_format, from_hf, from_jax_npz, from_timm, load, timm_kwargs, to_hf,
                            to_jax_npz, to_timm)

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402


def _timm(name, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **kw).eval()


def _images(n=2, size=224, chans=3):
    return torch.randn(n, chans, size, size, generator=torch.Generator().manual_seed(1))


CASES = [  # (timm name, kwargs): the paper's class-token models and the GAP variants
    ("vit_tiny_patch16_224", {}),
    ("vit_base_patch16_224", {}),
    ("vit_base_patch32_224", {}),
    ("vit_tiny_patch16_224", dict(class_token=False, global_pool="avg", fc_norm=False)),  # paper's GAP
    ("vit_base_patch32_224", dict(class_token=False, global_pool="avg")),  # timm's GAP (fc_norm)
]


@pytest.mark.parametrize("name,kw", CASES)
def test_logits_equal_timm_and_round_trip_is_bit_exact(name, kw):
    ref = _timm(name, num_classes=10, **kw)
    ours = from_timm(ref).eval()
    x = _images()
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    assert diff <= 1e-5, diff
    back = to_timm(ours)
    sd = ref.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # from the bare state dict too (config inferred from shapes alone)
    ours2 = from_timm(sd)
    assert ours2.config.pool == ("gap" if kw else "cls") and ours2.config.num_heads == ref.blocks[0].attn.num_heads


def test_timm_model_built_from_our_config_has_our_logits():
    ours = vitkit.create_model("vit_small_patch16_224", img_size=64, num_classes=7, pool="gap").eval()
    with torch.no_grad():
        ours.head.weight.normal_(0, 0.02)
    ref = TimmViT(**timm_kwargs(ours.config)).eval()
    ref.load_state_dict(to_timm(ours))
    x = _images(size=64)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5


transformers = pytest.importorskip("transformers")


def _hf(hidden, layers, heads, patch, size=224, classes=10, qkv_bias=True):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                 intermediate_size=4 * hidden, image_size=size, patch_size=patch, num_labels=classes,
                                 qkv_bias=qkv_bias)
    return transformers.ViTForImageClassification(cfg).eval()


@pytest.mark.parametrize("hidden,layers,heads,patch", [(192, 12, 3, 16), (768, 12, 12, 16), (768, 12, 12, 32)])
def test_logits_equal_hugging_face_and_round_trip_is_bit_exact(tmp_path, hidden, layers, heads, patch):
    ref = _hf(hidden, layers, heads, patch)
    with torch.no_grad():
        ref.classifier.weight.normal_(0, 0.02)
    ours = from_hf(ref).eval()
    x = _images()
    with torch.no_grad():
        diff = (ours(x) - ref(pixel_values=x).logits).abs().max().item()
    assert diff <= 1e-5, diff
    sd, cfg = to_hf(ours)
    assert cfg["layer_norm_eps"] == ref.config.layer_norm_eps
    ref.save_pretrained(tmp_path)  # the names transformers writes to files, whatever its in-memory names
    from safetensors.torch import load_file

    ref_sd = load_file(str(tmp_path / "model.safetensors"))
    assert set(sd) == set(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    assert from_hf(tmp_path).state_dict().keys() == ours.state_dict().keys()


def test_hugging_face_folder_both_ways(tmp_path):
    ref = _hf(64, 2, 4, 8, size=32, classes=3, qkv_bias=False)
    ref.save_pretrained(tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    ours = load(tmp_path / "hf").eval()
    assert not ours.config.qkv_bias
    from vitkit.cli.main import main

    assert main(["export", "--checkpoint", str(tmp_path / "hf"), "--format", "hf", "--out", str(tmp_path / "o")]) == 0
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "o").eval()
    x = _images(size=32)
    with torch.no_grad():
        torch.testing.assert_close(back(pixel_values=x).logits, ref(pixel_values=x).logits, rtol=0, atol=1e-6)


def test_hugging_face_cannot_hold_gap_models():
    with pytest.raises(ValueError, match="pool='gap'"):
        to_hf(vitkit.create_model("vit_tiny_patch16_224", pool="gap"))


# ------------------------------------------------------------------------------------------------ JAX .npz
def _to_big_vision(w, scanned=False):
    """Rename the vision_transformer layout into big_vision's (what big_vision's own checkpoints look like)."""
    out = {}
    depth = len({k.split("/")[1] for k in w if k.startswith("Transformer/encoderblock_")})
    for k, v in w.items():
        k = (k.replace("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0")
             .replace("LayerNorm_2", "LayerNorm_1").replace("MlpBlock_3", "MlpBlock_0")
             .replace("Transformer/posembed_input/pos_embedding", "pos_embedding"))
        out["params/" + k] = v
    if scanned:
        stacked = {}
        for k in [k for k in out if "encoderblock_0/" in k]:
            parts = [out.pop(k.replace("encoderblock_0/", f"encoderblock_{i}/")) for i in range(depth)]
            stacked[k.replace("encoderblock_0/", "encoderblock/")] = np.stack(parts)
        out.update(stacked)
    return out


@pytest.mark.parametrize("layout", ["vision_transformer", "big_vision", "big_vision_scanned"])
@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_official_npz_loads_and_matches_timms_reader(tmp_path, layout, pool):
    from timm.models.vision_transformer import _load_weights

    ours = vitkit.create_model("vit_tiny_patch16_224", img_size=64, num_classes=5, pool=pool).eval()
    with torch.no_grad():
        ours.head.weight.normal_(0, 0.02)
    path = tmp_path / "vit.npz"
    to_jax_npz(ours, path)
    if layout != "vision_transformer":
        w = dict(np.load(path))
        np.savez(path, **_to_big_vision(w, scanned=layout.endswith("scanned")))
    # an independent reader: timm's loader for the official checkpoints
    ref = TimmViT(**timm_kwargs(ours.config)).eval()
    _load_weights(ref, str(path))
    back = from_jax_npz(path).eval()
    assert back.config == ours.config
    x = _images(size=64)
    with torch.no_grad():
        assert (ref(x) - ours(x)).abs().max() <= 1e-5
        assert (back(x) - ours(x)).abs().max() <= 1e-6


def test_npz_with_a_representation_layer_keeps_it_before_its_head(tmp_path):
    ours = vitkit.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5)
    path = tmp_path / "i21k.npz"
    to_jax_npz(ours, path)
    w = dict(np.load(path))
    w["pre_logits/kernel"], w["pre_logits/bias"] = np.zeros((192, 96), np.float32), np.zeros(96, np.float32)
    w["head/kernel"] = np.zeros((96, 5), np.float32)
    np.savez(path, **w)
    got = from_jax_npz(path)
    assert got.config.num_classes == 5 and got.config.representation_size == 96
    w.pop("head/kernel"), w.pop("head/bias")
    np.savez(path, **w)
    with pytest.raises(ValueError, match="pre_logits layer .* without the head"):
        from_jax_npz(path)


# ------------------------------------------------------------------------------------------------ errors, safety
def test_shape_mismatch_names_key_and_shapes():
    sd = _timm("vit_tiny_patch16_224").state_dict()
    sd["blocks.3.mlp.fc1.weight"] = torch.zeros(100, 192)
    with pytest.raises(ValueError, match=r"blocks\.3\.mlp\.fc1\.weight has shape \(100, 192\), the model expects "
                                         r"\(768, 192\)"):
        from_timm(sd)


def test_export_of_a_hybrid_to_timm_names_the_stem():
    cfg = vitkit.ViTConfig(img_size=16, patch_size=1, num_classes=3, embed_dim=32, depth=1, num_heads=2,
                           hybrid="conv:8,M,16,M")
    model = vitkit.VisionTransformer(cfg)
    with pytest.raises(ValueError, match=r"hybrid='conv:8,M,16,M': only the official R\+ViT hybrids"):
        to_timm(model)


def test_unrecognised_file_lists_supported_formats(tmp_path):
    p = tmp_path / "weights.txt"
    p.write_text("hello")
    with pytest.raises(ValueError, match="supported: a vitkit folder"):
        load(p)


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "model.pth"
    with open(bad, "wb") as f:
        pickle.dump({"patch_embed.proj.weight": _Evil(marker)}, f)
    torch.save({"x": _Evil(marker)}, tmp_path / "model2.pt")
    for p in (bad, tmp_path / "model2.pt"):
        with pytest.raises(ValueError, match="refused to load|not a readable torch checkpoint"):
            load(p)
    assert not marker.exists()
    from vitkit.cli.main import main

    assert main(["import", "--from", "timm", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert not marker.exists()


def test_cli_import_timm_then_finetune_at_a_new_resolution(tmp_path):
    ref = _timm("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4)
    from safetensors.torch import save_file

    save_file(ref.state_dict(), str(tmp_path / "timm.safetensors"))
    from vitkit.cli.main import main

    assert main(["import", "--from", "timm", str(tmp_path / "timm.safetensors"), "--out", str(tmp_path / "v")]) == 0
    m = vitkit.from_pretrained(tmp_path / "v", img_size=48, num_classes=3)
    assert m.pos_embed.shape == (1, 1 + 144, 192) and m.head.weight.abs().sum() == 0
    assert main(["export", "--checkpoint", str(tmp_path / "v"), "--format", "timm",
                 "--out", str(tmp_path / "t.safetensors")]) == 0
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "t.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


def test_every_converter_names_keys_it_does_not_understand(tmp_path):
    """The converter contract for the timm and Hugging Face layouts (the JAX ones: tests/test_official_jax.py)."""
    from safetensors.torch import save_file

    model = vitkit.VisionTransformer(vitkit.ViTConfig(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                                      num_classes=3))
    sd = {k: v.contiguous() for k, v in vitkit.interop.to_timm(model).items()}
    save_file({**sd, "blocks.0.gamma_1": torch.ones(32)}, tmp_path / "timm.safetensors")  # timm's Eva (RoPE) class
    with pytest.raises(ValueError, match=r"blocks\.0\.gamma_1.*Eva"):
        vitkit.load(tmp_path / "timm.safetensors", num_heads=2)
    save_file({**sd, "blocks.0.ls1.gamma": torch.ones(32)}, tmp_path / "timm1.safetensors")  # half a LayerScale
    with pytest.raises(ValueError, match=r"missing \['blocks\.0\.ls2\.gamma'\]"):
        vitkit.load(tmp_path / "timm1.safetensors", num_heads=2)
    save_file({**sd, "blocks.0.attn.extra": torch.ones(2)}, tmp_path / "timm2.safetensors")
    with pytest.raises(ValueError, match=r"unexpected \['blocks\.0\.attn\.extra'\]"):
        vitkit.load(tmp_path / "timm2.safetensors", num_heads=2)
    hf, _ = vitkit.interop.to_hf(model)
    save_file({**{k: v.contiguous() for k, v in hf.items()}, "vit.encoder.layer.0.extra.weight": torch.ones(2)},
              tmp_path / "hf.safetensors")
    with pytest.raises(ValueError, match=r"vit\.encoder\.layer\.0\.extra\.weight"):
        vitkit.load(tmp_path / "hf.safetensors", num_heads=2)


def test_image_size_flag_takes_square_and_non_square():
    import argparse

    from vitkit.cli.common import parse_image_size

    assert parse_image_size(["224"]) == 224 and parse_image_size(["224x160"]) == (224, 160)
    assert parse_image_size(["224", "160"]) == (224, 160) and parse_image_size(["96", "96"]) == 96
    for bad in (["0"], ["a"], ["1", "2", "3"], ["224x"]):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_image_size(bad)


def test_broken_npz_files_are_refused_by_name(tmp_path):
    """Truncated, foreign, single-array and object-array .npz files: one clear error each, never an unpickle."""
    import numpy as np

    from vitkit.interop.jax import read_npz

    model = vitkit.VisionTransformer(vitkit.ViTConfig(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                                      num_classes=3))
    vitkit.interop.to_jax_npz(model, tmp_path / "ok.npz")
    whole = (tmp_path / "ok.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npz").write_bytes((tmp_path / "one.npy").read_bytes())
    np.savez(tmp_path / "obj.npz", a=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="cut.npz: not a readable .npz file"):
        read_npz(tmp_path / "cut.npz")
    for name in ("text.npz", "one.npz"):
        with pytest.raises(ValueError, match=f"{name}: not an .npz file"):
            read_npz(tmp_path / name)
    with pytest.raises(ValueError, match="obj.npz: holds object .pickled. arrays; vitkit never unpickles"):
        read_npz(tmp_path / "obj.npz")


def test_timm_and_hugging_face_files_given_a_size_with_a_square_patch_count_keep_that_size(tmp_path):
    """A 32x128 model with patch 8 (4x16 = 64 = 8² patches) saved by timm and by transformers, as bare weight files
    that do not say their size: loaded with img_size=(32, 128) it is that model, not an 8x8 reading resampled to
    4x16 (issue 48 item 4). The libraries' own logits are the reference."""
    from safetensors.torch import save_file

    x = torch.randn(2, 3, 32, 128, generator=torch.Generator().manual_seed(3))
    ref = _timm("vit_tiny_patch16_224", img_size=(32, 128), patch_size=8, depth=2, num_classes=4)
    with torch.no_grad():
        ref.pos_embed.normal_(0, 1)
        ref.head.weight.normal_(0, 0.1)
        want = ref(x)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "timm.safetensors"))
    ours = load(tmp_path / "timm.safetensors", img_size=(32, 128)).eval()
    assert ours.config.img_size == (32, 128)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)

    hf = _hf(64, 2, 4, 8, size=(32, 128), classes=3)
    with torch.no_grad():
        hf.vit.embeddings.position_embeddings.normal_(0, 1)
        hf.classifier.weight.normal_(0, 0.1)
        want = hf(pixel_values=x).logits
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "hf.safetensors"))
    ours = load(tmp_path / "hf.safetensors", img_size=(32, 128), num_heads=4).eval()
    assert ours.config.img_size == (32, 128)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)
