"""``save_pretrained`` / ``from_pretrained``: a folder with ``config.json`` and ``model.safetensors``.

``config.json`` holds the model config under ``"model"`` and the preprocessing (mean, std, image size,
class names) under ``"preprocessing"`` so a folder is enough to predict on a raw image.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import ViTConfig
from .posembed import resample_pos_embed
from .vit import VisionTransformer

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
DEFAULT_PREPROCESSING = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "class_names": None}


def atomic_write(path: Path, write: Any) -> None:
    """Write via ``write(tmp_path)``, fsync, then rename: a crash never leaves a half-written ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fit_channels(pre: dict[str, Any], chans: int) -> dict[str, Any]:
    """``pre`` with mean/std of length ``chans`` (the defaults, and weights imported from elsewhere, are 3-channel)."""
    if len(pre["mean"]) != chans:
        pre = {**pre, "mean": pre["mean"][:1] * chans, "std": pre["std"][:1] * chans}
    return pre


def save_pretrained(model: VisionTransformer, directory: str | os.PathLike, **preprocessing: Any) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pre = {**DEFAULT_PREPROCESSING, **getattr(model, "preprocessing", {}), **preprocessing}
    pre["img_size"] = model.config.to_dict()["img_size"]
    pre = fit_channels(pre, model.config.in_chans)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(d / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    meta = {"model": model.config.to_dict(), "preprocessing": pre, "library": "vitkit"}
    atomic_write(d / CONFIG_NAME, lambda p: p.write_text(json.dumps(meta, indent=2)))


def read_config(directory: str | os.PathLike) -> tuple[ViTConfig, dict[str, Any]]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a folder written by save_pretrained "
                                f"({CONFIG_NAME} + {WEIGHTS_NAME})")
    meta = json.loads(path.read_text())
    if "model" not in meta:
        raise ValueError(f"{path} has no 'model' section; is it a vitkit folder? (keys: {sorted(meta)})")
    return ViTConfig.from_dict(meta["model"]), meta.get("preprocessing", dict(DEFAULT_PREPROCESSING))


def load_state_dict_into(model: VisionTransformer, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` strictly, naming missing/unexpected keys and mismatched shapes (expected vs found)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source}: keys do not match the model; missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}")
    model.load_state_dict(state)


def adapt_state_dict(state: dict[str, torch.Tensor], src: ViTConfig, dst: ViTConfig) -> dict[str, torch.Tensor]:
    """Carry weights from ``src``'s shapes to ``dst``'s: resample position embeddings to the new grid (§3.2)
    and, when the class count changes, start a new zero-initialised head (as the paper fine-tunes)."""
    state = dict(state)
    if "pos_embed" in state and src.img_size != dst.img_size:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], dst.grid_size, src.num_prefix_tokens,
                                                src.grid_size)
    if src.num_classes != dst.num_classes:
        state.pop("head.weight", None), state.pop("head.bias", None)
        if dst.num_classes > 0:
            state["head.weight"] = torch.zeros(dst.num_classes, dst.embed_dim)
            state["head.bias"] = torch.zeros(dst.num_classes)
    return state


# Keys that may change on fine-tuning or inference without changing what the weights mean.
ADAPTABLE = {"img_size", "num_classes", "drop_rate", "pos_drop_rate", "attn_drop_rate", "proj_drop_rate",
             "drop_path_rate"}


def build_adapted(src: ViTConfig, state: dict[str, torch.Tensor], source: str,
                  **overrides: Any) -> VisionTransformer:
    """A model of ``src`` changed by ``overrides`` holding ``state`` (written for ``src``): the image size and class
    count may change (resampled position embeddings, new zero head); other keys must stay as the weights say."""
    dst = src.replace(**overrides)
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
    model = build_adapted(src, load_file(str(wpath)), str(wpath), **overrides)
    if model.config.num_classes != src.num_classes:
        pre = {**pre, "class_names": None}
    model.preprocessing = {**pre, "img_size": model.config.to_dict()["img_size"]}
    return model
