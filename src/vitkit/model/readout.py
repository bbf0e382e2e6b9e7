"""Logits without the work no one reads: the last encoder layer computed for the readout tokens only.

Eq. 4 reads the class token (and DeiT's distillation token) of the last layer, z_L^0. In that layer every token's
keys and values feed the class token's attention, but the other tokens' queries, attention outputs, projections and
MLPs feed nothing: computing them is ~10/12 of the layer's work. ``readout_logits`` leaves them out, which gives the
same logits (to rounding) ~7% faster for ViT-B/16 (12 layers) and ~14% for a 6-layer model (docs: Speed).

For inference and evaluation only (no hooks, no attention maps of the last layer: ``forward_attention`` runs the
whole model); models that read every patch (GAP, MAP) or NaFlex batches run the ordinary forward.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .naflex import NaFlexBatch
from .vit import ATTENTION_KERNELS, Block, VisionTransformer


def reads_few_tokens(model: nn.Module) -> bool:
    """Whether ``readout_logits`` may leave out the last layer's other tokens for ``model``: a plain ViT in eval mode
    whose head reads its leading tokens, with a last layer on the sdpa or exact path and no hooks on it."""
    if type(model) is not VisionTransformer or model.training or model.config.pool != "cls" \
            or model.attn_pool is not None:
        return False
    if len(model.blocks) == 0:
        return False
    last = model.blocks[-1]
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in last.modules())  # someone observes the layer
    return last.attn.impl not in ATTENTION_KERNELS and not hooked


def readout_logits(model: nn.Module, x: torch.Tensor | NaFlexBatch) -> torch.Tensor:
    """``model(x)``, computing the last layer for the tokens the head reads only (where ``reads_few_tokens``)."""
    if isinstance(x, NaFlexBatch) or not reads_few_tokens(model):
        return model(x)
    z = model.embed(x)
    for blk in model.blocks[:-1]:
        z = blk(z)
    z = last_layer(model.blocks[-1], z, model.config.num_readout_tokens)
    return model.forward_head(model.norm(z))


def last_layer(blk: Block, z: torch.Tensor, n: int) -> torch.Tensor:
    """Eq. 2-3 for the first ``n`` tokens of ``z`` (B, T, D): their queries attend to every token's keys and values;
    (B, n, D)."""
    a = blk.attn
    h = blk.norm1(z)
    B, T, D = h.shape
    heads, w, b = a.num_heads, a.qkv.weight, a.qkv.bias  # qkv's rows: q (D), k (D), v (D)
    q = F.linear(h[:, :n], w[:D], None if b is None else b[:D]).reshape(B, n, heads, D // heads)  # b n (h d)
    k, v = F.linear(h, w[D:], None if b is None else b[D:]).reshape(B, T, 2, heads, D // heads).unbind(2)
    if hasattr(a, "q_norm"):
        q, k = a.q_norm(q), a.k_norm(k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # b t h d -> b h t d
    if a.impl == "exact":
        o = a.attend((q * a.scale) @ k.transpose(-2, -1)) @ v  # (B, h, n, D_h)
    else:
        o = F.scaled_dot_product_attention(q, k, v)
    z = z[:, :n] + blk.ls1(a.proj(o.transpose(1, 2).reshape(B, n, D)))  # Eq. 2, b h n d -> b n (h d)
    return z + blk.ls2(blk.mlp(blk.norm2(z)))  # Eq. 3
