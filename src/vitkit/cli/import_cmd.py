"""``vitkit import --from {timm,hf,jax} SRC --out DIR``: any supported weights into a vitkit folder."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import ImageSize


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="fmt", choices=("timm", "hf", "jax", "auto"), default="auto",
                   help="format of SRC (default: detected)")
    p.add_argument("src", help="file or folder with the weights")
    p.add_argument("--out", required=True, help="new vitkit folder (config.json + model.safetensors)")
    p.add_argument("--img-size", action=ImageSize, default=None,
                   help="resample position embeddings to this size (§3.2), or the size a file cannot tell (a "
                        "non-square table: H W or HxW; a sin-cos model)")
    p.add_argument("--num-heads", type=int, default=None, help="heads, when the weights cannot tell (timm files)")
    p.add_argument("--pool", choices=("cls", "gap", "map"), default=None,
                   help="the pooling, when the weights cannot tell (a timm file with a class token and fc_norm "
                        "that pools its class token: cls)")
    p.add_argument("--pos-embed", choices=("sincos2d", "none"), default=None,
                   help="for a file without a position table: big_vision's sin-cos (assumed) or none")
    p.add_argument("--preprocessing", metavar="NAME.TAG", default=None,
                   help="the registered weights SRC is a copy of (`vitkit models --pretrained`): their publisher's "
                        "mean, std, resize and crop and class names are kept with them (a timm file has none, and "
                        "fine-tuning it would otherwise standardise with the dataset's own statistics)")


def refuse_overwrite(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not empty; choose another --out (nothing was overwritten)")


def run(args: argparse.Namespace) -> int:
    from ..interop import load

    out = Path(args.out)
    refuse_overwrite(out)
    overrides = {k: v for k, v in (("img_size", args.img_size), ("num_heads", args.num_heads),
                                   ("pos_embed", args.pos_embed), ("pool", args.pool)) if v is not None}
    model = load(args.src, None if args.fmt == "auto" else args.fmt, **overrides)
    if args.preprocessing:
        from ..interop.pretrained import check_arch, class_names, get_pretrained, with_preprocessing

        entry = get_pretrained(args.preprocessing)
        check_arch(model, entry.arch, args.src)  # the preprocessing of the same architecture, or a clear refusal
        with_preprocessing(model, entry, source=entry.name,
                           class_names=class_names(entry.labels, model.config.num_classes))
    model.save_pretrained(out)  # carries the source's preprocessing when it had one
    for note in getattr(model, "assumed", {}).values():
        print(f"read as: {note}")
    print(f"wrote {out}: {model.config.to_dict()}")
    return 0
