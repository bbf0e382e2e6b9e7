"""torchvision's ``VisionTransformer`` (vit_b_16, ...): name mapping; q/k/v are already one in_proj matrix."""
from __future__ import annotations

import re
from typing import Any

import torch
from torchvision.models.vision_transformer import VisionTransformer as TV

from ..model.config import to_2tuple
from ..model.vit import VisionTransformer

_TOP = {"class_token": "cls_token", "conv_proj.weight": "patch_embed.proj.weight",
        "conv_proj.bias": "patch_embed.proj.bias", "encoder.pos_embedding": "pos_embed",
        "encoder.ln.weight": "norm.weight", "encoder.ln.bias": "norm.bias",
        "heads.head.weight": "head.weight", "heads.head.bias": "head.bias"}
_BLOCK = {"ln_1": "norm1", "self_attention.in_proj": "attn.qkv", "self_attention.out_proj": "attn.proj",
          "ln_2": "norm2", "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2"}


def vitkit_to_torchvision(model: VisionTransformer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, constructor kwargs) of the equivalent ``torchvision.models.VisionTransformer``."""
    c = model.config
    (h, w), (ph, pw) = to_2tuple(c.img_size), to_2tuple(c.patch_size)
    c.refuse_after_paper("torchvision's VisionTransformer")
    if c.pool != "cls" or c.hybrid or c.pos_embed != "learn" or h != w or ph != pw or not c.qkv_bias or c.fc_norm:
        raise ValueError("torchvision's ViT is square, class-token, learned-position, qkv-bias only")
    inv_top = {v: k for k, v in _TOP.items()}
    inv_block = {v: k for k, v in _BLOCK.items()}
    out = {}
    for k, v in model.state_dict().items():
        if k in inv_top:
            out[inv_top[k]] = v
        elif m := re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", k):
            name = inv_block[m.group(2)]
            suffix = f"_{m.group(3)}" if name.endswith("in_proj") else f".{m.group(3)}"
            out[f"encoder.layers.encoder_layer_{m.group(1)}.{name}{suffix}"] = v
        else:
            raise ValueError(f"no torchvision name for {k!r}")
    kwargs = dict(image_size=h, patch_size=ph, num_layers=c.depth, num_heads=c.num_heads, hidden_dim=c.embed_dim,
                  mlp_dim=int(c.embed_dim * c.mlp_ratio), num_classes=c.num_classes)
    return out, kwargs


def to_torchvision(model: VisionTransformer) -> torch.nn.Module:
    """A ``torchvision.models.VisionTransformer`` holding ``model``'s weights."""
    sd, kwargs = vitkit_to_torchvision(model)
    tv = TV(**kwargs)
    tv.load_state_dict(sd)
    return tv
