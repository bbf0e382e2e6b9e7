"""The official JAX checkpoints (.npz) of google-research/vision_transformer and big_vision.

The layout is read off which keys are present, never guessed from one of them:
  prefix       none, ``opt/target/`` (vision_transformer's training state), ``params/`` or ``params/img/`` (big_vision);
  blocks       ``Transformer/encoderblock_N/`` or, scanned (big_vision), ``Transformer/encoderblock/`` with a leading
               layer axis; inside, two ``LayerNorm_*``, one ``MultiHeadDotProductAttention_*`` and one ``MlpBlock_*``
               in whichever numbering wrote them: ``_0, _1, _2, _3`` (the released pre-Linen files) or ``_0, _0, _1,
               _0`` (the Linen code of both repositories);
  position     ``Transformer/posembed_input/pos_embedding`` (vision_transformer: added after the class token, so
               it has a row for it), ``pos_embedding`` (big_vision: added before the class token of ``pool_type=
               'tok'``, so it may have no such row; vitkit gives the class token a zero row, which is the same
               model), or none: big_vision's fixed 2-D sin-cos (``posemb='sincos2d'``, rebuilt here);
  pooling      ``cls`` (class token), ``MAPHead_0/`` (attention pooling) or neither (mean of the tokens);
  hybrid       ``conv_root``, ``gn_root``, ``blockI/unitJ/`` (the R+ViT models' ResNet, see model/resnetv2.py);
  head         ``head``; an i21k ``pre_logits`` layer (Dense + tanh, §3.1's pre-training MLP head) is
               ``pre_logits.fc`` (``representation_size``); fine-tuning for new classes drops it with the head.
Every key is read or dropped by a named rule; a file with anything else is refused, naming the keys.

q/k/v kernels are (D, heads, head_dim), the output kernel (heads, head_dim, D), convolutions (kh, kw, in, out).
The JAX models use GELU's tanh approximation; vitkit (like timm and Hugging Face) uses the exact one, so logits
differ slightly from the JAX ones (~1e-3).
"""
from __future__ import annotations

import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..model.config import ViTConfig, hybrid_stride, resnetv2_layers, to_2tuple
from ..model.vit import VisionTransformer
from .contract import KeyLedger
from .infer import patch_count

# An extra array vitkit writes beside the official keys for a non-square model (the released loaders read the keys
# they know and leave others): the image size (H, W) the flat position table was laid out for.
IMG_SIZE_KEY = "vitkit/img_size"


SUPPORTED = ("vision_transformer (original, AugReg, Linen; R+ViT hybrids) and big_vision ViTs (learn/sincos2d "
             "position embeddings; tok/gap/map pooling; scanned or not)")
OLD_NUMBERING = ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")  # what we write


@dataclass
class Layout:
    prefix: str
    blocks: list[tuple[str, int | None]]  # (key prefix, index on the scanned axis)
    ln1: str
    mha: str
    ln2: str
    mlp: str


def _prefix(w: dict[str, np.ndarray], source: str) -> str:
    for prefix in ("", "opt/target/", "params/", "params/img/"):
        if f"{prefix}embedding/kernel" in w:
            return prefix
    raise ValueError(f"{source}: no 'embedding/kernel' (nor under opt/target/, params/, params/img/): not a ViT "
                     f"checkpoint of vision_transformer or big_vision (first keys: {list(w)[:5]})")


