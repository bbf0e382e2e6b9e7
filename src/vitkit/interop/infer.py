"""Reading a ViTConfig off the shapes of a (vitkit/timm-named) state dict."""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..model.config import TABLE1, ViTConfig, hybrid_stride, to_2tuple

WIDTH_TO_HEADS = {d["embed_dim"]: d["num_heads"] for d in TABLE1.values()}
WIDTH_TO_HEADS.update({192: 3, 384: 6})  # ViT-Ti and ViT-S (DeiT; timm's presets): 64-wide heads as in Table 1


def heads_for(width: int, source: str) -> int:
    """Attention heads are not visible in the weights. For the widths of the standard models (Table 1, ViT-Ti/S) the
    count every published checkpoint of that width uses; for any other width the weights fit any divisor of it, so
    a guess could be silently wrong: refused, naming what to pass."""
    if width in WIDTH_TO_HEADS:
        return WIDTH_TO_HEADS[width]
    raise ValueError(f"{source}: the number of attention heads is not in the weights, and width {width} is not a "
                     "standard ViT's (192, 384, 768, 1024, 1280), so it cannot be guessed; pass it: "
                     "`vitkit import --num-heads N` (or num_heads=N). Files that vitkit writes carry it")


def patch_count(img_size: Any, patch: tuple[int, int], stride: int = 1) -> int:
    """How many patches an image of ``img_size`` makes with ``patch`` (kh, kw) cut from a stride-``stride`` map."""
    h, w = to_2tuple(img_size)
    return (h // (patch[0] * stride)) * (w // (patch[1] * stride))


def resnetv2_spec(sd: dict[str, torch.Tensor]) -> str | None:
    """The hybrid spec of timm-named ``patch_embed.backbone.stages.I.blocks.J`` keys (the official R+ViT ResNet)."""
    if "patch_embed.backbone.conv.weight" in sd and "patch_embed.backbone.norm.weight" in sd:
        return "resnetv2:"  # the root alone
    if "patch_embed.backbone.stem.conv.weight" not in sd:
        return None
    blocks: dict[int, set[int]] = {}
    for k in sd:
        if m := re.match(r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.", k):
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return "resnetv2:" + ",".join(str(len(blocks[i])) for i in sorted(blocks))


def infer_config(sd: dict[str, torch.Tensor], source: str, **known: Any) -> ViTConfig:
    """The config of a state dict with vitkit/timm names; ``known`` fills what weights cannot tell (num_heads,
    a non-square img_size, the img_size of a model without a position table, layer_norm_eps, pos_embed)."""
    if "patch_embed.proj.weight" not in sd:
        if any(k in sd for k in ("mask_token", "decoder_pred.weight", "head.weight")) and \
                any(k.startswith(("decoder_", "mask_token")) for k in sd):
            raise ValueError(f"{source}: the objective's parts of a self-supervised run (an MAE decoder, or MPP's "
                             "[mask] embedding and colour head), not a ViT: --init the folder it is in, whose "
                             "model.safetensors holds the encoder")
        raise ValueError(f"{source}: no 'patch_embed.proj.weight'; not a ViT state dict with timm names "
                         f"(first keys: {list(sd)[:5]})")
    w = sd["patch_embed.proj.weight"]
    dim, in_chans, ph, pw = w.shape
    hybrid = known.get("hybrid", resnetv2_spec(sd))
    if hybrid and hybrid.startswith("resnetv2"):
        root = "patch_embed.backbone." + ("stem." if hybrid != "resnetv2:" else "")
        in_chans = sd[root + "conv.weight"].shape[1]
    elif hybrid:  # vitkit's own conv stems: the first filter bank's input channels
        first = next((v for k, v in sd.items() if k.startswith("patch_embed.backbone.") and v.ndim == 4), None)
        in_chans = first.shape[1] if first is not None else in_chans
    stride = hybrid_stride(hybrid) if hybrid else 1
    depth = len({m.group(1) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    pool = known.get("pool") or ("cls" if "cls_token" in sd else "map" if "attn_pool.latent" in sd else "gap")
    after = dict(dist_token="dist_token" in sd, reg_tokens=sd["reg_token"].shape[1] if "reg_token" in sd else 0,
                 qk_norm="blocks.0.attn.q_norm.weight" in sd,
                 # LayerScale's starting value is not in the weights (only where training took it); DINOv2's
                 layer_scale=1e-5 if "blocks.0.ls1.gamma" in sd else None)
    if pool == "cls" and "fc_norm.weight" in sd and "pool" not in known:
        raise ValueError(f"{source}: a class token and an fc_norm: what timm writes for global_pool='avg' with a class "
                         "token (the mean of the patch tokens), which vitkit does not have. If the model pools its "
                         "class token (global_pool='token', fc_norm=True), pass pool='cls' "
                         "(`vitkit import --pool cls`)")
    prefix = int(pool == "cls") + int(after["dist_token"]) + after["reg_tokens"]
    cfg: dict[str, Any] = dict(
        patch_size=ph if ph == pw else (ph, pw), in_chans=in_chans, embed_dim=dim, depth=depth,
        num_heads=known["num_heads"] if "num_heads" in known else heads_for(dim, source) if depth else 1,
        pool=pool, qkv_bias="blocks.0.attn.qkv.bias" in sd,
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / dim if depth else 4.0,
        num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
        fc_norm="fc_norm.weight" in sd, hybrid=hybrid,
        representation_size=sd["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in sd else None,
        pos_embed="learn" if "pos_embed" in sd else "none", **after)
    if "pos_embed" in sd:
        no_embed = known.get("no_embed_class")
        if no_embed is None:
            no_embed = _table_has_no_prefix_rows(sd["pos_embed"].shape[1], prefix, known.get("img_size"), (ph, pw),
                                                 stride, source)
        cfg["no_embed_class"] = no_embed
        n = sd["pos_embed"].shape[1] - (0 if no_embed else prefix)
        if n < 1:
            raise ValueError(f"{source}: pos_embed has {sd['pos_embed'].shape[1]} rows, too few for the {prefix} "
                             "class/distillation/register tokens and at least one patch")
        side = math.isqrt(n)
        if "img_size" in known:
            if (cells := patch_count(known["img_size"], (ph, pw), stride)) != n:
                raise ValueError(f"{source}: pos_embed has {n} patch tokens; img_size={known['img_size']} with "
                                 f"patch {(ph, pw)} x stride {stride} makes {cells}")
        elif side * side == n:
            cfg["img_size"] = (side * ph * stride if ph == pw else (side * ph * stride, side * pw * stride))
        else:
            raise ValueError(f"{source}: pos_embed has {n} patch tokens, not a square grid, so the image's height "
                             "and width are not in the weights; pass them: `--img-size H W` (Python: img_size=(H, W))")
    elif "img_size" not in known:  # a sin-cos (or no) position embedding works at any size: which one was it?
        raise ValueError(f"{source}: no position table, so the image size the model was trained at is not in the "
                         "weights (a 224x160 model read as 224x224 would squash its inputs); pass it: "
                         "`--img-size H W` (or img_size=(H, W))")
    cfg.update(known)
    return ViTConfig(**cfg)


def _square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _both_readings_fit(rows: int, prefix: int) -> bool:
    """A table of ``rows`` that is a square grid without prefix rows could also be a (non-)square one with them."""
    return prefix > 0 and _square(rows)


def _table_has_no_prefix_rows(rows: int, prefix: int, img_size: Any, patch: tuple[int, int], stride: int,
                              source: str) -> bool:
    """Whether the position table covers the patches alone (timm's ``no_embed_class``: DeiT III, DINOv2) rather than
    the prefix tokens too. The image size decides it where given; without it, only a table that is a square grid
    with the prefix rows and not without them is read (as the paper's models are); otherwise both readings fit."""
    if not prefix:
        return False
    if img_size is not None:
        return rows == patch_count(img_size, patch, stride)
    if _both_readings_fit(rows, prefix):
        other = "in a square grid" if _square(rows - prefix) else "not a square grid,"
        raise ValueError(f"{source}: the position table's {rows} rows are either a square grid of {rows} patches "
                         f"without rows for the {prefix} prefix token(s) (timm's no_embed_class: DeiT III, DINOv2) or "
                         f"{rows - prefix} patches, {other} with them; pass the image size: `--img-size H W` "
                         "(Python: img_size=(H, W))")
    return False


def size_is_the_tables(sd: dict[str, torch.Tensor], img_size: Any, known: dict[str, Any]) -> bool:
    """Whether ``img_size``, given for a file that does not write its size, is the size of its position table (a
    fact about the weights: a 2x8 grid at 32x128 has 16 rows, as a 4x4 one does, and only the user can say which)
    rather than a new size to resample it to (§3.2, fine-tuning at another resolution): it is the table's size
    whenever it makes as many patches as the table has rows (with or without the prefix tokens' rows, as
    ``no_embed_class`` says where known). Without a table (sin-cos, none), the size is always a fact."""
    if "pos_embed" not in sd:
        return True
    hybrid = known.get("hybrid", resnetv2_spec(sd))
    stride = hybrid_stride(hybrid) if hybrid else 1
    cells = patch_count(img_size, tuple(sd["patch_embed.proj.weight"].shape[2:]), stride)  # type: ignore[arg-type]
    prefix = sum(sd[k].shape[1] for k in ("cls_token", "dist_token", "reg_token") if k in sd)
    rows, no_embed = sd["pos_embed"].shape[1], known.get("no_embed_class")
    if no_embed is None:  # either reading; the size decides it
        return cells in (rows, rows - prefix)
    return cells == (rows if no_embed else rows - prefix)
