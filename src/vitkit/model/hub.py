"""``from_pretrained``: a ``save_pretrained`` folder back into a model, adapted to a new image size or class count
(§3.2: resampled position embeddings, a new zero head); ``build_adapted`` does the same for weights from elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .config import ViTConfig
from .posembed import resample_pos_embed
from .serialization import (CONFIG_NAME, DEFAULT_PREPROCESSING, WEIGHTS_NAME, atomic_write, fit_channels,
                            read_config, read_safetensors, safetensors_shapes, save_pretrained)
from .vit import HEADS, VisionTransformer

__all__ = ["ADAPTABLE", "CONFIG_NAME", "DEFAULT_PREPROCESSING", "WEIGHTS_NAME", "adapt_state_dict", "atomic_write",
           "build_adapted", "fit_channels", "from_pretrained", "load_state_dict_into", "read_config",
           "save_pretrained"]


def check_shapes(own: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str) -> None:
    """The same keys with the same shapes, or an error naming missing/unexpected keys or the first mismatch."""
    missing, unexpected = sorted(set(own) - set(found)), sorted(set(found) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source}: keys do not match the model; missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, shape in found.items():
        if tuple(own[k]) != tuple(shape):
            raise ValueError(f"{source}: {k} has shape {tuple(shape)}, the model expects {tuple(own[k])}")


def expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """The state dict's shapes for ``config``, from a model built on the meta device (no memory for weights)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in VisionTransformer(config).state_dict().items()}


def load_state_dict_into(model: VisionTransformer, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` strictly, naming missing/unexpected keys and mismatched shapes (expected vs found)."""
    check_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()},
                 {k: tuple(v.shape) for k, v in state.items()}, source)
    model.load_state_dict(state)


def adapt_state_dict(state: dict[str, torch.Tensor], src: ViTConfig, dst: ViTConfig) -> dict[str, torch.Tensor]:
    """Carry weights from ``src``'s shapes to ``dst``'s: resample position embeddings to the new grid (§3.2)
    and, when the class count changes, start a new zero-initialised head (as the paper fine-tunes)."""
    state = dict(state)
    if "pos_embed" in state and src.img_size != dst.img_size:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], dst.grid_size, src.pos_prefix_tokens,
                                                src.grid_size)
    if src.representation_size and not dst.representation_size:
        state = {k: v for k, v in state.items() if not k.startswith("pre_logits.")}
    if src.num_classes != dst.num_classes or src.head_width != dst.head_width:
        for head in HEADS[:1 + dst.dist_token]:  # DeiT's distillation head starts anew beside the class head
            state.pop(f"{head}.weight", None), state.pop(f"{head}.bias", None)
            if dst.num_classes > 0:
                state[f"{head}.weight"] = torch.zeros(dst.num_classes, dst.head_width)
                state[f"{head}.bias"] = torch.zeros(dst.num_classes)
    return state


# Keys that may change on fine-tuning or inference without changing what the weights mean.
ADAPTABLE = {"img_size", "num_classes", "drop_rate", "pos_drop_rate", "attn_drop_rate", "proj_drop_rate",
             "drop_path_rate", "dynamic_img_size"}


def build_adapted(src: ViTConfig, state: dict[str, torch.Tensor], source: str,
                  **overrides: Any) -> VisionTransformer:
    """A model of ``src`` changed by ``overrides`` holding ``state`` (written for ``src``): the image size and class
    count may change (resampled position embeddings, new zero head); other keys must stay as the weights say."""
    dst = src.replace(**overrides)
    if dst.num_classes != src.num_classes and src.representation_size:
        # §3.1: fine-tuning removes the pre-training head, hidden layer and all, for one zero-initialised D x K layer
        dst = dst.replace(representation_size=None)
    for k in overrides:
        if k not in ADAPTABLE and getattr(src, k) != getattr(dst, k):
            raise ValueError(f"{source}: {k}={getattr(src, k)!r} in the weights cannot become {getattr(dst, k)!r}; "
                             f"only {sorted(ADAPTABLE)} can change when loading")
    model = VisionTransformer(dst)
    load_state_dict_into(model, adapt_state_dict(state, src, dst), source)
    return model


def from_pretrained(directory: str | os.PathLike, **overrides: Any) -> VisionTransformer:
    """Load a ``save_pretrained`` folder. ``img_size`` resamples the position embeddings (§3.2); a new
    ``num_classes`` starts a zero head. Other architecture overrides must match the stored config."""
    d = Path(directory)
    src, pre = read_config(d)
    wpath = d / WEIGHTS_NAME
    if not wpath.is_file():
        raise FileNotFoundError(f"{wpath} not found")
    # the config is checked against the weights' shapes (read from the file's header) before anything is allocated
    check_shapes(expected_shapes(src), safetensors_shapes(wpath), f"{wpath} (with {d / CONFIG_NAME})")
    model = build_adapted(src, read_safetensors(wpath), str(wpath), **overrides)
    if model.config.num_classes != src.num_classes:
        pre = {**pre, "class_names": None}
    model.preprocessing = {**pre, "img_size": model.config.to_dict()["img_size"]}
    return model
