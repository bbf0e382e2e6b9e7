"""Choosing a shipped recipe for a folder of images from the data itself."""
from __future__ import annotations

from ..data.datasets import DataSplits


def choose_recipe(data: DataSplits) -> str:
    """Tiny images -> ``digits``; small grayscale -> ``fashion-mnist``; small colour -> ``cifar10``;
    anything larger -> ``folder-large`` (images resized to 64 px for a patch-8 model)."""
    h, w = data.img_size
    side = max(h, w)
    if side <= 16:
        return "digits"
    if side <= 48:
        return "fashion-mnist" if data.in_chans == 1 else "cifar10"
    return "folder-large"
