"""NaFlex (issue 52, item 3): images at their own aspect ratio in one padded, masked batch. References: Hugging
Face's SigLIP 2 (its size search, its patch layout, its vision tower's outputs) and timm's NaFlexVit (its outputs on
the same batch), and each image through the fixed-size path alone."""
from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit import ViTConfig, load
from vitkit.cli.main import main
from vitkit.data.augment import BatchAugment
from vitkit.interop.timm import from_timm
from vitkit.model import naflex
from vitkit.model.vit import VisionTransformer, record_attention
from vitkit.training.config import TrainConfig
from vitkit.training.trainer import Trainer

from helpers import digits_arrays

timm = pytest.importorskip("timm")
siglip2 = pytest.importorskip("transformers.models.siglip2")


def _images(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]


def _float(b, scale=255.0):
    return b.replace(patches=b.patches.float() / scale)


def _random_weights(m, std=0.1):
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m.eval()


def test_size_search_is_siglip2s():
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches as ref

    rng = random.Random(0)
    for _ in range(500):
        h, w = rng.randint(1, 3000), rng.randint(1, 3000)
        p, n = rng.choice([8, 14, 16, 32]), rng.choice([1, 4, 64, 196, 256, 576, 1024])
        assert naflex.size_for_budget(h, w, p, n) == ref(h, w, p, n), (h, w, p, n)
    h, w = naflex.size_for_budget(375, 500, 16, 256)  # a 4:3 photo: 4:3 kept, within the budget
    assert (h // 16) * (w // 16) <= 256 and abs(w / h - 4 / 3) < 0.1


def test_patches_are_laid_out_as_siglip2s_processor_and_timms():
    from timm.models.naflexvit import batch_patchify

    img = _images([(24, 40)])[0]
    patches, coords = naflex.patchify(img, 8)
    convert = siglip2.image_processing_siglip2.convert_image_to_patches
    try:  # transformers 5: a (C, H, W) tensor; before: an (H, W, C) array
        ref = np.asarray(convert(img, 8))
    except ValueError:
        ref = convert(img.permute(1, 2, 0).numpy(), 8)
    assert np.array_equal(patches.numpy(), ref)
    t, grid = batch_patchify(img[None], (8, 8))
    assert torch.equal(patches, t[0]) and grid == (3, 5)
    assert coords[:6].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [1, 0]]


POOLS = [dict(pool="cls"), dict(pool="gap", fc_norm=True, reg_tokens=2, no_embed_class=True), dict(pool="map"),
         dict(pool="cls", dist_token=True), dict(pool="gap", pos_embed="sincos2d"), dict(pool="cls", reg_tokens=1)]


@pytest.mark.parametrize("kw", POOLS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("impl", ["sdpa", "exact"])
def test_a_padded_batch_gives_each_image_its_own_logits(kw, impl):
    m = _random_weights(VisionTransformer(ViTConfig(img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=2,
                                                    num_heads=4, **kw))).set_attention(impl)
    imgs = _images([(24, 40), (32, 32), (8, 64)])  # cut as they are (batch_images would resize them to the budget)
    b = _float(naflex.collate([naflex.patchify(img, 8) for img in imgs], 20), 1.0)
    alone = torch.cat([m(img[None].float()) for img in imgs])
    torch.testing.assert_close(m(b), alone, atol=1e-5, rtol=1e-5)
    # whatever the padding holds, and however much of it there is, changes nothing
    noisy = b.replace(patches=torch.where(b.valid[..., None], b.patches, torch.randn_like(b.patches) * 100))
    torch.testing.assert_close(m(noisy), alone, atol=1e-5, rtol=1e-5)
    longer = _float(naflex.collate([naflex.patchify(img, 8) for img in imgs], 33), 1.0)
    torch.testing.assert_close(m(longer), alone, atol=1e-5, rtol=1e-5)


def test_no_token_attends_to_padding():
    m = _random_weights(VisionTransformer(ViTConfig(img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=2,
                                                    num_heads=4)))
    b = _float(naflex.batch_images(_images([(8, 16), (32, 32)]), 8, 16))
    with torch.no_grad(), record_attention(m) as maps:
        m(b)
    keys_valid = torch.cat([torch.ones(2, 1, dtype=torch.bool), b.valid], 1)  # the class token, then the patches
    for a in maps:
        assert float(a.masked_select(~keys_valid[:, None, None, :].expand_as(a)).abs().max()) == 0.0


def test_a_flipped_batch_is_the_batch_of_flipped_images():
    m = _random_weights(VisionTransformer(ViTConfig(img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=2,
                                                    num_heads=4)))
    imgs = _images([(24, 40), (16, 48)])
    b = naflex.batch_images(imgs, 8, 20)
    flipped = naflex.hflip(_float(b), torch.tensor([True, False]), 8)
    ref = _float(naflex.batch_images([imgs[0].flip(-1), imgs[1]], 8, 20))
    torch.testing.assert_close(m(flipped), m(ref), atol=1e-5, rtol=1e-5)


TIMM_NAFLEX = ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_map", "naflexvit_base_patch16_siglip",
               "naflexvit_so150m2_patch16_reg1_gap"]


