"""Writing a model folder: ``config.json`` (the config under ``"model"``, the preprocessing under
``"preprocessing"``: mean, std, image size, class names) and ``model.safetensors``, each written atomically.

Reading one back into a model is ``hub.from_pretrained``; this module does not need the model class, so the model
can offer ``save_pretrained`` as a method.
"""
from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

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
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file (a writer may create its temporary file 0600)
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


def torch_load_safely(path: str | os.PathLike) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain values; nothing is unpickled that could run code),
    its failures turned into one ValueError naming the file: a refused pickle says what it tried to load and never
    suggests ``weights_only=False``; a truncated or foreign file says so."""
    p = Path(path)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                    "it holds objects other than tensors and plain values")
        raise ValueError(f"{p}: refused to load: unpickling it could run code ({what}). vitkit reads only tensors "
                         "and plain values; re-save the weights as safetensors or a plain state dict") from None
    except Exception as e:  # noqa: BLE001 - zip/format/EOF errors come in many types
        reason = str(e).split(". ")[0] if str(e) else type(e).__name__
        raise ValueError(f"{p}: not a readable torch checkpoint (truncated or not one: {reason})") from None


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors file's header, without reading the tensors."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or damaged: {e})") from None


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or an error naming it (a truncated file is not a traceback)."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or damaged: {e})") from None


def check_preprocessing(pre: Any, config: ViTConfig, source: str) -> dict[str, Any]:
    """``pre`` if it can normalise this model's input: mean and std lists of finite numbers (std > 0) of length 1,
    3 or the channel count, and as many class names as classes; else an error naming the key."""
    if not isinstance(pre, dict):
        raise ValueError(f"{source}: 'preprocessing' must be a mapping, got {type(pre).__name__}")
    for key in ("mean", "std"):
        v = pre.get(key, DEFAULT_PREPROCESSING[key])
        ok = isinstance(v, list) and len(v) in {1, 3, config.in_chans} and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
        if not ok or (key == "std" and min(v) <= 0):
            counts = " or ".join(str(n) for n in sorted({1, 3, config.in_chans}))
            raise ValueError(f"{source}: preprocessing {key} must be a list of {counts} finite numbers"
                             f"{' above 0' if key == 'std' else ''}, got {v!r}")
    crop = pre.get("crop_pct", 1.0)
    if isinstance(crop, bool) or not isinstance(crop, (int, float)) or not 0 < crop <= 1:
        raise ValueError(f"{source}: preprocessing crop_pct must be a number in (0, 1] (the share of the resized "
                         f"image the centre crop keeps), got {crop!r}")
    tokens = pre.get("naflex_max_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"{source}: preprocessing naflex_max_tokens must be a whole number of patches (1 or more), "
                         f"got {tokens!r}")
    names = pre.get("class_names")
    if names is not None and (not isinstance(names, list) or len(names) != config.num_classes
                              or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{source}: preprocessing class_names must be {config.num_classes} names (one per class), "
                         f"got {len(names) if isinstance(names, list) else type(names).__name__}")
    return pre


def read_config(directory: str | os.PathLike) -> tuple[ViTConfig, dict[str, Any]]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a folder written by save_pretrained "
                                f"({CONFIG_NAME} + {WEIGHTS_NAME})")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise ValueError(f"{path} has no 'model' section; is it a vitkit folder?")
    try:
        config = ViTConfig.from_dict(meta["model"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    pre = check_preprocessing(meta.get("preprocessing", dict(DEFAULT_PREPROCESSING)), config, str(path))
    return config, pre
