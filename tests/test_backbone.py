"""A ViT as a backbone (model/backbone.py), against timm's own implementation of the same API: forward_intermediates,
prune_intermediate_layers, features_only, set_input_size and dynamic_img_size; the sin-cos table against MAE's
formula; ONNX with a dynamic height and width against onnxruntime at three sizes; bad input in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitkit
from vitkit.model.backbone import resample_patch_embed, take_indices

timm = pytest.importorskip("timm")

# Every preset timm has too, at depth 2 (the layout of every token and norm is checked; the depth adds nothing).
PRESETS = [n for n in vitkit.list_models() if timm.list_models(n)]


def pair(name: str, **overrides):  # type: ignore[no-untyped-def]
    """The same weights in vitkit and timm (timm's resampling on every forward: dynamic_img_size=True)."""
    torch.manual_seed(0)
    ours = vitkit.create_model(name, depth=2, **overrides).eval()
    theirs = timm.create_model(name, depth=2, dynamic_img_size=True, num_classes=ours.config.num_classes,
                               **overrides).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def image_size(model) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    size = model.config.img_size
    return size if isinstance(size, tuple) else (size, size)


def test_every_preset_timm_has_is_checked() -> None:
    assert len(PRESETS) >= 30 and "vit_small_patch14_reg4_dinov2" in PRESETS and "vit_base_r50_s16_224" in PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_forward_intermediates_equals_timms(name: str) -> None:
    ours, theirs = pair(name)
    # A hybrid's ResNet runs its convolutions channels-last on a CPU (vitkit) and channels-first (timm): the same
    # sums in another order, 1e-4 apart after the stem's dozens of layers.
    tol = {"atol": 5e-4, "rtol": 1e-3} if ours.config.hybrid else {"atol": 2e-5, "rtol": 1e-4}
    x = torch.randn(2, 3, *image_size(ours))
    with torch.no_grad():
        for kwargs in ({"indices": None, "norm": True}, {"indices": [0, -1], "return_prefix_tokens": True},
                       {"indices": 1, "output_fmt": "NLC", "stop_early": True}):
            final, maps = ours.forward_intermediates(x, **kwargs)
            want_final, want_maps = theirs.forward_intermediates(x, **kwargs)
            torch.testing.assert_close(final, want_final, **tol)
            assert len(maps) == len(want_maps)
            for got, want in zip(maps, want_maps):
                got, want = (got, want) if isinstance(got, torch.Tensor) else (joined(got), joined(want))
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, **tol)


