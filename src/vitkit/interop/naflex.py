"""NaFlex checkpoints read into a vitkit ViT: timm's ``NaFlexVit`` and Hugging Face's SigLIP 2 vision tower.

Both are the ViT of vit.py with other names, where the weights map exactly (checked against timm's and
transformers' own forward passes in tests/test_naflex.py): E is a linear layer on (P, P, C)-flattened patches (the
same numbers as vitkit's P x P convolution, reshaped), E_pos a (H, W, D) grid added to the patches before the prefix
tokens join (``no_embed_class``), and MAP pooling in timm's layout or in ``nn.MultiheadAttention``'s. What the
weights cannot say comes from the architecture: SigLIP's tanh GELU and bilinear resampling of E_pos. Refused, by
name: factorised or rotary position embeddings, aspect-preserving E_pos resampling, input or embedding norms.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from .hf import fuse_qkv

# timm NaFlexVit parts vitkit does not have, by a key only they have
UNSUPPORTED = {"embeds.pos_embed_y": "a factorised position embedding (naflexvit_*_parfac_*)",
               "rope": "rotary position embeddings", "embeds.norm_input": "a norm on the input patches",
               "embeds.norm.": "a norm after the patch embedding", ".mlp.fc1_g.": "a SwiGLU MLP"}
# What a timm NaFlexVit architecture's name says and its weights do not
SIGLIP = {"mlp_act": "gelu_tanh", "pos_interp": "bilinear"}
HEADS = {"naflexvit_base_": 12, "naflexvit_so150m2_": 13, "naflexvit_so400m_": 16}


def is_timm_naflex(sd: dict[str, Any]) -> bool:
    return "embeds.proj.weight" in sd


def conv_weight(w: torch.Tensor, in_chans: int, source: str, key: str) -> torch.Tensor:
    """A linear E on (P, P, C)-flattened patches, (D, P*P*C), as the (D, C, P, P) convolution weight."""
    d, n = w.shape
    p = round((n / in_chans) ** 0.5)
    if p * p * in_chans != n:
        raise ValueError(f"{source}: {key} has {n} inputs per patch, not P*P*{in_chans} for a square patch")
    return w.reshape(d, p, p, in_chans).permute(0, 3, 1, 2).contiguous()  # d (p q c) -> d c p q


def arch_facts(arch: str | None, source: str) -> dict[str, Any]:
    """What a timm NaFlexVit architecture name says: heads, SigLIP's activation and resampling."""
    if not arch:
        return {}
    if "_par" in arch:
        raise ValueError(f"{source}: {arch} resamples E_pos preserving the aspect ratio (timm's "
                         "pos_embed_ar_preserving), which vitkit does not implement")
    facts = {"num_heads": h for prefix, h in HEADS.items() if arch.startswith(prefix)}
    return {**facts, **(SIGLIP if "siglip" in arch else {})}


