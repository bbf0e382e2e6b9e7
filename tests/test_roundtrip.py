"""Every format vitkit writes, for models that differ from what a reader would guess (4 heads at width 64, GAP with
fc_norm, a MAP head, a CNN stem, a non-square input, a sin-cos position embedding, registers with LayerScale, DeiT's
distilled model with q/k norm): read back by vitkit *and* by the
format's own reader (timm, transformers, onnxruntime, and for the official layout a Flax model with the official
code's module structure, tests/flax_reference.py) with the logits compared, or refused by name when the format
cannot hold the model. int8 ONNX files are run by onnxruntime and read back with their config."""
from __future__ import annotations

import pytest
import torch

import vitkit
from vitkit.cli.main import main
from vitkit.interop.timm import timm_model

MODELS = {
    "heads4": dict(embed_dim=64, num_heads=4),  # a width-64 model's heads cannot be read off its weights
    "gap-fcnorm": dict(embed_dim=64, num_heads=2, pool="gap", fc_norm=True),
    "map": dict(embed_dim=64, num_heads=4, pool="map"),
    "hybrid": dict(embed_dim=64, num_heads=4, hybrid="conv:8,8", patch_size=2, img_size=16),
    "non-square": dict(embed_dim=64, num_heads=4, img_size=(32, 48)),
    "sincos": dict(embed_dim=64, num_heads=4, pos_embed="sincos2d"),
    # after the paper: registers + LayerScale + a patch-only position table (DINOv2's), and DeiT's distilled model
    "reg-layerscale": dict(embed_dim=64, num_heads=4, reg_tokens=4, layer_scale=1e-5, no_embed_class=True),
    "distilled-qknorm": dict(embed_dim=64, num_heads=4, dist_token=True, qk_norm=True),
}
FORMATS = ("safetensors", "timm", "hf", "jax", "onnx", "int8")
# what a format cannot hold: refused by name at export, never written wrong
CANNOT = {("timm", "hybrid"), ("timm", "sincos"), ("hf", "gap-fcnorm"), ("hf", "map"), ("hf", "hybrid"),
          ("hf", "sincos"), ("jax", "gap-fcnorm"), ("jax", "hybrid"), ("jax", "sincos"),
          ("hf", "reg-layerscale"), ("hf", "distilled-qknorm"), ("jax", "reg-layerscale"), ("jax", "distilled-qknorm")}


# where the format has no reader of its own to compare with: vitkit's own files, and official files that only
# vitkit's and timm's loaders read (big_vision's MAP head beside vision_transformer's blocks)
NO_READER = {("safetensors", n) for n in MODELS} | {("jax", "map")}


def _model(name: str) -> vitkit.VisionTransformer:
    torch.manual_seed(0)
    kw = dict(img_size=32, patch_size=8, depth=2, num_classes=5, in_chans=3)
    m = vitkit.VisionTransformer(vitkit.ViTConfig(**{**kw, **MODELS[name]})).eval()
    with torch.no_grad():
        for p in m.parameters():  # every weight random, the head and the zero-initialised ones included
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _x(m):
    h, w = (m.config.img_size, m.config.img_size) if isinstance(m.config.img_size, int) else m.config.img_size
    return torch.randn(3, 3, h, w, generator=torch.Generator().manual_seed(1))


def _reference(fmt: str, out, m) -> torch.Tensor | None:
    """The format's own reader on the file vitkit wrote (None where none is installed)."""
    x = _x(m)
    if fmt == "timm":
        timm = pytest.importorskip("timm")
        from safetensors.torch import load_file

        ref = timm_model(m.config).eval()
        ref.load_state_dict(load_file(str(out)))  # strict: every key of timm's model, nothing else
        with torch.no_grad():
            return ref(x)
    if fmt == "hf":
        transformers = pytest.importorskip("transformers")
        ref = transformers.ViTForImageClassification.from_pretrained(str(out)).eval()
        with torch.no_grad():
            return ref(pixel_values=x).logits
    if fmt in ("onnx", "int8"):
        ort = pytest.importorskip("onnxruntime")
        s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        return torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    if fmt == "jax" and m.config.pool == "cls" and not m.config.hybrid:
        return _flax_logits(out, m, x)
    return None