@pytest.mark.parametrize("arch", TIMM_NAFLEX)
def test_timm_naflexvit_weights_give_timms_outputs(arch, tmp_path):
    t = _random_weights(timm.create_model(arch, embed_dim=64, depth=2, num_heads=4,
                                          num_classes=0 if "siglip" in arch else 3), std=0.3)
    b = _float(naflex.batch_images(_images([(100, 300), (256, 256), (40, 500)]), 16, 128))
    ref = t({"patches": b.patches, "patch_coord": b.coords, "patch_valid": b.valid})
    m = from_timm(t).eval()
    torch.testing.assert_close(m(b), ref, atol=1e-4, rtol=1e-4)
    x = torch.randn(2, 3, 224, 160)  # and as a plain batch of one non-square size
    torch.testing.assert_close(m(x), t(x), atol=1e-4, rtol=1e-4)
    # from a timm Hub folder (config.json names the architecture: SigLIP's tanh GELU and bilinear E_pos come from it)
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architecture": arch, "num_classes": m.config.num_classes}))
    save_file(t.state_dict(), tmp_path / "model.safetensors")
    loaded = load(tmp_path, num_heads=4).eval()
    if t.embeds.pos_embed_interp_mode != loaded.config.pos_interp:
        # timm before 1.0.30 resampled the SigLIP models' E_pos bicubically; SigLIP 2 (big_vision, Hugging Face) and
        # timm since resample bilinearly, which the architecture's name stands for
        ref = from_timm(t, pos_interp=loaded.config.pos_interp).eval()(b)
    torch.testing.assert_close(loaded(b), ref, atol=1e-4, rtol=1e-4)
    assert (loaded.config.mlp_act, loaded.config.pos_interp) == ((("gelu_tanh", "bilinear") if "siglip" in arch
                                                                  else ("gelu", "bicubic")))


def test_siglip2_vision_tower_gives_transformers_outputs(tmp_path):
    c = siglip2.Siglip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_patches=64, patch_size=8)
    h = _random_weights(siglip2.Siglip2VisionModel(c), std=0.2)
    h.save_pretrained(tmp_path)
    m = load(tmp_path).eval()
    assert (m.config.pool, m.config.mlp_act, m.config.pos_interp, m.config.img_size) == ("map", "gelu_tanh",
                                                                                         "bilinear", 64)
    b = _float(naflex.batch_images(_images([(30, 90), (64, 64), (10, 200)]), 8, 48), 127.5)
    with torch.no_grad():
        r = h(pixel_values=b.patches, pixel_attention_mask=b.valid.long(), spatial_shapes=torch.tensor(b.grids()))
        tokens = m.forward_features(b)
        pooled = m.forward_head(tokens, pre_logits=True, valid=b.valid)
    torch.testing.assert_close(pooled, r.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tokens * b.valid[..., None], r.last_hidden_state * b.valid[..., None], atol=1e-5,
                               rtol=1e-5)


def test_bad_naflex_input_is_one_clear_line(tmp_path):
    m = VisionTransformer(ViTConfig(img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=1, num_heads=4))
    with pytest.raises(ValueError, match="empty NaFlex batch"):
        naflex.collate([], 16)
    with pytest.raises(ValueError, match="has 20 patches, more than the budget of 16"):
        naflex.collate([naflex.patchify(_images([(32, 40)])[0], 8)], 16)
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        naflex.patchify(_images([(30, 40)])[0], 8)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        naflex.size_for_budget(30, 40, 8, 0)
    b = _float(naflex.batch_images(_images([(30, 40)]), 8, 16))
    with pytest.raises(ValueError, match="an image with no valid patch"):
        b.replace(valid=torch.zeros_like(b.valid))
    with pytest.raises(ValueError, match="takes 4x4 patches of 3 channels"):
        VisionTransformer(ViTConfig(img_size=32, patch_size=4, num_classes=5, embed_dim=32, depth=1,
                                    num_heads=4))(b)
    hybrid = VisionTransformer(ViTConfig(img_size=32, patch_size=1, hybrid="conv:8", num_classes=5, embed_dim=32,
                                         depth=1, num_heads=4))
    with pytest.raises(ValueError, match="hybrid model's patches come from its CNN"):
        hybrid(b)
    assert m(b).shape == (1, 5)
    t = timm.create_model("naflexvit_base_patch16_parfac_gap", embed_dim=64, depth=1, num_heads=4)
    with pytest.raises(ValueError, match="factorised position embedding"):
        from_timm(t.state_dict(), num_heads=4)
    for bad, message in ((dict(dataset="digits"), "reads image files"),
                         (dict(data_mode="memory"), "not --data-mode memory"),
                         (dict(mixup=0.8), "mixup=0.8 works on fixed-size image batches"),
                         (dict(crop_padding=4), "crop_padding=4"),
                         (dict(compile=True), "recompile"),
                         (dict(max_tokens=0), "max_tokens must be at least 1")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{"dataset": "folder", "data_dir": "x", "naflex": True, **bad})