def timm_naflex_to_vitkit(sd: dict[str, torch.Tensor], source: str, in_chans: int = 3
                          ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """timm NaFlexVit state dict -> (vitkit state dict, what it says of the config: img_size, no_embed_class)."""
    for part, what in UNSUPPORTED.items():
        if bad := sorted(k for k in sd if part in k):
            raise ValueError(f"{source}: {bad[:3]} belong to {what}, which vitkit does not implement")
    out: dict[str, torch.Tensor] = {}
    said: dict[str, Any] = {"no_embed_class": True}
    for k, v in sd.items():
        if k == "embeds.proj.weight":
            if v.ndim == 4:  # embed_proj_type='conv'
                out["patch_embed.proj.weight"] = v
            else:
                out["patch_embed.proj.weight"] = conv_weight(v, in_chans, source, k)
        elif k == "embeds.pos_embed":
            if v.ndim != 4:
                raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, expected (1, H, W, D)")
            said["grid"] = tuple(v.shape[1:3])
            out["pos_embed"] = v.reshape(1, -1, v.shape[-1])
        elif k.startswith("embeds."):
            out[k[len("embeds."):]] = v  # proj.bias -> patch_embed below; cls_token, reg_token as they are
        else:
            out[k] = v
    if "proj.bias" in out:
        out["patch_embed.proj.bias"] = out.pop("proj.bias")
    p = out["patch_embed.proj.weight"].shape[-2:]
    if "grid" in said:
        gh, gw = said.pop("grid")
        said["img_size"] = (gh * p[0], gw * p[1])
    return out, said


# Hugging Face SigLIP 2 (Siglip2VisionModel, or the vision tower of Siglip2Model) -> vitkit names
_HF_TOP = {"embeddings.patch_embedding.bias": "patch_embed.proj.bias", "post_layernorm.weight": "norm.weight",
           "post_layernorm.bias": "norm.bias", "head.probe": "attn_pool.latent",
           "head.attention.out_proj.weight": "attn_pool.proj.weight",
           "head.attention.out_proj.bias": "attn_pool.proj.bias", "head.layernorm.weight": "attn_pool.norm.weight",
           "head.layernorm.bias": "attn_pool.norm.bias"}
_HF_BLOCK = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj", "mlp.fc1": "mlp.fc1",
             "mlp.fc2": "mlp.fc2"}
HF_TYPES = ("siglip2", "siglip2_vision_model")


def siglip2_to_vitkit(sd: dict[str, torch.Tensor], hc: dict[str, Any], source: str
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """SigLIP 2 vision weights and config.json -> (vitkit state dict, the config's fields)."""
    vc = hc.get("vision_config", hc)
    if vc.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
        raise ValueError(f"{source}: hidden_act {vc['hidden_act']!r} is not supported")
    if vc.get("vision_use_head", True) is False or any(k.startswith("classifier.") for k in sd):
        raise ValueError(f"{source}: a SigLIP 2 classifier without the attention-pooling head (mean of the tokens "
                         "into 'classifier'), which vitkit does not read; the vision tower itself is read")
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    c = vc.get("num_channels", 3)
    for key, v in sd.items():
        if key.startswith(("text_model.", "logit_scale", "logit_bias")):
            continue  # the text tower and the contrastive scale
        k = key.removeprefix("vision_model.")
        if k in _HF_TOP:
            out[_HF_TOP[k]] = v
        elif k == "embeddings.patch_embedding.weight":
            out["patch_embed.proj.weight"] = conv_weight(v, c, source, key)
        elif k == "embeddings.position_embedding.weight":
            out["pos_embed"] = v[None]
        elif k.startswith("head.attention.in_proj_"):  # nn.MultiheadAttention's [q; k; v]
            kind, d = k.rsplit("_", 1)[1], v.shape[0] // 3
            out[f"attn_pool.q.{kind}"], out[f"attn_pool.kv.{kind}"] = v[:d], v[d:]
        elif k.startswith("head.mlp."):
            out["attn_pool." + k[len("head."):]] = v
        elif m := re.match(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$", k):
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = v
        elif (m := re.match(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", k)) and m.group(2) in _HF_BLOCK:
            out[f"blocks.{m.group(1)}.{_HF_BLOCK[m.group(2)]}.{m.group(3)}"] = v
        else:
            raise ValueError(f"{source}: unexpected key {key!r}")
    fuse_qkv(qkv, out, source, ("q", "k", "v"))
    if "pos_embed" not in out:
        raise ValueError(f"{source}: no embeddings.position_embedding.weight; not a SigLIP 2 vision tower")
    side = round(out["pos_embed"].shape[1] ** 0.5)
    p = vc.get("patch_size", 16)
    said = dict(num_heads=vc["num_attention_heads"], layer_norm_eps=vc.get("layer_norm_eps", 1e-6),
                img_size=side * p, no_embed_class=True, pool="map", in_chans=c,
                **({"mlp_act": "gelu"} if vc.get("hidden_act") == "gelu" else SIGLIP))
    return out, said
