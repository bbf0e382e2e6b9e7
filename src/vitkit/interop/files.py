"""Reading weights files: safetensors, or torch pickles loaded with ``weights_only=True`` (never executes code)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from safetensors import safe_open

from ..model.config import ViTConfig
from ..model.fields import check_keys
from ..model.serialization import CONFIG_NAME, read_safetensors, torch_load_safely


IMAGE_MAGIC = ((b"\xff\xd8\xff", "JPEG"), (b"\x89PNG", "PNG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
               (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def load_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from safetensors, or from a torch pickle read with ``weights_only=True`` (never executes code)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found")
    with open(p, "rb") as f:
        head = f.read(12)
    kind = next((k for magic, k in IMAGE_MAGIC if head.startswith(magic)), None)
    if kind or head[8:12] == b"WEBP":
        raise ValueError(f"{p}: a {kind or 'WebP'} image, not a weights file; weights are .safetensors, .pth/.pt/.bin, "
                         ".npz or a folder")
    if p.suffix == ".safetensors":
        return read_safetensors(p)
    obj = torch_load_safely(p)
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{p}: expected a dict of tensors (a state dict)")
    return {k.removeprefix("module."): v for k, v in obj.items()}


METADATA_KEY = "vitkit_config"  # vitkit's ViTConfig, in the metadata of the safetensors files `vitkit export` writes


PREPROCESSING_KEY = "vitkit_preprocessing"  # beside it: the mean, std, resize and crop, class names


def written_config(path: str | Path) -> dict[str, Any]:
    """The ViTConfig a safetensors file's metadata carries (what ``vitkit export`` writes there: the head count,
    pooling and the rest that the weights cannot show), or {} for any other file."""
    cfg = _metadata_json(path, METADATA_KEY, "ViTConfig keys")
    if cfg:
        check_keys(cfg, "model config", ViTConfig, source=f"{path} metadata '{METADATA_KEY}'")
    return cfg


def written_preprocessing(path: str | Path) -> dict[str, Any]:
    """The preprocessing ``vitkit export`` writes into a safetensors file's metadata (checked against the model
    when it is attached), or {}."""
    return _metadata_json(path, PREPROCESSING_KEY, "preprocessing values")


def _metadata_json(path: str | Path, key: str, what: str) -> dict[str, Any]:
    p = Path(path)
    if p.suffix != ".safetensors":
        return {}
    try:
        with safe_open(str(p), framework="pt") as f:
            text = (f.metadata() or {}).get(key)
    except Exception as e:  # noqa: BLE001 - a damaged header: read_safetensors names it when the weights are read
        raise ValueError(f"{p}: not a readable safetensors file ({' '.join(str(e).split())[:120]})") from None
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{p}: its '{key}' metadata is not a JSON mapping of {what}")
    return value


def weights_in(d: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")


def read_hf_folder(d: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    d = Path(d)
    return json.loads((d / CONFIG_NAME).read_text()), load_state_file(weights_in(d))
