"""The ResNet of the paper's hybrids (§3.1, R50+ViT-B/16 and kin), as the official vision_transformer code builds it
(``models_resnet.py``): group norm instead of batch norm and weight-standardised convolutions (as in BiT), a
post-activation bottleneck with the stride on its 3x3 convolution, and TensorFlow's 'SAME' padding.

Parameter names follow timm's ``ResNetV2`` (``stem.conv``, ``stages.0.blocks.0.conv1``, ...), so the hybrids'
state dicts move between timm and vitkit unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 64  # channels of the root; stage i has 64 * 2**i bottleneck channels and 4x that out (width factor 1)


def pad_same(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], value: float = 0.0) -> torch.Tensor:
    """TensorFlow's 'SAME' padding: output size ceil(in / stride), the odd pixel of padding at the bottom/right
    (PyTorch's symmetric ``padding=`` puts it on both sides, which shifts every feature of a strided layer)."""
    pads = []
    for size, k, s in zip(reversed(x.shape[-2:]), reversed(kernel), reversed(stride)):  # W first, as F.pad wants
        total = max((math.ceil(size / s) - 1) * s + k - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value)


class StdConv2d(nn.Conv2d):
    """A bias-free convolution whose filters are standardised before use: w <- (w - mean(w)) / (std(w) + 1e-5) over
    each output filter (the official ``weight_standardize``), with 'SAME' padding."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1) -> None:
        super().__init__(cin, cout, kernel, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True, unbiased=False) + 1e-5)
        return F.conv2d(pad_same(x, self.kernel_size, self.stride), w, None, self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)  # Flax's GroupNorm defaults


class ConvNorm(nn.Module):
    """A standardised convolution and its group norm (the projection shortcut, and the root)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = StdConv2d(cin, cout, kernel, stride)
        self.norm = group_norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """relu(shortcut(x) + GN(conv1x1(relu(GN(conv3x3/s(relu(GN(conv1x1(x)))))))): the official ``ResidualUnit``."""

    def __init__(self, cin: int, features: int, stride: int) -> None:
        super().__init__()
        cout = features * 4
        self.downsample = ConvNorm(cin, cout, 1, stride) if cin != cout or stride != 1 else None
        self.conv1, self.norm1 = StdConv2d(cin, features, 1), group_norm(features)
        self.conv2, self.norm2 = StdConv2d(features, features, 3, stride), group_norm(features)
        self.conv3, self.norm3 = StdConv2d(features, cout, 1), group_norm(cout)
        nn.init.zeros_(self.norm3.weight)  # each block starts as the identity on its shortcut (official init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(shortcut + self.norm3(self.conv3(y)))


class Stage(nn.Module):
    def __init__(self, cin: int, features: int, blocks: int, stride: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Bottleneck(cin if j == 0 else features * 4, features, stride if j == 0 else 1)
                                      for j in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Root(ConvNorm):
    """The root: a 7x7/2 standardised convolution, group norm, ReLU and a 3x3/2 max-pool (stride 4 in all)."""

    def __init__(self, in_chans: int) -> None:
        super().__init__(in_chans, WIDTH, 7, 2)
        self.out_channels = WIDTH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(super().forward(x))
        return F.max_pool2d(pad_same(x, (3, 3), (2, 2), value=float("-inf")), 3, 2)


def resnetv2(layers: tuple[int, ...], in_chans: int) -> nn.Module:
    """The root alone (R+ViT-Ti/16; timm names it ``conv``/``norm`` then) or the root and the stages."""
    return ResNetV2(layers, in_chans) if layers else Root(in_chans)


class ResNetV2(nn.Module):
    """The root and ``layers[i]`` bottlenecks per stage; the first stage keeps the resolution, each later one
    halves it."""

    def __init__(self, layers: tuple[int, ...], in_chans: int) -> None:
        super().__init__()
        self.stem = Root(in_chans)
        stages, cin = [], WIDTH
        for i, blocks in enumerate(layers):
            stages.append(Stage(cin, WIDTH * 2 ** i, blocks, 1 if i == 0 else 2))
            cin = WIDTH * 2 ** i * 4
        self.stages = nn.Sequential(*stages)
        self.out_channels = cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))
