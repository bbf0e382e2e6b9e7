"""Official JAX checkpoints: files written from Flax models with the official code's module structure
(tests/flax_reference.py), so Flax itself names every parameter; vitkit must load each layout and give the Flax
model's logits, agree with timm's own ``.npz`` reader where timm has one, and refuse what it does not understand."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax_reference as ref  # noqa: E402  (tests/ is on sys.path: rootdir-relative import)

import vitkit  # noqa: E402
from vitkit.interop.jax import read_npz  # noqa: E402

TOL = 2e-4  # exact GELU on both sides: what is left is float32 rounding


def init(module, hw=(32, 32), seed=0):
    """Random parameters, every leaf perturbed (LayerNorm/GroupNorm scales and biases too, so swaps show)."""
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, *hw, 3))
    params = module.init(jax.random.PRNGKey(seed), x)["params"]
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 2), len(leaves))
    leaves = [a + 0.1 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)]
    params = jax.tree_util.tree_unflatten(tree, leaves)
    return params, x, np.asarray(module.apply({"params": params}, x))


def logits(model, x_nhwc):
    with torch.no_grad():
        return model.eval()(torch.from_numpy(np.array(x_nhwc)).permute(0, 3, 1, 2)).numpy()


def save(tmp_path, w, name="w.npz"):
    path = tmp_path / name
    np.savez(path, **w)
    return path


def vt(**kw):
    base = dict(num_classes=5, patches=(8, 8), hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
                approximate=False)
    return ref.VisionTransformer(**{**base, **kw})


def bv(**kw):
    base = dict(num_classes=5, patch_size=(8, 8), width=32, depth=2, num_heads=4, approximate=False)
    return ref.BigVisionViT(**{**base, **kw})


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("numbering", ["linen", "released"])
def test_vision_transformer_files(tmp_path, classifier, numbering):
    params, x, want = init(vt(classifier=classifier))
    w = ref.flatten(params)
    assert "Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel" in w  # Linen's own numbering
    if numbering == "released":
        w = ref.to_released_numbering(w)
    model = vitkit.load(save(tmp_path, w))
    assert model.config.pool == ("cls" if classifier == "token" else "gap") and model.config.num_heads == 4
    np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)


def test_released_layout_agrees_with_timm_reader(tmp_path):
    from timm.models.vision_transformer import VisionTransformer as TimmViT, _load_weights

    params, x, want = init(vt())
    path = save(tmp_path, ref.to_released_numbering(ref.flatten(params)))
    t = TimmViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, mlp_ratio=2).eval()
    _load_weights(t, str(path))
    np.testing.assert_allclose(logits(vitkit.load(path), x), logits(t, x), atol=TOL, rtol=TOL)


def test_tanh_gelu_is_the_only_difference(tmp_path):
    params, x, want = init(vt(approximate=True))
    got = logits(vitkit.load(save(tmp_path, ref.flatten(params))), x)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()  # GELU's tanh approximation, nothing more


@pytest.mark.parametrize("pool,posemb,scan,prefix", [
    ("gap", "learn", False, "params/"), ("gap", "sincos2d", True, ""), ("tok", "learn", True, "params/"),
    ("tok", "sincos2d", False, ""), ("map", "learn", False, ""), ("map", "sincos2d", True, "params/img/"),
    ("tok", "learn", False, ""), ("gap", "sincos2d", False, "params/")])
def test_big_vision_files(tmp_path, pool, posemb, scan, prefix):
    params, x, want = init(bv(pool_type=pool, posemb=posemb, scan=scan))
    w = ref.flatten(params, prefix)
    assert (f"{prefix}Transformer/encoderblock/LayerNorm_0/scale" in w) == scan
    if posemb == "sincos2d":  # no table: the size it was trained at is not in the file, and is asked for
        with pytest.raises(ValueError, match="no position table.*--img-size H W"):
            vitkit.load(save(tmp_path, w))
    model = vitkit.load(save(tmp_path, w), **({"img_size": 32} if posemb == "sincos2d" else {}))
    c = model.config
    assert c.pool == {"gap": "gap", "tok": "cls", "map": "map"}[pool]
    assert c.pos_embed == posemb and c.img_size == 32
    np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)


def test_map_head_agrees_with_timm_and_moves_both_ways(tmp_path):
    from timm.models.vision_transformer import VisionTransformer as TimmViT, _load_weights

    params, x, want = init(bv(pool_type="map"))
    path = save(tmp_path, ref.flatten(params, "params/"))
    t = TimmViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, class_token=False,
                global_pool="map").eval()
    _load_weights(t, str(path))
    model = vitkit.load(path)
    np.testing.assert_allclose(logits(model, x), logits(t, x), atol=TOL, rtol=TOL)
    back = vitkit.interop.from_timm(t)  # timm -> vitkit
    np.testing.assert_allclose(logits(back, x), want, atol=TOL, rtol=TOL)
    vitkit.interop.to_jax_npz(model, tmp_path / "out.npz")  # vitkit -> npz (MAPHead_0 names) -> timm
    t2 = TimmViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, class_token=False,
                 global_pool="map").eval()
    _load_weights(t2, str(tmp_path / "out.npz"))
    np.testing.assert_allclose(logits(t2, x), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("layers", [(), (1, 1)])
def test_hybrid_resnet_files(tmp_path, layers):
    """R+ViT: the root alone (R+ViT-Ti/16) and a two-stage ResNet (the R50 of R50+ViT-B/16 is (3, 4, 9))."""
    patch = (2, 2) if layers else (4, 4)
    params, x, want = init(vt(resnet_layers=layers, patches=patch), hw=(64, 64))
    w = ref.flatten(params)
    assert "conv_root/kernel" in w and (not layers or "block2/unit1/conv_proj/kernel" in w)
    model = vitkit.load(save(tmp_path, w))
    assert model.config.hybrid == "resnetv2:" + ",".join(map(str, layers)) and model.config.in_chans == 3
    np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)


@pytest.mark.slow  # the R+ViT layout is covered by test_hybrid_resnet_files by default; this adds timm's R26
def test_hybrid_agrees_with_timm_r26(tmp_path):
    """timm's own R26+ViT-S/32 (ResNetV2 with StdConv2dSame) reads the same file and computes the same."""
    import timm
    from timm.models.vision_transformer import _load_weights

    module = vt(resnet_layers=(2, 2, 2, 2), patches=(1, 1), hidden_size=384, num_heads=6, mlp_dim=1536,
                num_layers=1)
    params, x, want = init(module, hw=(32, 32))
    path = save(tmp_path, ref.to_released_numbering(ref.flatten(params)))
    t = timm.create_model("vit_small_r26_s32_224", img_size=32, depth=1, num_classes=5).eval()
    _load_weights(t, str(path))
    model = vitkit.load(path)
    np.testing.assert_allclose(logits(model, x), want, atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(logits(model, x), logits(t, x), atol=1e-3, rtol=1e-3)  # timm's GN eps is 1e-5
    t.load_state_dict(vitkit.interop.to_timm(model))  # and the state dict moves as it is


def test_pre_logits_layer_reads_as_the_official_model_and_goes_on_fine_tuning(tmp_path):
    """§3.1's pre-training head (the official code's representation_size: Dense + tanh, then the head): the same
    logits as the official model; fine-tuning for other classes replaces both with one zero D x K layer."""
    params, x, want = init(vt(representation_size=16))
    path = save(tmp_path, ref.flatten(params))
    model = vitkit.load(path)
    assert model.config.representation_size == 16 and model.head.in_features == 16
    np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)
    back = tmp_path / "back.npz"
    vitkit.interop.to_jax_npz(model, back)  # and written back in the released layout, pre_logits and all
    assert {"pre_logits/kernel", "pre_logits/bias"} <= set(np.load(back))
    np.testing.assert_allclose(logits(vitkit.load(back), x), want, atol=TOL, rtol=TOL)
    new = vitkit.load(path, num_classes=3)
    assert new.config.representation_size is None and new.pre_logits is None
    assert new.head.weight.shape == (3, model.config.embed_dim) and torch.count_nonzero(new.head.weight) == 0
    with pytest.raises(ValueError, match="pre-training head's hidden layer.*representation_size=16"):
        vitkit.interop.to_timm(model)


