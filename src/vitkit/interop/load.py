"""Recognise a weights file or folder and load it: vitkit, timm, Hugging Face or JAX."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..model.config import PRESETS, to_2tuple
from ..model.hub import CONFIG_NAME, build_adapted, from_pretrained
from ..model.serialization import check_preprocessing
from ..model.vit import VisionTransformer
from .download import resolve
from .files import load_state_file, read_hf_folder, weights_in, written_config, written_preprocessing
from .hf import from_hf, hf_to_vitkit
from .infer import infer_config, size_is_the_tables
from .jax import jax_to_vitkit, read_npz
from .mae import from_hf_mae
from .naflex import HF_TYPES, arch_facts as naflex_facts, is_timm_naflex, siglip2_to_vitkit, timm_naflex_to_vitkit
from .timm import timm_to_vitkit

SUPPORTED = ("a vitkit folder (config.json + model.safetensors)",
             "a Hugging Face ViT folder (config.json with model_type 'vit' + model.safetensors or pytorch_model.bin)",
             "a Hugging Face SigLIP 2 folder (model_type 'siglip2' or 'siglip2_vision_model': its vision tower)",
             "a timm ViT or NaFlexVit state dict (.safetensors, .pth, .pt, .bin) or a timm hub folder",
             "an official JAX checkpoint (.npz)")


def detect_format(src: str | Path) -> str:
    """'vitkit' | 'hf' | 'timm' | 'jax' for a path; raises with the list of supported formats."""
    p = Path(src)
    if p.is_dir():
        cfg = p / CONFIG_NAME
        meta = json.loads(cfg.read_text()) if cfg.is_file() else {}
        if meta.get("library") == "vitkit" or "model" in meta and isinstance(meta["model"], dict):
            return "vitkit"
        if meta.get("model_type") in ("vit", "vit_mae", *HF_TYPES):
            return "hf"
        if "architecture" in meta or "pretrained_cfg" in meta:
            return "timm"
    elif p.is_file():
        if p.suffix == ".npz":
            return "jax"
        if p.suffix in (".safetensors", ".pth", ".pt", ".bin"):
            sd = load_state_file(p)
            if any(k.startswith(("vit.", "embeddings.", "encoder.layer.", "vision_model.")) for k in sd):
                return "hf"
            return "timm"
    elif not p.exists():
        raise FileNotFoundError(f"{p} not found")
    raise ValueError(f"{p}: unrecognised weights; supported: " + "; ".join(SUPPORTED))


# What the weights cannot say (set on the inferred config), as opposed to adaptations (img_size, num_classes).
FACTS = ("num_heads", "pos_embed", "layer_norm_eps", "pool", "layer_scale", "no_embed_class")


def arch_facts(arch: str | None) -> dict[str, Any]:
    """What a timm file's shapes cannot say (heads, LayerScale's starting value, whether the position table has rows
    for the prefix tokens), as the named vitkit/timm architecture has it ({} for a name vitkit does not have)."""
    if arch not in PRESETS:
        return {}
    p = PRESETS[arch]
    return {"num_heads": p.num_heads, "layer_scale": p.layer_scale, "no_embed_class": p.no_embed_class}


def _timm_folder_architecture(d: Path) -> str | None:
    """The architecture a timm Hub folder's config.json names, if it names one."""
    try:
        arch = json.loads((d / CONFIG_NAME).read_text()).get("architecture")
    except (OSError, ValueError, AttributeError):
        return None
    return arch if isinstance(arch, str) else None


def _build(sd: dict[str, Any], source: str, said: dict[str, Any], overrides: dict[str, Any],
           fmt: str) -> VisionTransformer:
    facts = {k: overrides.pop(k) for k in FACTS if k in overrides}
    if "img_size" in overrides and "img_size" not in said and size_is_the_tables(
            sd, overrides["img_size"], {**said, **facts}):
        # a file that does not write its size, given one that fits its table: the table's size, never a target to
        # resample it to (a 2x8 grid read as 4x4 and resampled to 2x8 was silently wrong)
        facts["img_size"] = overrides.pop("img_size")
    cfg = infer_config(sd, source, **{**said, **facts})
    model = build_adapted(cfg, sd, source, **overrides)
    model.assumed = _assumptions(cfg, fmt, {**said, **facts})
    return model