def _flax_logits(npz, m, x: torch.Tensor) -> torch.Tensor:
    """The official vision_transformer module structure (Flax Linen) applied to the file: its keys unflattened as
    the official loader does, the released files' block numbering renamed to Linen's (flax's convert_pre_linen)."""
    pytest.importorskip("flax")
    import jax.numpy as jnp
    import numpy as np
    from flax import traverse_util
    from flax.training.checkpoints import convert_pre_linen

    import flax_reference as ref  # tests/ is on sys.path

    c = m.config
    flat = dict(np.load(npz))
    params = convert_pre_linen(traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()}))
    patch = (c.patch_size, c.patch_size) if isinstance(c.patch_size, int) else tuple(c.patch_size)
    module = ref.VisionTransformer(num_classes=c.num_classes, patches=patch, hidden_size=c.embed_dim,
                                   num_layers=c.depth, num_heads=c.num_heads, mlp_dim=int(c.embed_dim * c.mlp_ratio),
                                   approximate=False)  # vitkit's GELU is the exact one
    y = module.apply({"params": params}, jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
    return torch.from_numpy(np.array(y))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_format_round_trips_or_is_refused_by_name(tmp_path, capsys, name):
    m = _model(name)
    src = tmp_path / "src"
    m.save_pretrained(src)
    x = _x(m)
    with torch.no_grad():
        want = m(x)
    for fmt in FORMATS:
        if fmt in ("onnx", "int8") and name not in ("heads4", "non-square", "hybrid", "map", "reg-layerscale",
                                                    "distilled-qknorm"):
            continue  # ONNX exports take seconds each: the models the others differ from most
        suffix = {"timm": "safetensors", "jax": "npz", "int8": "onnx"}.get(fmt, fmt)
        out = tmp_path / f"out-{fmt}.{suffix}" if fmt != "hf" else tmp_path / "out-hf"
        capsys.readouterr()
        flags = ["--format", "onnx", "--int8"] if fmt == "int8" else ["--format", fmt]
        code = main(["export", "--checkpoint", str(src), *flags, "--out", str(out)])
        err = capsys.readouterr().err
        if (fmt, name) in CANNOT:
            assert code == 2 and "error:" in err and not out.exists(), (fmt, name, err)
            continue
        assert code == 0, (fmt, name, err)
        extra = {"img_size": m.config.img_size} if fmt == "jax" and name == "non-square" else {}
        if fmt == "onnx":
            back_logits = _reference("onnx", out, m)
            torch.testing.assert_close(back_logits, want, atol=1e-4, rtol=1e-4)
            continue
        if fmt == "int8":  # int8 weights move the logits a little: within the export's own bound, same config
            from vitkit.serving.onnx import INT8_LIMIT, OnnxModel, relative_error

            assert relative_error(_reference("int8", out, m), want) < INT8_LIMIT, name
            back = OnnxModel(out)
            assert back.config == m.config and back.int8, name
            continue
        back = vitkit.load(out, **extra).eval()
        assert back.config.num_heads == m.config.num_heads and back.config.pool == m.config.pool, (fmt, name)
        assert back.config.img_size in (m.config.img_size, list(m.config.img_size)
                                        if isinstance(m.config.img_size, tuple) else m.config.img_size)
        with torch.no_grad():
            got = back(x)
        tol = 1e-4 if fmt != "jax" else 2e-3  # the official layout's GELU is tanh-approximate: exact here too?
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"{fmt} {name}")
        ref = _reference(fmt, out, m)
        assert ref is not None or (fmt, name) in NO_READER, (fmt, name)
        if ref is not None:
            torch.testing.assert_close(ref, want, atol=1e-4, rtol=1e-4, msg=f"{fmt} reader {name}")


def test_a_timm_file_without_vitkits_metadata_is_read_only_when_the_heads_are_standard(tmp_path, capsys):
    from safetensors.torch import save_file

    m = _model("heads4")
    bare = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(bare))  # what timm itself would write
    with pytest.raises(ValueError, match="number of attention heads is not in the weights.*--num-heads"):
        vitkit.load(bare)
    assert main(["import", "--from", "timm", str(bare), "--out", str(tmp_path / "a")]) == 2
    assert "--num-heads N" in capsys.readouterr().err
    assert main(["import", "--from", "timm", str(bare), "--num-heads", "4", "--out", str(tmp_path / "b")]) == 0
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(tmp_path / "b")(_x(m)), m(_x(m)))
    # a standard width (ViT-Ti: 192, 3 heads) is read as every published checkpoint of that width
    ti = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=3)
    save_file({k: v.contiguous() for k, v in ti.state_dict().items()}, str(tmp_path / "ti.safetensors"))
    assert vitkit.load(tmp_path / "ti.safetensors").config.num_heads == 3


def test_a_timm_file_with_a_class_token_and_fc_norm_is_refused_unless_told_its_pooling(tmp_path):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    ref = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=192, depth=1, num_heads=3, num_classes=4, global_pool="avg",
        class_token=True).eval()  # timm's avg pooling over the patches, with a class token: no vitkit equivalent
    f = tmp_path / "avg.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(f))
    with pytest.raises(ValueError, match="class token and an fc_norm.*global_pool='avg'"):
        vitkit.load(f)
    tok = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=192, depth=1, num_heads=3, num_classes=4, global_pool="token",
        fc_norm=True).eval()
    save_file({k: v.contiguous() for k, v in tok.state_dict().items()}, str(f))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(f, pool="cls")(x), tok(x), atol=1e-5, rtol=1e-5)


def test_a_file_without_a_position_table_needs_its_image_size(tmp_path):
    from safetensors.torch import save_file

    m = _model("sincos")
    f = tmp_path / "s.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(f))
    with pytest.raises(ValueError, match="no position table.*--img-size H W"):
        vitkit.load(f, num_heads=4)
    assert vitkit.load(f, num_heads=4, img_size=32, pos_embed="sincos2d").config.img_size == 32