def test_unread_and_missing_keys_are_errors(tmp_path):
    params, _, _ = init(bv(pool_type="map"))
    w = ref.flatten(params, "params/")
    with pytest.raises(ValueError, match=r"not understood.*params/extra/kernel"):
        vitkit.load(save(tmp_path, {**w, "params/extra/kernel": np.zeros(3)}, "extra.npz"))
    w.pop("params/MAPHead_0/LayerNorm_0/scale")
    with pytest.raises(ValueError, match="missing key 'params/MAPHead_0/LayerNorm_0/scale'"):
        vitkit.load(save(tmp_path, w, "missing.npz"))


def test_non_square_tok_needs_and_takes_img_size(tmp_path):
    params, x, want = init(bv(pool_type="tok"), hw=(32, 48))
    path = save(tmp_path, ref.flatten(params))
    with pytest.raises(ValueError, match="not a square grid.*`--img-size H W`"):
        vitkit.load(path)
    np.testing.assert_allclose(logits(vitkit.load(path, img_size=(32, 48)), x), want, atol=TOL, rtol=TOL)
    out = tmp_path / "imported"
    r = subprocess.run([sys.executable, "-m", "vitkit", "import", str(path), "--out", str(out), "--img-size", "32x48"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(logits(vitkit.from_pretrained(out), x), want, atol=TOL, rtol=TOL)
    r = subprocess.run([sys.executable, "-m", "vitkit", "import", str(path), "--out", str(tmp_path / "o2")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "img_size" in r.stderr and "Traceback" not in r.stderr


def test_vision_transformer_non_square(tmp_path):
    params, x, want = init(vt(), hw=(32, 48))  # 4 x 6 patches + the class token: 25 rows, which is 5 x 5
    path = save(tmp_path, ref.flatten(params))
    with pytest.raises(ValueError, match="not a square grid"):
        vitkit.load(path)
    np.testing.assert_allclose(logits(vitkit.load(path, img_size=(32, 48)), x), want, atol=TOL, rtol=TOL)


def test_sincos_file_at_another_size(tmp_path):
    params, _, _ = init(bv(posemb="sincos2d"))
    model = vitkit.load(save(tmp_path, ref.flatten(params)), img_size=(48, 64))
    assert model.config.img_size == (48, 64) and model.config.pos_embed == "sincos2d"
    x = jax.random.normal(jax.random.PRNGKey(5), (1, 48, 64, 3))
    want = np.asarray(bv(posemb="sincos2d").apply({"params": params}, x))
    np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)
    assert read_npz(tmp_path / "w.npz")  # the file itself is untouched and still readable


def test_a_naflex_dense_patch_embedding_is_refused_by_key_not_a_traceback(tmp_path, capsys):
    """big_vision's NaFlex models embed flattened patches with a Dense (a 2-D kernel): it ended in a raw
    `RuntimeError: permute(sparse_coo)` traceback."""
    from vitkit.cli.main import main

    params, _, _ = init(bv(pool_type="gap"))
    w = ref.flatten(params)
    kernel = next(k for k in w if k.endswith("embedding/kernel"))
    w[kernel] = np.asarray(w[kernel]).reshape(-1, np.shape(w[kernel])[-1])  # (p*p*3, D), as NaFlex stores it
    path = save(tmp_path, w)
    with pytest.raises(ValueError, match=r"embedding/kernel has shape \(192, 32\).*NaFlex"):
        vitkit.load(path)
    assert main(["import", "--from", "jax", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "NaFlex" in err and "Traceback" not in err


@pytest.mark.parametrize("layout", ["vision_transformer", "big_vision gap"])
def test_a_given_size_whose_patch_count_is_square_is_the_tables_not_a_resample(tmp_path, layout):
    """32x128 with patch 8 is a 4x16 grid, 64 = 8² patches: the size given is the table's, not a target to resample
    an 8x8 reading to (the logits were off by 0.31 / 0.14, issue 48 item 4). Flax's logits are the reference."""
    from vitkit.cli.main import main

    module = vt() if layout == "vision_transformer" else bv(pool_type="gap")
    params, x, want = init(module, hw=(32, 128))
    path = save(tmp_path, ref.flatten(params))
    for model in (vitkit.load(path, img_size=(32, 128)), vitkit.interop.from_jax_npz(path, img_size=(32, 128))):
        assert model.config.img_size == (32, 128)
        np.testing.assert_allclose(logits(model, x), want, atol=TOL, rtol=TOL)
    assert main(["import", str(path), "--out", str(tmp_path / "o"), "--img-size", "32", "128"]) == 0
    np.testing.assert_allclose(logits(vitkit.from_pretrained(tmp_path / "o"), x), want, atol=TOL, rtol=TOL)
    # a size with another patch count is still §3.2's new size: the square reading, resampled
    model = vitkit.load(path, img_size=(96, 96))
    assert model.config.img_size in (96, (96, 96)) and model.pos_embed.shape[1] == 144 + (layout != "big_vision gap")


def test_a_file_without_its_size_is_read_square_and_the_import_says_what_it_assumed(tmp_path, capsys):
    """A 4x16 table without a size is read as 8x8 (no reader can tell): `vitkit import` prints the size and pooling
    it assumed, so that a user can see it (issue 48 item 5)."""
    from vitkit.cli.main import main

    params, _, _ = init(bv(pool_type="gap"), hw=(32, 128))
    path = save(tmp_path, ref.flatten(params))
    assert main(["import", str(path), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "image size 64x64 (assumed" in out and "--img-size H W" in out
    assert "pooling gap (assumed" in out and "pool_type='0'" in out


def test_a_non_square_jax_export_keeps_its_size(tmp_path):
    """vitkit's official-layout export of a 32x128 model writes its H x W beside the flat table; read back it is the
    same model, and read with H and W swapped it is resampled from the written size, never reinterpreted."""
    from vitkit.interop.jax import IMG_SIZE_KEY, to_jax_npz

    model = vitkit.create_model("vit_tiny_patch16_224", img_size=(32, 128), patch_size=8, depth=1,
                                num_classes=3).eval()
    with torch.no_grad():
        model.pos_embed.normal_(0, 1)
        model.head.weight.normal_(0, 0.1)
    to_jax_npz(model, tmp_path / "m.npz")
    assert read_npz(tmp_path / "m.npz")[IMG_SIZE_KEY].tolist() == [32, 128]
    back = vitkit.load(tmp_path / "m.npz")
    assert back.config.img_size == (32, 128)
    x = torch.randn(2, 3, 32, 128)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), model(x), atol=1e-5, rtol=1e-5)
    swapped = vitkit.load(tmp_path / "m.npz", img_size=(128, 32))
    assert swapped.config.img_size == (128, 32)
    torch.testing.assert_close(swapped.pos_embed.detach(),
                               vitkit.resample_pos_embed(model.pos_embed.detach(), (16, 4), old_grid=(4, 16)))
