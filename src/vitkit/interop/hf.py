"""Hugging Face ``ViTModel`` / ``ViTForImageClassification``: name mapping and fused q/k/v."""
from __future__ import annotations

import re
from typing import Any

import torch

from ..model.config import ViTConfig, to_2tuple
from ..model.hub import build_adapted
from ..model.vit import VisionTransformer
from .files import read_hf_folder

# Two naming generations: the files on the Hub (and transformers < 5 in memory) use ``encoder.layer.N.…`` with
# ``attention.attention.{query,key,value}``; transformers 5 in memory uses ``layers.N.…`` with ``{q,k,v}_proj``.
_BLOCK = {
    "layernorm_before": "norm1", "attention.output.dense": "attn.proj", "layernorm_after": "norm2",
    "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
    "attention.o_proj": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
_QKV = {"query": "query", "key": "key", "value": "value", "q_proj": "query", "k_proj": "key", "v_proj": "value"}
_TOP = {
    "embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
}
IGNORED = ("pooler.", "embeddings.mask_token")  # ViTModel's tanh pooler is not part of the classifier


def hf_config_to_vitkit(hc: dict[str, Any], num_classes: int) -> ViTConfig:
    if hc.get("model_type", "vit") != "vit":
        raise ValueError(f"Hugging Face model_type {hc.get('model_type')!r} is not 'vit'")
    if hc.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {hc['hidden_act']!r} is not supported (only exact 'gelu')")
    return ViTConfig(img_size=hc.get("image_size", 224), patch_size=hc.get("patch_size", 16),
                     in_chans=hc.get("num_channels", 3), num_classes=num_classes,
                     embed_dim=hc["hidden_size"], depth=hc["num_hidden_layers"], num_heads=hc["num_attention_heads"],
                     mlp_ratio=hc["intermediate_size"] / hc["hidden_size"], qkv_bias=hc.get("qkv_bias", True),
                     layer_norm_eps=hc.get("layer_norm_eps", 1e-12))


def hf_to_vitkit(sd: dict[str, torch.Tensor], source: str = "Hugging Face weights") -> dict[str, torch.Tensor]:
    """HF names -> vitkit names; query/key/value are concatenated into one qkv projection."""
    if "patch_embed.proj.weight" in sd and not any(k.startswith(("vit.", "embeddings.", "encoder.")) for k in sd):
        raise ValueError(f"{source}: timm's names (patch_embed.proj.weight, blocks.N...), not Hugging Face's: read it "
                         "with --from timm (or let vitkit detect the format)")
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, v in sd.items():
        k = key[4:] if key.startswith("vit.") else key
        if k.startswith(IGNORED):
            continue
        if k in _TOP:
            out[_TOP[k]] = v
        elif k.startswith("classifier."):
            out["head." + k.split(".", 1)[1]] = v
        elif m := re.match(r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?"
                           r"(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)$", k):
            qkv.setdefault((m.group(1), m.group(3)), {})[_QKV[m.group(2)]] = v
        elif (m := re.match(r"(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$", k)) and m.group(2) in _BLOCK:
            out[f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"] = v
        else:
            raise ValueError(f"{source}: unexpected key {key!r}")
    return fuse_qkv(qkv, out, source)


def fuse_qkv(qkv: dict[tuple[str, str], dict[str, torch.Tensor]], out: dict[str, torch.Tensor], source: str,
             names: tuple[str, str, str] = ("query", "key", "value")) -> dict[str, torch.Tensor]:
    """Each layer's separate query, key and value projections, {(layer, weight|bias): {name: tensor}}, into ``out``
    as the one qkv projection vitkit and timm hold (rows: q, then k, then v)."""
    for (i, kind), parts in qkv.items():
        if set(parts) != set(names):
            raise ValueError(f"{source}: layer {i} has {sorted(parts)} {kind}s, expected {names[0]}, {names[1]} and "
                             f"{names[2]}")
        out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts[n] for n in names])
    return out


def vitkit_to_hf(model: VisionTransformer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with the Hub's file names, config.json dict) of the equivalent ``ViTForImageClassification``;
    ``ViTForImageClassification.from_pretrained`` reads the folder they make."""
    c = model.config
    c.refuse_after_paper("Hugging Face's ViTForImageClassification")
    if c.pool != "cls" or c.fc_norm or c.pos_embed != "learn" or c.hybrid:
        raise ValueError("Hugging Face ViT has only the class-token, learned-position-embedding, non-hybrid model; "
                         f"this one has pool={c.pool!r}, pos_embed={c.pos_embed!r}, hybrid={c.hybrid!r}")
    inv_top = {v: k for k, v in _TOP.items()}
    inv_block = {v: k for k, v in list(_BLOCK.items())[:5]}  # write the Hub's (file) names
    out: dict[str, torch.Tensor] = {}
    D = c.embed_dim
    for k, v in model.state_dict().items():
        v = v.detach().clone()
        if k in inv_top:
            out["vit." + inv_top[k]] = v
        elif k.startswith("head."):
            out["classifier." + k.split(".", 1)[1]] = v
        elif m := re.match(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", k):
            for j, name in enumerate(("query", "key", "value")):
                out[f"vit.encoder.layer.{m.group(1)}.attention.attention.{name}.{m.group(2)}"] = v[j * D:(j + 1) * D]
        elif m := re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", k):
            out[f"vit.encoder.layer.{m.group(1)}.{inv_block[m.group(2)]}.{m.group(3)}"] = v
        else:
            raise ValueError(f"no Hugging Face name for {k!r}")
    names = (getattr(model, "preprocessing", {}) or {}).get("class_names") or [f"LABEL_{i}" for i in
                                                                               range(c.num_classes)]
    h, w = to_2tuple(c.img_size)
    config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": D,
        "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": int(D * c.mlp_ratio),
        "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02, "layer_norm_eps": c.layer_norm_eps, "image_size": h if h == w else [h, w],
        "patch_size": to_2tuple(c.patch_size)[0], "num_channels": c.in_chans, "qkv_bias": c.qkv_bias,
        "encoder_stride": to_2tuple(c.patch_size)[0],
        "id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)},
    }
    return out, config


def from_hf(model_or_dir: Any, **known: Any) -> VisionTransformer:
    """A vitkit model from a ``transformers`` ViT model object or a saved folder (config.json + weights)."""
    if isinstance(model_or_dir, torch.nn.Module):
        hc, sd = model_or_dir.config.to_dict(), model_or_dir.state_dict()
    else:
        hc, sd = read_hf_folder(model_or_dir)
    sd = hf_to_vitkit(sd)
    num_classes = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    cfg = hf_config_to_vitkit(hc, num_classes).replace(**known)
    return build_adapted(cfg, sd, "Hugging Face weights")


def to_hf(model: VisionTransformer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return vitkit_to_hf(model)