def detect_layout(w: dict[str, np.ndarray], source: str) -> Layout:
    p = _prefix(w, source)
    scanned = f"{p}Transformer/encoderblock/"
    if any(k.startswith(scanned) for k in w):
        first = scanned
        depth = next(v.shape[0] for k, v in w.items() if k.startswith(scanned))
        blocks: list[tuple[str, int | None]] = [(scanned, i) for i in range(depth)]
    else:
        ids = sorted({int(m.group(1)) for k in w if (m := re.match(re.escape(p) + r"Transformer/encoderblock_(\d+)/",
                                                                    k))})
        if ids != list(range(len(ids))):
            raise ValueError(f"{source}: encoder blocks {ids} are not numbered 0..N-1")
        blocks = [(f"{p}Transformer/encoderblock_{i}/", None) for i in ids]
        first = blocks[0][0] if blocks else ""
    names = sorted({k[len(first):].split("/")[0] for k in w if first and k.startswith(first)},
                   key=lambda n: (n.rsplit("_", 1)[0], int(n.rsplit("_", 1)[1]) if re.search(r"_\d+$", n) else -1))
    by_kind: dict[str, list[str]] = {}
    for n in names:
        by_kind.setdefault(n.rsplit("_", 1)[0], []).append(n)
    if not blocks:
        return Layout(p, [], *OLD_NUMBERING)
    if sorted(by_kind) != ["LayerNorm", "MlpBlock", "MultiHeadDotProductAttention"] or len(by_kind["LayerNorm"]) != 2 \
            or len(by_kind["MlpBlock"]) != 1 or len(by_kind["MultiHeadDotProductAttention"]) != 1:
        raise ValueError(f"{source}: an encoder block holds {names}; expected two LayerNorm_*, one "
                         "MultiHeadDotProductAttention_* and one MlpBlock_*")
    ln1, ln2 = by_kind["LayerNorm"]
    return Layout(p, blocks, ln1, by_kind["MultiHeadDotProductAttention"][0], ln2, by_kind["MlpBlock"][0])


def _one_to_one(L: Layout, hybrid: tuple[int, ...] | None, pool: str, head: bool, pre_logits: bool = False,
                ) -> Iterator[tuple[str, str, int | None, str]]:
    """(vitkit key, JAX key, scan index, kind) of the parameters that map one to one; kind says how the array turns:
    'copy', 'dense' (in, out -> out, in) or 'conv' (kh kw in out -> out in kh kw)."""
    p = L.prefix
    yield "patch_embed.proj.weight", p + "embedding/kernel", None, "conv"
    yield "patch_embed.proj.bias", p + "embedding/bias", None, "copy"
    for ours, theirs in (("weight", "scale"), ("bias", "bias")):
        yield f"norm.{ours}", f"{p}Transformer/encoder_norm/{theirs}", None, "copy"
        for i, (b, idx) in enumerate(L.blocks):
            yield f"blocks.{i}.norm1.{ours}", f"{b}{L.ln1}/{theirs}", idx, "copy"
            yield f"blocks.{i}.norm2.{ours}", f"{b}{L.ln2}/{theirs}", idx, "copy"
    for i, (b, idx) in enumerate(L.blocks):
        yield f"blocks.{i}.attn.proj.bias", f"{b}{L.mha}/out/bias", idx, "copy"
        for j in (0, 1):
            yield f"blocks.{i}.mlp.fc{j + 1}.weight", f"{b}{L.mlp}/Dense_{j}/kernel", idx, "dense"
            yield f"blocks.{i}.mlp.fc{j + 1}.bias", f"{b}{L.mlp}/Dense_{j}/bias", idx, "copy"
    if pool == "cls":
        yield "cls_token", p + "cls", None, "copy"
    if pool == "map":
        m = p + "MAPHead_0/"
        yield "attn_pool.latent", m + "probe", None, "copy"
        yield "attn_pool.proj.bias", m + "MultiHeadDotProductAttention_0/out/bias", None, "copy"
        yield "attn_pool.norm.weight", m + "LayerNorm_0/scale", None, "copy"
        yield "attn_pool.norm.bias", m + "LayerNorm_0/bias", None, "copy"
        for j in (0, 1):
            yield f"attn_pool.mlp.fc{j + 1}.weight", f"{m}MlpBlock_0/Dense_{j}/kernel", None, "dense"
            yield f"attn_pool.mlp.fc{j + 1}.bias", f"{m}MlpBlock_0/Dense_{j}/bias", None, "copy"
    if head:
        yield "head.weight", p + "head/kernel", None, "dense"
        yield "head.bias", p + "head/bias", None, "copy"
    if pre_logits:
        yield "pre_logits.fc.weight", p + "pre_logits/kernel", None, "dense"
        yield "pre_logits.fc.bias", p + "pre_logits/bias", None, "copy"
    if hybrid is not None:
        r = "patch_embed.backbone."
        root = r + ("stem." if hybrid else "")  # the root alone is the whole backbone
        yield root + "conv.weight", p + "conv_root/kernel", None, "conv"
        yield root + "norm.weight", p + "gn_root/scale", None, "copy"
        yield root + "norm.bias", p + "gn_root/bias", None, "copy"
        for i, blocks in enumerate(hybrid):
            for j in range(blocks):
                ours, theirs = f"{r}stages.{i}.blocks.{j}.", f"{p}block{i + 1}/unit{j + 1}/"
                convs = [("conv1", "gn1", "norm1"), ("conv2", "gn2", "norm2"), ("conv3", "gn3", "norm3")]
                if j == 0:  # the first unit of every stage changes the width, so it has the projection shortcut
                    convs.append(("conv_proj", "gn_proj", "downsample"))
                for conv, gn, norm in convs:
                    conv_ours = "downsample.conv" if norm == "downsample" else conv
                    norm_ours = "downsample.norm" if norm == "downsample" else norm
                    yield f"{ours}{conv_ours}.weight", f"{theirs}{conv}/kernel", None, "conv"
                    yield f"{ours}{norm_ours}.weight", f"{theirs}{gn}/scale", None, "copy"
                    yield f"{ours}{norm_ours}.bias", f"{theirs}{gn}/bias", None, "copy"


