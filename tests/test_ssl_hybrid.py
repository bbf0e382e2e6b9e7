"""Masked pre-training of the recipes' hybrids (issue 66, item 1): MAE runs the CNN stem on each visible cell alone
and MPP on the whole image masked at every layer, so nothing of a hidden patch's pixels reaches the encoder, and
the masked stem's batch norm (its backward written by hand) is torch's own over the visible positions. References:
torch's BatchNorm2d and its autograd on the visible positions gathered alone, the stem's unmasked forward on an
all-visible mask, and the leak a plain stem has (shown, so the no-leak checks can fail)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitkit.cli.main import main
from vitkit.model import ViTConfig, VisionTransformer
from vitkit.model.masked_stem import cell_mask, masked_batch_norm, masked_features
from vitkit.model.ssl import MaskedAutoencoder, MaskedPatchPrediction, patchify, unpatchify

from helpers import write_digits_folder

CIFAR_STEM = "conv:64,64,M,128,128,M"  # configs/cifar10.yaml's


def _hybrid(stem: str = CIFAR_STEM, img: int = 32, patch: int = 1) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(ViTConfig(img_size=img, patch_size=patch, embed_dim=32, depth=1, num_heads=2,
                                       hybrid=stem, num_classes=0))


def _other_hidden_pixels(x: torch.Tensor, hidden: torch.Tensor, cell: tuple[int, int], grid) -> torch.Tensor:
    """``x`` with every hidden cell's pixels replaced by noise."""
    pix = patchify(x, cell)
    return unpatchify(torch.where(hidden[..., None], torch.randn_like(pix) * 3, pix), cell, grid, x.shape[1])


@pytest.mark.parametrize("stem,patch", [(CIFAR_STEM, 1), ("conv:8,R16,M", 2), ("conv:8,8", 4)])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_no_pixel_of_a_hidden_patch_reaches_the_mae_of_a_hybrid(stem, patch, mode):
    mae = MaskedAutoencoder(_hybrid(stem, 16, patch)).train(mode == "train")
    x = torch.randn(4, 3, 16, 16)
    noise = mae.noise(x, torch.Generator().manual_seed(1))
    out = mae(x, noise=noise)
    pe = mae.encoder.patch_embed
    other = _other_hidden_pixels(x, out.mask, pe.cell, pe.grid_size)
    assert not torch.equal(other, x)
    again = mae(other, noise=noise)
    assert torch.equal(again.pred, out.pred) and torch.equal(again.loss.isnan(), out.loss.isnan())
    # the test can fail: the stem unmasked shows each visible token its hidden neighbours
    visible = ~out.mask[0]
    plain = pe(x)[0, visible] - pe(other)[0, visible]
    assert plain.abs().max() > 1e-3


def test_no_pixel_of_a_corrupted_patch_reaches_mpp_of_a_hybrid():
    mpp = MaskedPatchPrediction(_hybrid()).train()
    raw = torch.rand(4, 3, 32, 32)
    noise = mpp.noise(raw, torch.Generator().manual_seed(2))
    before = copy.deepcopy(mpp.state_dict())  # a training step moves the running statistics the stem reads
    out = mpp(raw, raw, noise=noise)
    _, to_mask, to_other = mpp.choose(noise)
    pe = mpp.encoder.patch_embed
    other = _other_hidden_pixels(raw, to_mask | to_other, pe.cell, pe.grid_size)
    # the targets are the raw pixels: the same ones, so that only what the encoder reads changes
    mpp.load_state_dict(before)
    again = mpp(other, raw, noise=noise)
    assert torch.equal(again.pred, out.pred)
    assert out.pred.shape[:2] == (4, 64)  # a token per 4x4-pixel cell of the 8x8 map


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_batch_norm_is_torchs_over_the_visible_positions_alone(relu, dtype):
    """Output, running statistics and the gradients of input, weight and bias (the backward is written by hand)
    against torch's BatchNorm2d (and ReLU) on the visible positions gathered alone; the input holds values at the
    hidden positions (a convolution's spill), which must reach nothing. bf16 as autocast gives it: input bf16,
    parameters fp32."""
    torch.manual_seed(0)
    bn, ref = nn.BatchNorm2d(5), nn.BatchNorm2d(5)
    with torch.no_grad():
        for b in (bn, ref):
            b.weight.copy_(torch.linspace(0.5, 2, 5))
            b.bias.copy_(torch.linspace(-1, 1, 5))
    visible = torch.rand(3, 16) < 0.4
    m = cell_mask(visible, (4, 4), (2, 2))  # (3, 1, 8, 8)
    x = (torch.randn(3, 5, 8, 8) * 2 + 1).to(dtype).requires_grad_()
    y = masked_batch_norm(bn, x, m, relu=relu)
    seen = x.detach().float().permute(1, 0, 2, 3)[:, m[:, 0].bool()].T.requires_grad_()  # (K, 5): the visible alone
    want = ref(seen[:, :, None, None])[:, :, 0, 0]  # torch's batch norm over them: an independent reference
    want = F.relu(want) if relu else want
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    assert y.dtype == dtype
    assert torch.allclose(y.float().permute(1, 0, 2, 3)[:, m[:, 0].bool()].T, want, **tol)
    assert torch.equal(y * (1 - m), torch.zeros_like(y))  # the hidden positions stay empty
    # the statistics are fp32 whatever the input (the reference reads the same bf16 values)
    assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, ref.running_var, atol=1e-6)
    assert bn.num_batches_tracked.item() == 1
    grad = torch.randn(want.shape)
    want.backward(grad)
    full = torch.zeros(5, 3, 8, 8)
    full[:, m[:, 0].bool()] = grad.T
    y.backward(full.permute(1, 0, 2, 3).to(dtype))
    assert torch.equal(x.grad * (1 - m), torch.zeros_like(x.grad))  # nothing flows to the hidden positions
    assert torch.allclose(x.grad.float().permute(1, 0, 2, 3)[:, m[:, 0].bool()].T, seen.grad, **tol)
    assert torch.allclose(bn.weight.grad, ref.weight.grad, **tol)
    assert torch.allclose(bn.bias.grad, ref.bias.grad, **tol)