def _photos(root, per_class=8):
    """Real digits as photos of many aspect ratios (as ants-bees' are), grey pixels in an RGB file."""
    x, y = digits_arrays()
    sizes = ((40, 56), (56, 40), (24, 72), (48, 48), (36, 60))
    for split, off in (("train", 0), ("val", 40)):
        for c in range(3):
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            for k, i in enumerate(np.where(y == c)[0][off: off + per_class]):
                h, w = sizes[k % len(sizes)]
                Image.fromarray(x[i]).resize((w, h), Image.BILINEAR).convert("RGB").save(d / f"{i}.png")
    return root


def test_naflex_training_reads_each_photo_at_its_aspect_ratio_and_trains(tmp_path, capsys):
    root = _photos(tmp_path / "photos")
    cfg = TrainConfig(dataset="folder", data_dir=str(root), cache_dir=str(tmp_path / "c"), naflex=True,
                      max_tokens=12, epochs=2, batch_size=8, lr=1e-3, hflip=True, workers=0, model="vit_nano_patch2_8",
                      model_args={"img_size": 16, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2},
                      output=str(tmp_path / "run"))
    t = Trainer(cfg, log=lambda s: None, progress=False)
    (x, y), = list(t.data.train.batches(list(range(5)), 5, False, torch.device("cpu")))
    assert isinstance(x, naflex.NaFlexBatch) and x.patches.shape == (5, 12, 8 * 8 * 3)
    # each photo's grid as SigLIP 2's search sizes it, within the budget
    names = t.data.train.names[:5]
    for grid, name in zip(x.grids(), names):
        w, h = Image.open(io.BytesIO(t.data.train.reader.read(name))).size
        assert grid == tuple(s // 8 for s in naflex.size_for_budget(h, w, 8, 12))
    assert {g for g in x.grids()} != {x.grids()[0]}  # not one shape for all
    result = t.fit()
    metrics = t.evaluate()
    assert result.epochs == 2 and metrics["n"] == 24 and np.isfinite(metrics["loss"])
    augment = BatchAugment([0.5] * 3, [0.25] * 3, (16, 16), 3, hflip=True)
    out, _ = augment(x, y, train=True, generator=torch.Generator().manual_seed(0))
    assert out.patches.dtype == torch.float32 and float(out.patches[~out.valid].abs().max()) == 0.0
    # the command line: the recipe's fixed-size augmentation left out, with a line saying so
    code = main(["train", "--dataset", "folder", "--data-dir", str(root), "--naflex", "--max-tokens", "12",
                 "--epochs", "1", "-b", "8", "--depth", "1", "--embed-dim", "32", "--num-heads", "2", "--workers", "0",
                 "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "cli")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "--naflex: without the recipe's crop_padding 4" in out and "at most 12 patches" in out
    assert "compile: off (--naflex" in (tmp_path / "cli" / "plan.json").read_text()
    # the checkpoint keeps its budget, and predict prepares a photo as training did: at its aspect ratio
    from vitkit.cli.predict import predict

    model = load(tmp_path / "cli" / "best").eval()
    assert model.preprocessing["naflex_max_tokens"] == 12
    photo = sorted((root / "val" / "c1").iterdir())[2]  # 24 x 72: 1:3
    got = predict(model, model.preprocessing, [str(photo)], topk=3)[0]["top"]
    img = torch.from_numpy(np.array(Image.open(photo).convert("RGB"))).permute(2, 0, 1)
    mean, std = (torch.tensor(model.preprocessing[k]) * 255 for k in ("mean", "std"))
    with torch.no_grad():
        want = model(naflex.normalize(naflex.batch_images([img], 8, 12), mean, std)).softmax(-1)[0]
    assert naflex.batch_images([img], 8, 12).grids() == [(2, 6)]
    assert [t["prob"] for t in got] == pytest.approx(want.sort(descending=True).values.tolist(), abs=2e-3)