def _attention(L: Layout, pool: str) -> Iterator[tuple[str, str, int | None, tuple[str, ...]]]:
    """(vitkit prefix, JAX attention prefix, scan index, which of query/key/value the vitkit input projection holds)."""
    for i, (b, idx) in enumerate(L.blocks):
        yield f"blocks.{i}.attn.", f"{b}{L.mha}/", idx, ("query", "key", "value")
    if pool == "map":
        yield "attn_pool.", f"{L.prefix}MAPHead_0/MultiHeadDotProductAttention_0/", None, ("query",)


def _to_torch(a: np.ndarray, kind: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)).float()
    if kind == "dense":
        return t.T.contiguous()
    if kind == "conv":
        return t.permute(3, 2, 0, 1).contiguous()  # kh kw in out -> out in kh kw
    return t


def _to_numpy(t: torch.Tensor, kind: str) -> np.ndarray:
    a = t.detach().float().cpu().numpy()
    if kind == "dense":
        return a.T
    if kind == "conv":
        return a.transpose(2, 3, 1, 0)  # out in kh kw -> kh kw in out
    return a


def _hybrid_layers(w: dict[str, np.ndarray], p: str) -> tuple[int, ...] | None:
    if f"{p}conv_root/kernel" not in w:
        return None
    units: dict[int, set[int]] = {}
    for k in w:
        if m := re.match(re.escape(p) + r"block(\d+)/unit(\d+)/", k):
            units.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if sorted(units) != list(range(1, len(units) + 1)) or any(sorted(u) != list(range(1, len(u) + 1))
                                                               for u in units.values()):
        raise ValueError(f"the ResNet stages/units are not numbered block1.., unit1..: {sorted(units)}")
    return tuple(len(units[i]) for i in sorted(units))


