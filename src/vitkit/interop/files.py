"""Reading weights files: safetensors, or torch pickles loaded with ``weights_only=True`` (never executes code)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..model.serialization import CONFIG_NAME


def load_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from safetensors, or from a torch pickle read with ``weights_only=True`` (never executes code)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found")
    if p.suffix == ".safetensors":
        return load_file(str(p))
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{p}: refused to load; it is not a plain tensor checkpoint and unpickling it could run "
                         f"code ({str(e).splitlines()[0]})") from None
    except Exception as e:  # noqa: BLE001 - zip/format errors come in many types
        raise ValueError(f"{p}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{p}: expected a dict of tensors (a state dict)")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def weights_in(d: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")


def read_hf_folder(d: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    d = Path(d)
    return json.loads((d / CONFIG_NAME).read_text()), load_state_file(weights_in(d))
