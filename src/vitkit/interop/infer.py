"""Reading a ViTConfig off the shapes of a (vitkit/timm-named) state dict."""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..model.config import TABLE1, ViTConfig

WIDTH_TO_HEADS = {d["embed_dim"]: d["num_heads"] for d in TABLE1.values()}


def heads_for(width: int) -> int:
    """Attention heads are not visible in the weights: Table 1's count for its widths, else 64-wide heads."""
    return WIDTH_TO_HEADS.get(width, max(1, width // 64))


def infer_config(sd: dict[str, torch.Tensor], source: str, **known: Any) -> ViTConfig:
    """The config of a state dict with vitkit/timm names; ``known`` fills what weights cannot tell (num_heads,
    a non-square img_size, layer_norm_eps)."""
    if "patch_embed.proj.weight" not in sd:
        raise ValueError(f"{source}: no 'patch_embed.proj.weight'; not a ViT state dict with timm names "
                         f"(first keys: {list(sd)[:5]})")
    w = sd["patch_embed.proj.weight"]
    dim, in_chans, ph, pw = w.shape
    depth = len({m.group(1) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    pool = "cls" if "cls_token" in sd else "gap"
    prefix = 1 if pool == "cls" else 0
    cfg: dict[str, Any] = dict(
        patch_size=ph if ph == pw else (ph, pw), in_chans=in_chans, embed_dim=dim, depth=depth,
        num_heads=heads_for(dim), pool=pool, qkv_bias="blocks.0.attn.qkv.bias" in sd,
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / dim if depth else 4.0,
        num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
        fc_norm="fc_norm.weight" in sd,
        pos_embed="learn" if "pos_embed" in sd else "none")
    if "pos_embed" in sd:
        n = sd["pos_embed"].shape[1] - prefix
        side = math.isqrt(n)
        if side * side == n:
            cfg["img_size"] = side * ph if ph == pw else (side * ph, side * pw)
        elif "img_size" not in known:
            raise ValueError(f"{source}: pos_embed has {n} patch tokens, not a square grid; pass img_size=(H, W)")
    elif "img_size" not in known:
        cfg["img_size"] = 224
    cfg.update(known)
    return ViTConfig(**cfg)
