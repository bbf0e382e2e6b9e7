"""Recognise a weights file or folder and load it: vitkit, timm, Hugging Face or JAX."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..model.config import ViTConfig
from ..model.hub import CONFIG_NAME, build_adapted, from_pretrained
from ..model.vit import VisionTransformer

SUPPORTED = ("a vitkit folder (config.json + model.safetensors)",
             "a Hugging Face ViT folder (config.json with model_type 'vit' + model.safetensors or pytorch_model.bin)",
             "a timm ViT state dict (.safetensors, .pth, .pt, .bin) or a timm hub folder",
             "an official JAX checkpoint (.npz)")


def into_model(cfg: ViTConfig, sd: dict[str, torch.Tensor], source: str, **overrides: Any) -> VisionTransformer:
    return build_adapted(cfg, sd, source, **overrides)


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


def _weights_in(d: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")


def read_hf_folder(d: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    d = Path(d)
    return json.loads((d / CONFIG_NAME).read_text()), load_state_file(_weights_in(d))


def detect_format(src: str | Path) -> str:
    """'vitkit' | 'hf' | 'timm' | 'jax' for a path; raises with the list of supported formats."""
    p = Path(src)
    if p.is_dir():
        cfg = p / CONFIG_NAME
        meta = json.loads(cfg.read_text()) if cfg.is_file() else {}
        if meta.get("library") == "vitkit" or "model" in meta and isinstance(meta["model"], dict):
            return "vitkit"
        if meta.get("model_type") == "vit":
            return "hf"
        if "architecture" in meta or "pretrained_cfg" in meta:
            return "timm"
    elif p.is_file():
        if p.suffix == ".npz":
            return "jax"
        if p.suffix in (".safetensors", ".pth", ".pt", ".bin"):
            sd = load_state_file(p)
            if any(k.startswith(("vit.", "embeddings.", "encoder.layer.")) for k in sd):
                return "hf"
            return "timm"
    elif not p.exists():
        raise FileNotFoundError(f"{p} not found")
    raise ValueError(f"{p}: unrecognised weights; supported: " + "; ".join(SUPPORTED))


def load_any(src: str | Path, fmt: str | None = None, **overrides: Any) -> VisionTransformer:
    """Load weights in any supported format; ``img_size`` / ``num_classes`` overrides adapt them (§3.2)."""
    from .hf import from_hf, hf_config_to_vitkit, hf_to_vitkit
    from .infer import infer_config
    from .jax import jax_to_vitkit, read_npz
    from .timm import timm_to_vitkit

    p = Path(src)
    fmt = fmt or detect_format(p)
    if fmt == "vitkit":
        return from_pretrained(p, **overrides)
    if fmt == "jax":
        sd, said = jax_to_vitkit(read_npz(p), str(p))
        return into_model(infer_config(sd, str(p), **said), sd, str(p), **overrides)
    if fmt == "hf":
        if p.is_dir():
            model = from_hf(p)
            return into_model(model.config, model.state_dict(), str(p), **overrides)
        sd = hf_to_vitkit(load_state_file(p), str(p))
        return into_model(infer_config(sd, str(p), layer_norm_eps=1e-12), sd, str(p), **overrides)
    if fmt == "timm":
        sd = timm_to_vitkit(load_state_file(_weights_in(p) if p.is_dir() else p), str(p))
        return into_model(infer_config(sd, str(p)), sd, str(p), **overrides)
    raise ValueError(f"unknown format {fmt!r}; expected vitkit, timm, hf or jax")