def jax_to_vitkit(w: dict[str, np.ndarray], source: str = "npz", img_size: Any = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(vitkit state dict, what the file says beyond the state dict's shapes: num_heads, pos_embed, hybrid) from a
    flat npz mapping; ``img_size`` places a non-square position table (the file cannot tell its grid's shape)."""
    L = detect_layout(w, source)
    p, ledger = L.prefix, KeyLedger(w, source)
    if (shape := np.shape(w[p + "embedding/kernel"])) and len(shape) != 4:
        raise ValueError(f"{source}: {p}embedding/kernel has shape {tuple(shape)}; vitkit reads the paper's patch "
                         "embedding, a convolution (kh, kw, in, out). A 2-D kernel is a Dense over flattened patches "
                         "(big_vision's NaFlex variable-resolution models), a layout vitkit does not read")
    hybrid = _hybrid_layers(w, p)
    pool = "cls" if p + "cls" in w else "map" if p + "MAPHead_0/probe" in w else "gap"
    head = p + "head/kernel" in ledger.left
    if p + "pre_logits/kernel" in w and not head:
        raise ValueError(f"{source}: a pre_logits layer (§3.1's pre-training head: Dense + tanh) without the head "
                         "that reads it")

    def get(key: str, idx: int | None = None) -> np.ndarray:
        if key not in w:
            raise ValueError(f"{source}: missing key {key!r} (layout: prefix {p!r}, blocks {L.ln1}/{L.mha}/{L.ln2}/"
                             f"{L.mlp}, pool {pool!r}{', hybrid' if hybrid is not None else ''})")
        ledger.read(key)
        a = np.asarray(w[key])
        return a[idx] if idx is not None else a

    sd = {ours: _to_torch(get(theirs, idx), kind)
          for ours, theirs, idx, kind in _one_to_one(L, hybrid, pool, head, p + "pre_logits/kernel" in w)}
    heads = None
    for ours, a, idx, names in _attention(L, pool):
        qkv = [_to_torch(get(f"{a}{n}/kernel", idx), "copy") for n in ("query", "key", "value")]  # d h e each
        heads = heads or qkv[0].shape[1]
        bias = [_to_torch(get(f"{a}{n}/bias", idx), "copy").flatten()
                for n in ("query", "key", "value") if f"{a}{n}/bias" in w or names == ("query",)]
        weights = [x.flatten(1).T for x in qkv]  # d h e -> (h e) d
        if names == ("query",):  # MAP: the probe's query apart, keys and values of the tokens together
            sd[ours + "q.weight"], sd[ours + "kv.weight"] = weights[0], torch.cat(weights[1:])
            sd[ours + "q.bias"], sd[ours + "kv.bias"] = bias[0], torch.cat(bias[1:])
        else:
            sd[ours + "qkv.weight"] = torch.cat(weights)
            if bias:
                sd[ours + "qkv.bias"] = torch.cat(bias)
        out = _to_torch(get(f"{a}out/kernel", idx), "copy")
        sd[ours + "proj.weight"] = out.flatten(0, 1).T.contiguous()  # (h e) d -> d (h e)
    said: dict[str, Any] = {"num_heads": heads} if heads else {}
    if IMG_SIZE_KEY in w:  # vitkit's export of a non-square model: the table's H x W, which its rows cannot say
        said["img_size"] = _written_img_size(get(IMG_SIZE_KEY), source)
    if hybrid is not None:
        said["hybrid"] = "resnetv2:" + ",".join(map(str, hybrid))
    pos_keys = [k for k in (p + "Transformer/posembed_input/pos_embedding", p + "pos_embedding") if k in w]
    if len(pos_keys) > 1:
        raise ValueError(f"{source}: two position tables {pos_keys}; expected one")
    if pos_keys:
        sd["pos_embed"] = _with_class_row(torch.from_numpy(get(pos_keys[0])).float(),
                                          pos_keys[0] == p + "pos_embedding", pool, sd, said, img_size)
    else:
        said["pos_embed"] = "sincos2d"  # big_vision's only table-less kind; pass pos_embed="none" for none at all
    ledger.finish(SUPPORTED)
    return sd, said


def _with_class_row(pos: torch.Tensor, big_vision: bool, pool: str, sd: dict[str, torch.Tensor],
                    said: dict[str, Any], img_size: Any) -> torch.Tensor:
    """The table with a row for the class token. vision_transformer adds its table after prepending the class
    token, so the table has that row; big_vision's ``tok`` adds it before, so its table (top-level
    ``pos_embedding``) has none, and a zero row computes the same model."""
    if pool != "cls" or not big_vision:
        return pos
    rows = pos.shape[1]
    stride = hybrid_stride(said["hybrid"]) if "hybrid" in said else 1
    size = said.get("img_size", img_size)  # the table's own size (written by vitkit, or given and fitting it)
    cells = patch_count(size, sd["patch_embed.proj.weight"].shape[2:], stride) if size is not None else None
    if cells in (rows, rows - 1):
        has_row = rows == cells + 1
    else:  # no size, or a new one to resample to: a combined class+grid table (a vision_transformer file carried
        # over into big_vision's layout) is the one whose rows are a square grid only with the class row off
        has_row = math.isqrt(rows) ** 2 != rows and math.isqrt(rows - 1) ** 2 == rows - 1
    return pos if has_row else torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)


def _written_img_size(a: np.ndarray, source: str) -> tuple[int, int]:
    if a.shape != (2,) or a.dtype.kind not in "iu" or (a <= 0).any():
        raise ValueError(f"{source}: {IMG_SIZE_KEY!r} is {a.dtype} of shape {a.shape}; expected two positive "
                         "integers (H, W)")
    return int(a[0]), int(a[1])


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found")
    with open(p, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # numpy would try a pickle or a single .npy array on anything else
            raise ValueError(f"{p}: not an .npz file (a zip of named arrays, as the official checkpoints are)")
    try:
        with np.load(p, allow_pickle=False) as z:  # never unpickle object arrays
            return {k: z[k] for k in z.files}
    except ValueError as e:
        if "pickle" in str(e):
            raise ValueError(f"{p}: holds object (pickled) arrays; vitkit never unpickles, and the official "
                             "checkpoints are plain numeric arrays") from None
        raise ValueError(f"{p}: not an .npz checkpoint ({e})") from None
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise ValueError(f"{p}: not a readable .npz file (truncated, or not a zip of arrays: {e})") from None


def to_jax_npz(model: VisionTransformer, path: str | Path) -> None:
    """Write ``model`` in the layout of the released vision_transformer files (which that code, big_vision's
    loader and timm read), with big_vision's ``MAPHead_0`` for attention pooling."""
    c: ViTConfig = model.config
    c.refuse_after_paper("the official npz layout (vision_transformer)", pre_logits=True)
    if c.fc_norm or c.pos_embed == "sincos2d" or (c.hybrid and not c.hybrid.startswith("resnetv2")):
        raise ValueError("only ViTs without fc_norm, sincos2d or a non-official hybrid stem have the official npz "
                         f"layout (this one: fc_norm={c.fc_norm}, pos_embed={c.pos_embed!r}, hybrid={c.hybrid!r})")
    sd = model.state_dict()
    L = Layout("", [(f"Transformer/encoderblock_{i}/", None) for i in range(c.depth)], *OLD_NUMBERING)
    hybrid = resnetv2_layers(c.hybrid) if c.hybrid else None
    w = {theirs: _to_numpy(sd[ours], kind) for ours, theirs, _, kind in
         _one_to_one(L, hybrid, c.pool, "head.weight" in sd, "pre_logits.fc.weight" in sd)}
    H, D = c.num_heads, c.embed_dim
    for ours, a, _, names in _attention(L, c.pool):
        weight = sd[ours + ("q.weight" if names == ("query",) else "qkv.weight")]
        kv = sd[ours + "kv.weight"] if names == ("query",) else None
        bias = [sd[ours + n] for n in (("q.bias", "kv.bias") if names == ("query",) else ("qkv.bias",))
                if ours + n in sd]
        weights = torch.cat([weight, kv]) if kv is not None else weight
        for j, n in enumerate(("query", "key", "value")):
            w[f"{a}{n}/kernel"] = _to_numpy(weights[j * D:(j + 1) * D].T.reshape(D, H, D // H), "copy")
            if bias:
                w[f"{a}{n}/bias"] = _to_numpy(torch.cat(bias)[j * D:(j + 1) * D].reshape(H, D // H), "copy")
        w[f"{a}out/kernel"] = _to_numpy(sd[ours + "proj.weight"].T.reshape(H, D // H, D), "copy")
    if "pos_embed" in sd:
        w["Transformer/posembed_input/pos_embedding"] = _to_numpy(sd["pos_embed"], "copy")
        height, width = to_2tuple(c.img_size)
        if height != width:  # the flat table cannot say H x W: written beside it
            w[IMG_SIZE_KEY] = np.array([height, width], np.int64)
    np.savez(path, **w)