def joined(pair_: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A (map (B, D, h, w), prefix (B, n, D)) pair as one (B, n + h*w, D) tensor."""
    return torch.cat([pair_[1], pair_[0].flatten(2).mT], dim=1)


def test_feature_maps_are_the_patch_tokens_with_the_prefix_split_off() -> None:
    """DINOv2 with registers: 1 class + 4 register tokens, then a 16x16 grid at 224 px (patch 14)."""
    model, _ = pair("vit_small_patch14_reg4_dinov2", img_size=224)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        tokens = model.blocks[:2](model.embed(x))
        ((fmap, prefix),) = model.forward_intermediates(x, indices=[1], return_prefix_tokens=True,
                                                        intermediates_only=True)
    assert fmap.shape == (2, 384, 16, 16) and prefix.shape == (2, 5, 384)
    torch.testing.assert_close(prefix, tokens[:, :5])
    torch.testing.assert_close(fmap[:, :, 3, 7], tokens[:, 5 + 3 * 16 + 7])  # row 3, column 7 of the grid


def test_features_only_and_pruning_equal_timms() -> None:
    torch.manual_seed(0)
    ours = vitkit.create_model("vit_small_patch14_reg4_dinov2", img_size=224, depth=4, features_only=True,
                               out_indices=[1, 2])
    theirs = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=224, depth=4, features_only=True,
                               out_indices=[1, 2])
    theirs.model.load_state_dict(ours.model.state_dict())
    assert len(ours.model.blocks) == len(theirs.model.blocks) == 3  # pruned after block 2
    assert [i["num_chs"] for i in ours.feature_info] == theirs.feature_info.channels()
    assert [i["reduction"] for i in ours.feature_info] == theirs.feature_info.reduction()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        for got, want in zip(ours(x), theirs(x), strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    model = vitkit.create_model("vit_tiny_patch16_224", depth=6)
    assert model.prune_intermediate_layers([-2], prune_norm=True) == [4]
    assert len(model.blocks) == 5 and model.config.depth == 5 and model.config.num_classes == 0
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 192)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_small_patch14_reg4_dinov2", "deit3_small_patch16_224",
                                  "deit_small_distilled_patch16_224", "vit_medium_patch16_gap_256"])
@pytest.mark.parametrize("img_size,patch_size", [((256, 192), None), ((240, 240), 12), ((112, 224), None), (None, 8)])
def test_set_input_size_equals_timms(name: str, img_size, patch_size) -> None:  # type: ignore[no-untyped-def]
    ours, theirs = pair(name)
    new = img_size or image_size(ours)
    if any(s % (patch_size or ours.patch_embed.patch_size[0]) for s in new):
        with pytest.raises(ValueError, match="multiple of the patch size"):
            ours.set_input_size(img_size=img_size, patch_size=patch_size)
        return
    ours.set_input_size(img_size=img_size, patch_size=patch_size)
    theirs.set_input_size(img_size=img_size, patch_size=patch_size)
    torch.testing.assert_close(ours.patch_embed.proj.weight, theirs.patch_embed.proj.weight, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.pos_embed, theirs.pos_embed)
    x = torch.randn(1, 3, *new)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=2e-5, rtol=1e-4)
    assert image_size(ours) == tuple(new)


def test_a_non_square_input_equals_timms_dynamic_img_size() -> None:
    ours, theirs = pair("vit_base_patch16_224")
    x = torch.randn(1, 3, 160, 288)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=2e-5, rtol=1e-4)
        maps = ours.forward_intermediates(x, indices=1, intermediates_only=True)
    assert maps[0].shape == (1, 768, 10, 18)


def mae_sincos(grid: tuple[int, int], dim: int) -> np.ndarray:
    """The fixed 2-D table as MAE's ``get_2d_sincos_pos_embed`` writes it (facebookresearch/mae, util/pos_embed.py),
    in big_vision's order: x sin, x cos, y sin, y cos."""
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim // 4 - 1))
    y, x = np.meshgrid(np.arange(grid[0], dtype=np.float64), np.arange(grid[1], dtype=np.float64), indexing="ij")
    ox, oy = np.outer(x.reshape(-1), omega), np.outer(y.reshape(-1), omega)
    return np.concatenate([np.sin(ox), np.cos(ox), np.sin(oy), np.cos(oy)], axis=1)


def test_a_sincos_table_follows_the_input_size() -> None:
    model = vitkit.create_model("vit_tiny_patch16_224", pos_embed="sincos2d", depth=1).eval()
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        table = (model.embed(x)[:, 1:] - model.patch_embed(x))[0].numpy()  # the table used for a 6 x 10 grid
    np.testing.assert_allclose(table, mae_sincos((6, 10), 192), atol=1e-5)
    model.set_input_size(img_size=(96, 160))
    np.testing.assert_allclose(model.pos_embed[0, 1:].numpy(), mae_sincos((6, 10), 192), atol=1e-5)


def test_a_fixed_size_model_refuses_other_sizes_until_it_is_resized() -> None:
    model = vitkit.create_model("vit_tiny_patch16_224", depth=1, dynamic_img_size=False).eval()
    with pytest.raises(ValueError, match=r"takes \(224, 224\) images, got \(160, 288\).*set_input_size"):
        model(torch.randn(1, 3, 160, 288))
    model.set_input_size(img_size=(160, 288))
    assert model(torch.randn(1, 3, 160, 288)).shape == (1, 1000)
    assert model.pos_embed.shape == (1, 1 + 10 * 18, 192)


def test_resample_patch_embed_equals_timms() -> None:
    from timm.layers import resample_patch_embed as timms

    w = torch.randn(8, 3, 16, 16)
    for size in ((8, 8), (14, 14), (24, 24), (12, 20)):
        torch.testing.assert_close(resample_patch_embed(w, size), timms(w, list(size)), atol=1e-5, rtol=1e-4)


def test_bad_input_is_one_clear_line() -> None:
    model = vitkit.create_model("vit_tiny_patch16_224", depth=4)
    x = torch.randn(1, 3, 224, 224)
    for indices, message in ((5, r"the last n blocks, n from 1 to 4"), ([4], r"block index 4 is out of range: this "
                             r"model has 4 blocks"), ([-5], "out of range"), ([], "empty"), ("a", "an int")):
        with pytest.raises(ValueError, match=message):
            model.forward_intermediates(x, indices=indices)
    with pytest.raises(ValueError, match=r"not a multiple of the patch size \(16, 16\)"):
        model.forward_intermediates(torch.randn(1, 3, 224, 200))
    with pytest.raises(ValueError, match="empty batch"):
        model.forward_intermediates(torch.randn(0, 3, 224, 224))
    with pytest.raises(ValueError, match="output_fmt must be one of"):
        model.forward_intermediates(x, output_fmt="NHWC")
    with pytest.raises(ValueError, match="multiple of the patch size"):
        model.set_input_size(img_size=(230, 224))
    with pytest.raises(ValueError, match="expected an int or a pair"):
        model.set_input_size(img_size="224")
    assert model.patch_embed.grid_size == (14, 14)  # nothing changed
    hybrid = vitkit.create_model("vit_tiny_r_s16_p8_224", depth=1)
    with pytest.raises(ValueError, match="hybrid's patches"):
        hybrid.set_input_size(patch_size=4)
    assert take_indices(4, None) == ([0, 1, 2, 3], 3) and take_indices(4, [-1, 0]) == ([3, 0], 3)


def test_onnx_export_of_a_dynamic_model_runs_at_three_sizes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxruntime")
    from vitkit.serving.onnx import check_sizes, export_onnx, ort_session

    torch.manual_seed(0)
    model = vitkit.create_model("vit_tiny_patch16_224", depth=2, num_classes=10).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a zero head would make every logit 0
    assert export_onnx(model, tmp_path / "m.onnx") < 1e-4
    sizes = check_sizes(model)
    assert sizes == [(224, 224), (336, 224), (112, 336)]
    session = ort_session(tmp_path / "m.onnx")
    for size in sizes + [(64, 480)]:  # and one the export's own check did not use
        x = torch.randn(2, 3, *size)
        got = session.run(["logits"], {"pixel_values": x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4)
    fixed = vitkit.create_model("vit_tiny_patch16_224", depth=1, num_classes=10, dynamic_img_size=False).eval()
    export_onnx(fixed, tmp_path / "f.onnx")
    with pytest.raises(Exception, match="pixel_values|dimension|shape"):
        ort_session(tmp_path / "f.onnx").run(["logits"], {"pixel_values": np.zeros((1, 3, 112, 224), np.float32)})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_backbone_on_a_gpu_gives_the_cpus_maps() -> None:
    """forward_intermediates, set_input_size (a new patch size too: E resampled on the GPU) and a non-square input
    on CUDA, in fp32 and under bf16 autocast, against the same model on the CPU."""
    torch.manual_seed(0)
    cpu = vitkit.create_model("vit_small_patch14_reg4_dinov2", img_size=224, depth=4).eval()
    gpu = vitkit.create_model("vit_small_patch14_reg4_dinov2", img_size=224, depth=4).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    for model in (cpu, gpu):
        model.set_input_size(img_size=(192, 288), patch_size=16)
    x = torch.randn(2, 3, 192, 288)
    with torch.no_grad():
        want = cpu.forward_intermediates(x, indices=[1, 3], intermediates_only=True)
        got = gpu.forward_intermediates(x.cuda(), indices=[1, 3], intermediates_only=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = gpu.forward_intermediates(x.cuda(), indices=[1, 3], intermediates_only=True)
    for w, g, b in zip(want, got, low, strict=True):
        assert g.shape == w.shape == (2, 384, 12, 18)
        torch.testing.assert_close(g.cpu(), w, atol=1e-3, rtol=1e-3)
        assert (b.float().cpu() - w).abs().mean() < 0.05 * w.abs().mean()


def test_inspect_draws_intermediate_layers_at_any_size(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """inspect features / attention / explain on a non-square size (--input-size) and at a photo's own aspect ratio
    (--keep-aspect); a wrong layer or a missing image is one line (exit 2)."""
    from PIL import Image

    from vitkit.cli.main import main

    torch.manual_seed(0)
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, num_classes=2)
    model.save_pretrained(tmp_path / "m", class_names=["a", "b"], mean=[0.5] * 3, std=[0.5] * 3)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 100, 3), dtype=np.uint8)).save(tmp_path / "w.png")
    common = ["--checkpoint", str(tmp_path / "m"), "--image", str(tmp_path / "w.png")]
    (tmp_path / "cut.png").write_bytes((tmp_path / "w.png").read_bytes()[:200])  # a file cut short
    assert main(["inspect", "features", *common, "--keep-aspect", "--layer", "1",
                 "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "input size 16x32: 2x4 patches" in out and "block 1: a 2x4 map of 192-dim patch tokens" in out
    assert (tmp_path / "f.png").stat().st_size > 1000
    assert main(["inspect", "attention", *common, "--input-size", "24", "48", "--out", str(tmp_path / "a.png")]) == 0
    assert "input size 24x48: 3x6 patches" in capsys.readouterr().out
    assert main(["inspect", "explain", "--checkpoint", str(tmp_path / "m"), str(tmp_path / "w.png"), "--input-size",
                 "16", "40", "--method", "rollout,grad-rollout", "--no-faithfulness",
                 "--out", str(tmp_path / "e")]) == 0
    assert (tmp_path / "e" / "w.png").is_file()
    for argv, message in ((["features", *common, "--layer", "3"], "block index 3 is out of range"),
                          (["features", "--checkpoint", str(tmp_path / "m"), "--keep-aspect"], "--keep-aspect takes"),
                          (["features", *common, "--input-size", "20", "32"], "multiple of the patch size"),
                          (["features", "--checkpoint", str(tmp_path / "m"), "--image", str(tmp_path / "cut.png"),
                            "--keep-aspect"], "cannot decode image")):
        assert main(["inspect", *argv, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