def test_masked_batch_norm_without_running_statistics_normalises_as_torchs_in_both_modes():
    bn = nn.BatchNorm2d(4, track_running_stats=False)
    m = cell_mask(torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) < 0.5, (4, 4), (2, 2))
    x = torch.randn(2, 4, 8, 8)
    seen = x.permute(1, 0, 2, 3)[:, m[:, 0].bool()].T[:, :, None, None]
    for mode in (True, False):
        y = masked_batch_norm(bn.train(mode), x * m, m, relu=True)
        want = F.relu(nn.BatchNorm2d(4, track_running_stats=False).train(mode)(seen))[:, :, 0, 0]
        assert torch.allclose(y.permute(1, 0, 2, 3)[:, m[:, 0].bool()].T, want, atol=1e-5), mode


def test_all_visible_the_masked_stem_is_the_stem():
    enc = _hybrid("conv:8,R16,M,R16,M", 16, 1).train()
    stem = enc.patch_embed.backbone
    x = torch.randn(4, 3, 16, 16)
    everything = torch.ones(4, 16, dtype=torch.bool)
    masked = masked_features(stem, x, everything, (4, 4), enc.patch_embed.cell)
    assert torch.allclose(masked, stem(x), atol=1e-5)


@pytest.mark.parametrize("stem,patch", [(CIFAR_STEM, 1), ("conv:8,R16,M", 2)])
def test_mae_runs_each_visible_cell_through_the_stem_alone_as_the_masked_stem_sees_a_cell_with_hidden_neighbours(
        stem, patch):
    """MAE's encoder input (``visible_cells``, a quarter of the pixels) against the whole image through the stem
    masked at every layer: where every neighbour of a visible cell is hidden the two are one computation (zeros
    around the cell), in eval mode (running batch-norm statistics) and in training (statistics over the visible
    positions, which are the same positions); where two visible cells touch, the masked stem lets them see each
    other and the cells do not (so the test can fail)."""
    enc = _hybrid(stem, 32, patch)
    pe = enc.patch_embed
    gh, gw = pe.grid_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    isolated = ((rows % 2 == 0) & (cols % 2 == 0)).flatten()  # no two of them side by side or corner to corner
    x = torch.randn(3, 3, 32, 32)
    keep = isolated.nonzero()[:, 0].expand(3, -1)  # (B, K)
    for mode in (False, True):
        enc.train(mode)
        whole = pe.masked(x, isolated.expand(3, -1), (gh, gw))[:, isolated]
        assert torch.allclose(pe.visible_cells(x, keep, (gh, gw)), whole, atol=1e-4), mode
    enc.eval()
    touching = keep.clone()
    touching[:, 1] = 1  # cell 1 touches cell 0
    both = torch.zeros(3, gh * gw, dtype=torch.bool).scatter_(1, touching, True)
    whole = pe.masked(x, both, (gh, gw))
    cells = pe.visible_cells(x, touching, (gh, gw))
    assert (cells[:, 0] - whole[:, 0]).abs().max() > 1e-3


def test_stems_without_a_masked_form_are_refused_by_name():
    enc = VisionTransformer(ViTConfig(img_size=32, patch_size=1, embed_dim=32, depth=1, num_heads=2,
                                      hybrid="resnet18:1", num_classes=0))
    with pytest.raises(ValueError, match="resnet18:1.*--hybrid none"):
        MaskedAutoencoder(enc)


def test_pretrain_keeps_the_recipes_hybrid_and_train_init_fine_tunes_it(tmp_path, capsys):
    """32x32 RGB images choose configs/cifar10.yaml: its hybrid is pre-trained as it is and fine-tuned as it is."""
    import vitkit

    data = write_digits_folder(tmp_path / "d", per_class=12, size=32, mode="RGB")
    out = tmp_path / "pre"
    assert main(["pretrain", "--method", "mae", "--dataset", "folder", "--data-dir", str(data), "--epochs", "1",
                 "--depth", "1", "--output", str(out), "--cache-dir", str(tmp_path / "c")]) == 0
    said = capsys.readouterr().out
    assert f"its CNN stem {CIFAR_STEM} run on each visible cell alone" in said
    enc = vitkit.load(str(out / "best"))
    assert enc.config.hybrid == CIFAR_STEM and enc.config.patch_size == 1 and enc.patch_embed.num_patches == 64
    assert json.loads((out / "best" / "ssl.json").read_text())["method"] == "mae"
    assert main(["train", "--dataset", "folder", "--data-dir", str(data), "--init", str(out / "best"), "--epochs",
                 "1", "--batch-size", "32", "--output", str(tmp_path / "ft"), "--cache-dir", str(tmp_path / "c")]) == 0
    said = capsys.readouterr().out
    assert "a self-supervised encoder, fine-tuned as MAE's are" in said and "final: val_top1=" in said
    tuned = vitkit.load(str(tmp_path / "ft" / "best"))
    assert tuned.config.hybrid == CIFAR_STEM
