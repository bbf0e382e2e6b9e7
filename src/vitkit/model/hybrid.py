"""The paper's hybrid input (§3.1): the patches come from a CNN feature map instead of raw pixels."""
from __future__ import annotations

import torch.nn as nn
import torchvision
from torchvision.models.resnet import BasicBlock

from .config import conv_channels, hybrid_stages, hybrid_stride, resnetv2_layers
from .resnetv2 import resnetv2


def cnn_stem(spec: str, in_chans: int) -> tuple[nn.Module, int, int]:
    """The CNN of a hybrid spec: (layers, output channels, stride)."""
    if spec.partition(":")[0] == "resnetv2":
        net = resnetv2(resnetv2_layers(spec), in_chans)
        return net, net.out_channels, hybrid_stride(spec)
    return conv_stem(spec, in_chans) if spec.startswith("conv:") else resnet_stages(spec, in_chans)


def conv_stem(spec: str, in_chans: int) -> tuple[nn.Sequential, int, int]:
    """``"conv:32,64"`` -> 3x3 conv-BN-ReLU layers of 32 and 64 channels at stride 1 (full resolution);
    an ``M`` in the list is a 2x2 max-pooling (``"conv:64,M,128,M"``: a quarter of the resolution), an ``R<width>``
    a residual BasicBlock of torchvision's ResNet (``"conv:64,R64,M,R128,M,R256"``: a small CIFAR ResNet; with
    ``depth=0`` and ``pool="gap"`` it is the whole model, the CNN baseline the paper compares with)."""
    layers: list[nn.Module] = []
    for width in conv_channels(spec):
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        elif isinstance(width, str):  # "R128"
            out = int(width[1:])
            down = None if out == in_chans else nn.Sequential(nn.Conv2d(in_chans, out, 1, bias=False),
                                                              nn.BatchNorm2d(out))
            layers.append(BasicBlock(in_chans, out, downsample=down))
            in_chans = out
        else:
            layers += [nn.Conv2d(in_chans, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.ReLU(inplace=True)]
            in_chans = width
    return nn.Sequential(*layers), in_chans, hybrid_stride(spec)


def resnet_stages(spec: str, in_chans: int) -> tuple[nn.Sequential, int, int]:
    """``"resnet50:3"`` -> (stem + first 3 stages of a torchvision ResNet-50, output channels, stride)."""
    stages, name = hybrid_stages(spec), spec.partition(":")[0]
    if not hasattr(torchvision.models, name):
        raise ValueError(f"hybrid {spec!r}: torchvision has no model {name!r}")
    net = getattr(torchvision.models, name)(weights=None)
    if in_chans != 3:
        net.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
    layers = [net.conv1, net.bn1, net.relu, net.maxpool] + [getattr(net, f"layer{i}") for i in range(1, stages + 1)]
    channels = [m for m in layers[-1].modules() if isinstance(m, nn.Conv2d)][-1].out_channels
    return nn.Sequential(*layers), channels, hybrid_stride(spec)
