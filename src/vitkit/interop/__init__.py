"""Weights in and out: timm, Hugging Face and the official JAX checkpoints."""
from __future__ import annotations

from typing import Any

from ..model.hub import from_pretrained
from ..model.vit import VisionTransformer


def load_pretrained(src: str, **overrides: Any) -> VisionTransformer:
    """A vitkit folder (other formats come through ``vitkit.interop.load_any``)."""
    return from_pretrained(src, **overrides)
