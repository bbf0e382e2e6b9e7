"""Writing a model folder: ``config.json`` (the config under ``"model"``, the preprocessing under
``"preprocessing"``: mean, std, image size, class names) and ``model.safetensors``, each written atomically.

Reading one back into a model is ``hub.from_pretrained``; this module does not need the model class, so the model
can offer ``save_pretrained`` as a method.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors.torch import save_file

from .config import ViTConfig

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


def save_pretrained(model: nn.Module, directory: str | os.PathLike, **preprocessing: Any) -> None:
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
