"""The official JAX checkpoints (.npz) of google-research/vision_transformer and big_vision.

Two naming generations are read:
  vision_transformer: ``Transformer/encoderblock_N/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2,
                      MlpBlock_3}``, ``Transformer/posembed_input/pos_embedding``, ``cls``, ``embedding``, ``head``
                      (optionally under ``opt/target/``);
  big_vision:         ``params/[img/]`` prefix, ``{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
                      MlpBlock_0}``, ``pos_embedding`` at the top, and ``Transformer/encoderblock/...`` with a
                      leading layer axis when the encoder was scanned.
q/k/v kernels are (D, heads, head_dim), the output kernel (heads, head_dim, D), the patch kernel (P, P, C, D).
Note: the JAX models use the tanh approximation of GELU; vitkit (like timm and Hugging Face) uses the exact one,
so logits differ slightly from the JAX ones (~1e-3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..model.config import ViTConfig
from ..model.hub import build_adapted
from ..model.vit import VisionTransformer
from .infer import infer_config


def _layout(w: dict[str, np.ndarray], source: str) -> tuple[str, bool]:
    for prefix, big_vision in (("", False), ("opt/target/", False), ("params/", True), ("params/img/", True)):
        if f"{prefix}embedding/kernel" in w:
            return prefix, big_vision or f"{prefix}pos_embedding" in w
    raise ValueError(f"{source}: no 'embedding/kernel' (nor under opt/target/, params/, params/img/): not a ViT "
                     f"checkpoint of vision_transformer or big_vision (first keys: {list(w)[:5]})")


def jax_to_vitkit(w: dict[str, np.ndarray], source: str = "npz") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(vitkit state dict, what the weights say beyond shapes: num_heads) from a flat npz mapping."""
    prefix, bv = _layout(w, source)
    mha, ln2, mlp = (0, 1, 0) if bv else (1, 2, 3)
    scanned = f"{prefix}Transformer/encoderblock/LayerNorm_0/scale" in w

    def get(key: str, idx: int | None = None) -> torch.Tensor:
        full = prefix + key
        if full not in w:
            raise ValueError(f"{source}: missing key {full!r}")
        a = np.asarray(w[full])
        return torch.from_numpy(np.ascontiguousarray(a[idx] if idx is not None else a)).float()

    def t(a: torch.Tensor) -> torch.Tensor:  # (in, out) kernels -> (out, in) weights
        return a.T.contiguous()

    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": get("embedding/kernel").permute(3, 2, 0, 1).contiguous(),  # p q c d -> d c p q
        "patch_embed.proj.bias": get("embedding/bias"),
        "norm.weight": get("Transformer/encoder_norm/scale"), "norm.bias": get("Transformer/encoder_norm/bias"),
    }
    if prefix + "cls" in w:
        sd["cls_token"] = get("cls")
    pos_key = "pos_embedding" if prefix + "pos_embedding" in w else "Transformer/posembed_input/pos_embedding"
    if prefix + pos_key in w:
        sd["pos_embed"] = get(pos_key)
    if prefix + "pre_logits/kernel" in w:
        # the i21k "representation layer" (Dense + tanh) is not part of the paper's fine-tuned model; the head on
        # top of it would be wrong without it, so both are dropped: fine-tune with a new head.
        pass
    elif prefix + "head/kernel" in w:
        sd["head.weight"], sd["head.bias"] = t(get("head/kernel")), get("head/bias")
    if scanned:
        depth = w[f"{prefix}Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
    else:
        depth = len({k[len(prefix):].split("/")[1] for k in w if k.startswith(f"{prefix}Transformer/encoderblock_")})
    heads = None
    for i in range(depth):
        blk, idx = (("Transformer/encoderblock/", i) if scanned else (f"Transformer/encoderblock_{i}/", None))
        a = f"{blk}MultiHeadDotProductAttention_{mha}/"
        q, k, v = (get(f"{a}{n}/kernel", idx) for n in ("query", "key", "value"))  # d h e
        heads = q.shape[1]
        sd[f"blocks.{i}.norm1.weight"], sd[f"blocks.{i}.norm1.bias"] = get(f"{blk}LayerNorm_0/scale", idx), \
            get(f"{blk}LayerNorm_0/bias", idx)
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([x.flatten(1).T for x in (q, k, v)])  # d h e -> (h e) d
        if prefix + f"{a}query/bias" in w:
            sd[f"blocks.{i}.attn.qkv.bias"] = torch.cat([get(f"{a}{n}/bias", idx).flatten()
                                                         for n in ("query", "key", "value")])
        sd[f"blocks.{i}.attn.proj.weight"] = get(f"{a}out/kernel", idx).flatten(0, 1).T.contiguous()  # (h e) d -> d (h e)
        sd[f"blocks.{i}.attn.proj.bias"] = get(f"{a}out/bias", idx)
        sd[f"blocks.{i}.norm2.weight"], sd[f"blocks.{i}.norm2.bias"] = get(f"{blk}LayerNorm_{ln2}/scale", idx), \
            get(f"{blk}LayerNorm_{ln2}/bias", idx)
        for j in (0, 1):
            sd[f"blocks.{i}.mlp.fc{j + 1}.weight"] = t(get(f"{blk}MlpBlock_{mlp}/Dense_{j}/kernel", idx))
            sd[f"blocks.{i}.mlp.fc{j + 1}.bias"] = get(f"{blk}MlpBlock_{mlp}/Dense_{j}/bias", idx)
    return sd, ({"num_heads": heads} if heads else {})


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found")
    with np.load(p, allow_pickle=False) as z:  # never unpickle object arrays
        return {k: z[k] for k in z.files}


def from_jax_npz(path: str | Path, **known: Any) -> VisionTransformer:
    """A vitkit model from an official ``.npz``; the config is read off the weights."""
    sd, said = jax_to_vitkit(read_npz(path), str(path))
    cfg = infer_config(sd, str(path), **{**said, **known})
    return build_adapted(cfg, sd, str(path))


def to_jax_npz(model: VisionTransformer, path: str | Path) -> None:
    """Write ``model`` in the vision_transformer layout (readable by its code, big_vision's and timm's)."""
    c: ViTConfig = model.config
    if c.fc_norm or c.hybrid or c.pos_embed == "sincos2d":
        raise ValueError("only plain ViTs (no fc_norm, hybrid stem or sincos2d) have the official npz layout")
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    H, D = c.num_heads, c.embed_dim
    e = D // H
    w = {"embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # d c p q -> p q c d
         "embedding/bias": sd["patch_embed.proj.bias"],
         "Transformer/encoder_norm/scale": sd["norm.weight"], "Transformer/encoder_norm/bias": sd["norm.bias"]}
    if "cls_token" in sd:
        w["cls"] = sd["cls_token"]
    if "pos_embed" in sd:
        w["Transformer/posembed_input/pos_embedding"] = sd["pos_embed"]
    if "head.weight" in sd:
        w["head/kernel"], w["head/bias"] = sd["head.weight"].T, sd["head.bias"]
    for i in range(c.depth):
        b, p = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        a = b + "MultiHeadDotProductAttention_1/"
        w[b + "LayerNorm_0/scale"], w[b + "LayerNorm_0/bias"] = sd[p + "norm1.weight"], sd[p + "norm1.bias"]
        qkv = sd[p + "attn.qkv.weight"].reshape(3, D, D)
        for j, n in enumerate(("query", "key", "value")):
            w[f"{a}{n}/kernel"] = qkv[j].T.reshape(D, H, e)  # (h e) d -> d h e
            if p + "attn.qkv.bias" in sd:
                w[f"{a}{n}/bias"] = sd[p + "attn.qkv.bias"].reshape(3, H, e)[j]
        w[a + "out/kernel"] = sd[p + "attn.proj.weight"].T.reshape(H, e, D)
        w[a + "out/bias"] = sd[p + "attn.proj.bias"]
        w[b + "LayerNorm_2/scale"], w[b + "LayerNorm_2/bias"] = sd[p + "norm2.weight"], sd[p + "norm2.bias"]
        for j in (0, 1):
            w[f"{b}MlpBlock_3/Dense_{j}/kernel"] = sd[f"{p}mlp.fc{j + 1}.weight"].T
            w[f"{b}MlpBlock_3/Dense_{j}/bias"] = sd[f"{p}mlp.fc{j + 1}.bias"]
    np.savez(path, **w)