def _assumptions(cfg: Any, fmt: str, stated: dict[str, Any]) -> dict[str, str]:
    """What was read off the weights' shapes by a rule that no reader can check (docs: guide/weights.md, "The grid's
    shape" and "Pooling of a big_vision file"), for ``vitkit import`` to print."""
    out = {}
    if "img_size" not in stated and cfg.pos_embed == "learn":
        h, w = to_2tuple(cfg.img_size)
        out["img_size"] = (f"image size {h}x{w} (assumed: the position table's rows make a square grid of "
                           f"{cfg.grid_size[0]}x{cfg.grid_size[1]} patches; a file of this kind cannot say its grid's "
                           "shape, so a non-square model with as many patches needs --img-size H W)")
    if fmt == "jax" and cfg.pool == "gap" and "pool" not in stated:
        out["pool"] = ("pooling gap (assumed: big_vision's pool_type='0', the first token without a class token, "
                       "has exactly a GAP model's keys, and vitkit does not read it)")
    return out


def load(src: str | Path, fmt: str | None = None, architecture: str | None = None,
         **overrides: Any) -> VisionTransformer:
    """The one way to load weights: a vitkit folder, a timm or Hugging Face folder or file, or an official JAX
    ``.npz`` (``fmt`` or detected). ``img_size`` / ``num_classes`` overrides adapt them (§3.2: resampled position
    embeddings, a new zero head), or give the size a file cannot tell (a non-square or absent position table);
    ``num_heads`` / ``pos_embed`` / ``layer_norm_eps`` state what the weights cannot show. ``architecture`` (a
    preset name, as a registry entry or a timm Hub folder's config.json gives it) states those for a timm file.
    ``vitkit train --init`` and every ``--checkpoint`` go through here; ``hf-hub:ORG/REPO`` fetches a Hub
    repository first (a vitkit, timm or transformers one: what ``vitkit push`` writes is all three)."""
    if isinstance(src, str) and src.startswith("hf-hub:") and not Path(src).exists():
        src, found = resolve(src)
        fmt = fmt or found
    p = Path(src)
    fmt = fmt or detect_format(p)
    if fmt == "vitkit":
        return from_pretrained(p, **overrides)
    if fmt == "jax":
        sd, said = jax_to_vitkit(read_npz(p), str(p), overrides.get("img_size"))
        return _build(sd, str(p), said, dict(overrides), fmt)
    if fmt == "hf":
        hc, sd = read_hf_folder(p) if p.is_dir() else ({}, load_state_file(p))
        if hc.get("model_type") in HF_TYPES or any("embeddings.patch_embedding." in k for k in sd):
            sd, said = siglip2_to_vitkit(sd, hc, str(p))
            return _build(sd, str(p), said, dict(overrides), fmt)
        if hc.get("model_type") == "vit_mae":  # a masked autoencoder: its encoder (interop/mae.py)
            encoder = from_hf_mae(p).encoder
            return build_adapted(encoder.config, encoder.state_dict(), str(p), **overrides)
        if p.is_dir():
            model = from_hf(p)
            return build_adapted(model.config, model.state_dict(), str(p), **overrides)
        return _build(hf_to_vitkit(load_state_file(p), str(p)), str(p), {"layer_norm_eps": 1e-12}, dict(overrides),
                      fmt)
    if fmt == "timm":
        f = weights_in(p) if p.is_dir() else p
        if architecture is None and p.is_dir():
            architecture = _timm_folder_architecture(p)
        overrides = {**arch_facts(architecture), **overrides}
        sd = timm_to_vitkit(load_state_file(f), str(p))
        said = written_config(f)  # a file vitkit wrote says what timm's layout cannot (heads, pooling, ...)
        if is_timm_naflex(sd):  # timm's NaFlexVit: E_pos as a grid, E a linear layer (interop/naflex.py)
            sd, grid_said = timm_naflex_to_vitkit(sd, str(p))
            said = {**grid_said, **naflex_facts(architecture, str(p)), **said}
        model = _build(sd, str(p), said, dict(overrides), fmt)
        if pre := written_preprocessing(f):  # ... and how its inputs were prepared
            if len(pre.get("class_names") or []) != model.config.num_classes:
                pre.pop("class_names", None)  # a new head (num_classes override): the old names do not apply
            model.preprocessing = check_preprocessing(pre, model.config, f"{f} metadata 'vitkit_preprocessing'")
        return model
    raise ValueError(f"unknown format {fmt!r}; expected vitkit, timm, hf or jax")


def from_jax_npz(path: str | Path, **known: Any) -> VisionTransformer:
    """A vitkit model from an official ``.npz``; the config is read off the weights (``known`` adds what they cannot
    say: a non-square ``img_size``, or ``img_size`` for a sin-cos model, whose file has no table to size). The same
    rule as ``load`` for what a given size means."""
    return load(path, "jax", **known)
