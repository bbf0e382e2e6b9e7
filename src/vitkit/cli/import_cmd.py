"""``vitkit import --from {timm,hf,jax} SRC --out DIR``: any supported weights into a vitkit folder."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="fmt", choices=("timm", "hf", "jax", "auto"), default="auto",
                   help="format of SRC (default: detected)")
    p.add_argument("src", help="file or folder with the weights")
    p.add_argument("--out", required=True, help="new vitkit folder (config.json + model.safetensors)")
    p.add_argument("--img-size", type=int, default=None, help="resample position embeddings to this size (§3.2)")
    p.add_argument("--num-heads", type=int, default=None, help="heads, when the weights cannot tell (timm files)")


def refuse_overwrite(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not empty; choose another --out (nothing was overwritten)")


def run(args: argparse.Namespace) -> int:
    from ..interop import load

    out = Path(args.out)
    refuse_overwrite(out)
    overrides = {k: v for k, v in (("img_size", args.img_size), ("num_heads", args.num_heads)) if v is not None}
    fmt = None if args.fmt == "auto" else args.fmt
    if "num_heads" in overrides:  # an architecture fact, not an adaptation: set it on the inferred config
        from ..interop.files import load_state_file
        from ..interop.infer import infer_config
        from ..interop.timm import timm_to_vitkit
        from ..model.hub import build_adapted

        sd = timm_to_vitkit(load_state_file(args.src), args.src)
        model = build_adapted(infer_config(sd, args.src, num_heads=overrides.pop("num_heads")), sd, args.src,
                              **overrides)
    else:
        model = load(args.src, fmt, **overrides)
    model.save_pretrained(out)  # carries the source's preprocessing when it had one
    print(f"wrote {out}: {model.config.to_dict()}")
    return 0
