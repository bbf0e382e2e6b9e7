"""Presets by timm-style name, with overrides."""
from __future__ import annotations

import difflib
from typing import Any

from .config import PRESETS, ViTConfig
from .vit import VisionTransformer


def list_models(pattern: str = "") -> list[str]:
    """Preset names (containing ``pattern``)."""
    return sorted(n for n in PRESETS if pattern in n)


def get_config(name: str, **overrides: Any) -> ViTConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        raise ValueError(f"unknown model {name!r}" + (f"; did you mean {close}?" if close else "")
                         + " (vitkit.list_models() lists them)")
    return PRESETS[name].replace(**overrides)


def create_model(name: str, **overrides: Any) -> VisionTransformer:
    """A preset by name, e.g. ``create_model("vit_base_patch16_224", num_classes=10, img_size=32)``."""
    return VisionTransformer(get_config(name, **overrides))
