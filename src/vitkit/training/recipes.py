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


def flips_change_labels(data: DataSplits) -> bool:
    """Small grayscale images are often digits or characters, and a mirrored digit or letter is another symbol (or
    none): a horizontal flip would teach wrong labels, so the folder recipe leaves it off for them."""
    return data.in_chans == 1 and max(data.img_size) <= 48
