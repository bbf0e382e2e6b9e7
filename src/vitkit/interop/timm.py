"""timm's ``VisionTransformer``: the same parameter names, so conversion is a checked identity."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..model.config import ViTConfig
from ..model.hub import build_adapted
from ..model.vit import VisionTransformer
from .infer import infer_config
from .naflex import is_timm_naflex, timm_naflex_to_vitkit

# Weights of timm models outside the VisionTransformer family vitkit holds, by a key only they have.
EVA = "timm's Eva class (EVA-02, the vit_*_rope_* models): rotary position embedding, split q/v biases"
UNSUPPORTED = {  # in this order: a family's own key first (BEiT has Eva's gamma_1 and q_bias too)
    "layers.0.blocks.0.": "timm's SwinTransformer (Swin, Swin V2): windowed attention in stages joined by patch "
                          "merging, not one sequence of tokens",
    "relative_position_bias_table": "timm's Beit class (BEiT, BEiT v2, Data2Vec-vision): a relative position bias "
                                    "in each block",
    "rel_pos_bias.": "timm's Beit class (BEiT, BEiT v2): a relative position bias shared by the blocks",
    "norm_pre.": "a LayerNorm before the encoder (CLIP-style towers, timm's pre_norm=True)",
    ".gamma_1": EVA,
    ".attn.q_bias": EVA,
    ".mlp.fc1_g.": "a SwiGLU MLP (EVA-02, SigLIP 2 So400m variants)",
    ".attn.norm.": "a norm inside attention before its projection (timm's scale_norm)",
}


def timm_config(model: Any) -> dict[str, Any]:
    """What a live timm model knows but its weights do not say."""
    known: dict[str, Any] = {"num_heads": model.blocks[0].attn.num_heads} if len(model.blocks) else {}
    if getattr(model, "global_pool", "token") not in ("token", "avg", "map", ""):
        raise ValueError(f"timm global_pool={model.global_pool!r} is not supported (only 'token', 'avg' and 'map')")
    if getattr(model, "global_pool", "token") == "map" and getattr(model, "cls_token", None) is not None:
        raise ValueError("a timm model with a class token and attention pooling has no vitkit equivalent")
    if getattr(model, "global_pool", "token") == "avg" and getattr(model, "cls_token", None) is not None:
        raise ValueError("a timm model with a class token but average pooling has no vitkit equivalent")
    if getattr(model, "global_pool", "token") == "token" and getattr(model, "cls_token", None) is None:
        raise ValueError("a timm model without a class token must use global_pool='avg'")
    known["img_size"] = tuple(model.patch_embed.img_size)
    known["no_embed_class"] = bool(getattr(model, "no_embed_class", False))
    if getattr(model, "distilled_training", False):
        raise ValueError("a timm distilled model set to distilled_training returns two outputs while training; "
                         "vitkit's returns their average, as timm's does otherwise: call set_distilled_training(False)")
    known["layer_norm_eps"] = getattr(model.norm if not isinstance(model.norm, torch.nn.Identity) else model.fc_norm,
                                      "eps", 1e-6)
    return known


def naflex_config(model: Any) -> dict[str, Any]:
    """What a live timm NaFlexVit knows but its weights do not say; its variants vitkit lacks refused."""
    e = model.embeds
    kind = getattr(e, "pos_embed_type", "learned")
    if kind != "learned" or getattr(model, "rope", None) is not None:
        raise ValueError(f"timm NaFlexVit with pos_embed={kind!r}: vitkit reads the learned grid only")
    # (timm before 1.0.30 has no align_corners, grid-sample or antialias setting: it resampled as these defaults)
    if getattr(e, "pos_embed_ar_preserving", False) or getattr(e, "pos_embed_use_grid_sample", False) \
            or getattr(e, "pos_embed_align_corners", False) or not getattr(e, "pos_embed_antialias", True) \
            or e.pos_embed_interp_mode not in ("bicubic", "bilinear"):
        raise ValueError("timm NaFlexVit resampling E_pos other than by antialiased bicubic or bilinear "
                         "interpolation (align_corners=False, no aspect-preserving or grid-sample mode)")
    if model.global_pool not in ("avg", "map", "token") or model.pool_include_prefix:
        raise ValueError(f"timm NaFlexVit global_pool={model.global_pool!r} (pool_include_prefix="
                         f"{model.pool_include_prefix}): vitkit pools by 'token', 'avg' or 'map' over the patches")
    act = model.blocks[0].mlp.act if len(model.blocks) else None
    norm = model.norm if not isinstance(model.norm, torch.nn.Identity) else model.fc_norm
    return {"num_heads": model.blocks[0].attn.num_heads, "pos_interp": e.pos_embed_interp_mode,
            "mlp_act": "gelu_tanh" if getattr(act, "approximate", "none") == "tanh"
            or type(act).__name__ == "GELUTanh" else "gelu", "layer_norm_eps": getattr(norm, "eps", 1e-6)}


def timm_to_vitkit(sd: dict[str, torch.Tensor], source: str = "timm state dict") -> dict[str, torch.Tensor]:
    """timm -> vitkit state dict (the names are the same; unsupported timm variants are refused by name)."""
    for part, what in UNSUPPORTED.items():
        bad = sorted(k for k in sd if part in k)
        if bad:
            raise ValueError(f"{source}: {bad[:3]} belong to {what}, which vitkit does not implement (it reads timm's "
                             "VisionTransformer with class/distillation/register tokens, LayerScale and q/k norm)")
    return dict(sd)


def from_timm(state_dict_or_model: Any, **known: Any) -> VisionTransformer:
    """A vitkit model from a timm ``VisionTransformer`` or its state dict; config inferred from the weights."""
    if isinstance(state_dict_or_model, torch.nn.Module):
        is_naflex = hasattr(state_dict_or_model, "embeds")
        known = {**(naflex_config if is_naflex else timm_config)(state_dict_or_model), **known}
        sd = state_dict_or_model.state_dict()
    else:
        sd = dict(state_dict_or_model)
    sd = timm_to_vitkit(sd)
    if is_timm_naflex(sd):
        sd, said = timm_naflex_to_vitkit(sd, "timm weights")
        known = {**said, **known}
    return build_adapted(infer_config(sd, "timm weights", **known), sd, "timm weights")


def to_timm(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The timm state dict of ``model`` (load it into ``timm.create_model(<same preset>, ...)``)."""
    c = model.config
    c.refuse_pre_logits("timm's VisionTransformer (since timm 0.6)")
    if c.hybrid and not c.hybrid.startswith("resnetv2"):
        raise ValueError(f"hybrid={c.hybrid!r}: only the official R+ViT hybrids (hybrid='resnetv2:...') have a timm "
                         "equivalent; export safetensors or onnx instead")
    if c.pos_embed == "sincos2d":
        raise ValueError("pos_embed='sincos2d': timm's VisionTransformer has no fixed sin-cos position embedding, so "
                         "its reader would make one up; export safetensors (vitkit reads it back) or onnx instead")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def timm_kwargs(c: ViTConfig) -> dict[str, Any]:
    """Keyword arguments that make ``timm.models.vision_transformer.VisionTransformer`` match ``c``."""
    return dict(img_size=c.img_size, patch_size=c.patch_size, in_chans=c.in_chans, num_classes=c.num_classes,
                embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads, mlp_ratio=c.mlp_ratio,
                qkv_bias=c.qkv_bias, class_token=c.pool == "cls",
                global_pool={"cls": "token", "gap": "avg", "map": "map"}[c.pool],
                fc_norm=c.fc_norm, no_embed_class=c.no_embed_class, dynamic_img_size=False,
                reg_tokens=c.reg_tokens, init_values=c.layer_scale, qk_norm=c.qk_norm,
                norm_layer=partial(torch.nn.LayerNorm, eps=c.layer_norm_eps))


def timm_model(c: ViTConfig) -> Any:
    """The live timm model that ``to_timm``'s state dict loads into strictly: ``VisionTransformer``, or DeiT's
    ``VisionTransformerDistilled`` when the config has a distillation token (needs timm installed)."""
    from timm.models.deit import VisionTransformerDistilled  # optional dependency: timm (the dev extra)
    from timm.models.vision_transformer import VisionTransformer as TimmViT  # (the same package)

    return (VisionTransformerDistilled if c.dist_token else TimmViT)(**timm_kwargs(c))
