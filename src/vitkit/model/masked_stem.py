"""Masked pre-training of a hybrid (§3.1): the CNN stem must not see what is hidden.

A hybrid's tokens come from a CNN feature map, and a 3x3 convolution's receptive field crosses the token cells: a
visible token's features, computed on the whole image, hold its hidden neighbours' pixels, and MAE or MPP then
"reconstructs" what its encoder has already seen (the leak). The answers read for this:

- SimMIM (Xie et al. 2022) replaces the hidden patches by a [mask] token and runs the whole encoder: on a hybrid
  that means masking the *input* pixels, and the stem and transformer still pay for every token.
- ConvMAE (Gao et al. 2022) masks its convolutional stages' feature maps ("masked convolution": a convolution reads
  a hidden position as zero), and its transformer stage sees the visible tokens only, as MAE's.
- SparK (Tian et al. 2023) does the same for whole CNNs, and computes batch norm over the visible positions alone:
  the hidden zeros are not data, and statistics over 75% zeros are not the statistics of a whole image, which is
  what the fine-tuned stem (and a probe, with the running statistics) then reads.
- A stem applied to each patch alone is the third road; a 4x4-pixel cell padded on its own is not the input the
  stem sees when fine-tuning, where it spans the cells (nor are ConvMAE's zeros around a visible cell).

vitkit takes two of them, by objective:

- MAE's encoder reads the visible tokens alone, so its stem runs on **each visible cell alone**, cut out of the image
  and zero-padded (``PatchEmbed.visible_cells``; the third road): a quarter of the pixels at 75% masking. For a
  cell whose neighbours are all hidden this is exactly ConvMAE's and SparK's masked stem below (zeros around it, the
  same positions in batch norm: tests/test_ssl_hybrid.py); where two visible cells touch, theirs lets them see each
  other and this does not. The stem is most of the CIFAR-10 recipe's compute (~96 of ~153 MMAC an image), so the
  masked whole image made MAE's step only 1.09x the supervised one; each cell alone makes it 1.94x eager and 2.43x
  compiled (AMD EPYC with AVX512-BF16, batch 128, bf16: ``python benchmarks/pretrain_speed.py --model hybrid``), and
  12 minutes of pre-training buy 11 epochs where they bought 5 (results/self-supervision-hybrid.csv).
- MPP's encoder reads every token (the corrupted ones as [mask]), and 10% of the corrupted keep their pixels: it
  takes ConvMAE's and SparK's masked stem on the whole image, ``masked_features``: the hidden cells' pixels are set to
  zero (the dataset's mean colour, in the standardised space), every convolution reads hidden positions as zero and
  leaves zero there, batch norm takes its statistics (and updates its running ones) from the visible positions only.
  The hidden pixels reach nothing: the input is zero there before any layer runs; the masking after each layer keeps
  the visible features those of the visible pixels alone, as a fine-tuned stem computes them on a whole image up to
  the cell borders. Pooling is cell-aligned (2x2 max-pooling halves a cell of ``patch x stride`` pixels), so a
  pooled position is wholly visible or wholly hidden. Each conv-BN-ReLU is masked once, its batch norm one autograd
  Function on torch's fused kernels (``_MaskedBatchNorm``): MPP's step went from 0.77x the supervised one, masked
  with element-wise operations, to 0.94x (same EPYC, exact attention, batch 128; docs/results.md).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock


def check_maskable(spec: str | None) -> None:
    """Refuses the stems whose layers ``masked_features`` does not know (the ``conv:`` stems are the recipes')."""
    if spec and not spec.startswith("conv:"):
        raise ValueError(f"masked pre-training of a hybrid masks each layer of its CNN stem, and knows the conv: stems "
                         f"(3x3 conv-BN-ReLU, M, R<width> blocks), not {spec!r}: pre-train a plain ViT (--hybrid none) "
                         "or a conv: stem")


def cell_mask(visible: torch.Tensor, grid: tuple[int, int], cell: tuple[int, int]) -> torch.Tensor:
    """(B, N) bool visible tokens of a ``grid`` -> (B, 1, H, W) float, each token's ``cell`` (H, W) positions."""
    m = visible.reshape(-1, 1, *grid).float()
    return m.repeat_interleave(cell[0], 2).repeat_interleave(cell[1], 3)


def masked_batch_norm(bn: nn.BatchNorm2d, x: torch.Tensor, m: torch.Tensor, relu: bool = False,
                      shift: torch.Tensor | None = None) -> torch.Tensor:
    """``bn`` (then a ReLU, with ``relu``) over the visible positions ``m`` (B, 1, H, W) of ``x`` (SparK's sparse batch
    norm): in training the statistics, and the running ones' update, are the visible positions'; the output is zero at
    the hidden ones whatever ``x`` holds there (a convolution's output spills into them). ``x`` may be the input less
    ``shift`` (C,), fp32: ``_through`` has the convolution subtract the running mean (``_visible_moments`` says why)."""
    if not bn.training and bn.track_running_stats:  # (without running statistics, eval normalises as training)
        x = bn(x)
        return (F.relu(x) if relu else x) * m.to(x.dtype)
    ones = x.new_ones(x.shape[1], dtype=torch.float32)
    weight, bias = (bn.weight, bn.bias) if bn.affine else (ones, torch.zeros_like(ones))
    return _MaskedBatchNorm.apply(x, m, weight, bias, torch.zeros_like(ones) if shift is None else shift, bn, relu)


def _visible_moments(xm: torch.Tensor, n: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's mean and biased variance over the ``n`` visible positions of ``xm``, zero at the hidden ones,
    in fp32. torch's own batch norm computes them over every position in one pass (an fp32 ``weight`` makes them
    fp32); with the hidden positions zero its sums are the visible positions' sums, to be divided by ``n`` instead.
    The variance is then E[x^2] - mean^2, which loses digits as the mean outgrows the spread: in fp32 the recipe's
    stem's first gradients were 1% off fp64's. Hence the shift: the running mean taken off by the convolution before
    (its bias, no pass of its own), the mean left is near zero, and after a few dozen steps the gradients are 0.4% off,
    as torch's own BatchNorm2d's are on the unmasked stem (0.3%: its CPU kernel on channels-last maps)."""
    _, mean_all, invstd_all = torch.native_batch_norm(xm, weight, None, None, None, True, 0.0, eps)
    mean_all, invstd_all = mean_all.float(), invstd_all.float()  # (torch.compile's decomposition gives x's dtype)
    share = xm.numel() / xm.shape[1] / n  # every position over the visible ones
    mean = mean_all * share
    second = (invstd_all.pow(-2) - eps + mean_all.square()) * share  # E[x^2] over the visible positions
    return mean, (second - mean.square()).clamp_min(0)


class _MaskedBatchNorm(torch.autograd.Function):
    """Training's batch norm (and ReLU) with the visible positions' statistics, its gradients those of BatchNorm2d
    over the visible positions alone (tests/test_ssl_hybrid.py), by hand: the algebra autograd would do through the
    masking, in a few of torch's fused batch-norm kernels instead of ~20 elementwise operations over the whole feature
    map, which were a quarter of MPP's hybrid step (2-core AMD EPYC with AVX512-BF16; docs/results.md)."""

    @staticmethod
    def forward(ctx, x, m, weight, bias, shift, bn, relu):  # type: ignore[no-untyped-def]
        mx = m.to(x.dtype)
        xm = x * mx
        n = m.sum(dtype=torch.float32).clamp_min(2)
        rest, var = _visible_moments(xm, n, weight, bn.eps)  # rest: the mean less the shift
        if bn.track_running_stats:
            bn.num_batches_tracked.add_(1)
            # momentum None: BatchNorm2d's cumulative average
            rate = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.lerp_(shift + rest, rate)
            bn.running_var.lerp_(var * n / (n - 1), rate)  # unbiased, as BatchNorm2d's
        y = F.batch_norm(xm, rest, var, weight, bias, training=False, eps=bn.eps)  # normalised with these statistics
        if relu:
            y = y.relu_()
        y = y.mul_(mx)  # a convolution next reads the hidden positions as zero
        ctx.save_for_backward(xm, y, mx, n, weight, rest, torch.rsqrt(var + bn.eps))
        ctx.relu = relu
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        xm, y, mx, n, weight, mean, invstd = ctx.saved_tensors
        # the gradient at the output, zero at the hidden positions (where y is zero, and so is ReLU's gradient)
        g = torch.ops.aten.threshold_backward(grad, y, 0) if ctx.relu else grad * mx
        # d weight = sum g * x_hat, d bias = sum g: over every position, and g is zero at the hidden ones
        _, dw, db = torch.ops.aten.native_batch_norm_backward(g, xm, weight, None, None, mean, invstd, True, 0.0,
                                                              [False, True, True])
        # dx = w invstd (g - db/n - x_hat dw/n) at the visible positions, 0 at the hidden: with x_hat = (xm - mean)
        # invstd and xm zero at the hidden positions, that is a g + b xm + c m, each of a, b, c one per channel
        a = weight * invstd
        b = -a * invstd * dw / n
        c = -a * db / n - b * mean
        a, b, c = (v.to(g.dtype).view(1, -1, 1, 1) for v in (a, b, c))
        return g.mul_(a).addcmul_(xm, b).addcmul_(mx, c), None, dw, db, None, None, None  # in place: g is ours


def _masked(layer: nn.Module, x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One stem layer on a feature map that is zero at the hidden positions (``m`` 0), as its output is again:
    (output, its mask)."""
    if isinstance(layer, nn.MaxPool2d):
        return layer(x), F.max_pool2d(m, 2)  # cell-aligned: a pooled position is all visible or all hidden
    if isinstance(layer, nn.Conv2d):  # reads the hidden positions as the zeros they are; writes none there
        y = layer(x)
        return y * m.to(y.dtype), m
    if isinstance(layer, nn.BatchNorm2d):
        return masked_batch_norm(layer, x, m), m
    if isinstance(layer, nn.ReLU):
        return F.relu(x), m
    if isinstance(layer, BasicBlock):  # torchvision's: conv-BN-ReLU-conv-BN, the shortcut added, ReLU
        out = _through((layer.conv1, layer.bn1, layer.relu, layer.conv2, layer.bn2), x, m)[0]
        skip = x if layer.downsample is None else _through(layer.downsample, x, m)[0]
        return F.relu(out + skip), m  # (no pooling inside a block: the mask stays)
    if isinstance(layer, nn.Sequential):
        return _through(layer, x, m)
    raise TypeError(f"masked pre-training: no masked form of the stem's {type(layer).__name__}")


def _through(layers: Iterable[nn.Module], x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layers = list(layers)
    i = 0
    while i < len(layers):
        after = layers[i + 1:i + 3]
        if isinstance(layers[i], nn.Conv2d) and after and isinstance(after[0], nn.BatchNorm2d):
            # conv-BN(-ReLU), the stems' unit, masked once: the batch norm masks the convolution's output itself
            conv, bn = layers[i], after[0]
            relu = len(after) == 2 and isinstance(after[1], nn.ReLU)
            if bn.training and bn.track_running_stats and type(conv) is nn.Conv2d and conv.bias is None:
                # the stems' bias-free convolution takes the running mean off with a bias (the batch norm's shift)
                shift = bn.running_mean.clone()
                y = conv._conv_forward(x, conv.weight, -shift)
                x = masked_batch_norm(bn, y, m, relu=relu, shift=shift.to(y.dtype).float())  # as the conv took it
            else:
                x = masked_batch_norm(bn, conv(x), m, relu=relu)
            i += 3 if relu else 2
        else:
            x, m = _masked(layers[i], x, m)
            i += 1
    return x, m


def masked_features(stem: nn.Module, x: torch.Tensor, visible: torch.Tensor, grid: tuple[int, int],
                    cell: tuple[int, int]) -> torch.Tensor:
    """The stem's feature map of images ``x`` (B, C, H, W) of which only the ``visible`` (B, N) token cells of
    ``cell`` pixels are seen: hidden pixels zero, each layer masked (the module docstring)."""
    m = cell_mask(visible, grid, cell).to(x.dtype)
    if x.device.type == "cpu":  # oneDNN's convolutions run faster on channels-last activations (as PatchEmbed)
        x = x.contiguous(memory_format=torch.channels_last)
    return _masked(stem, x * m, m)[0]
