"""``vitkit models [--pretrained] [FILTER]``: the presets, or the registered pretrained weights, as a table."""
from __future__ import annotations

import argparse
import shutil
import sys


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("filter", nargs="?", default="", help="only names containing this")
    p.add_argument("--pretrained", action="store_true", help="list the pretrained weights (name.tag) instead")


def _table(rows: list[list[str]], columns: int = 0) -> str:
    """Left-aligned columns; with ``columns`` (a terminal's width) the last column is cut to fit, with "…"."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if columns:
        room = max(12, columns - sum(widths[:-1]) - 2 * (len(widths) - 1) - 1)
        rows = [r[:-1] + [r[-1] if len(r[-1]) <= room else r[-1][:room - 1] + "…"] for r in rows]
        widths[-1] = min(widths[-1], room)
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _terminal_columns() -> int:
    """The terminal's width when printing to one (a pipe or a file gets whole lines)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 0


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model.config import PRESETS, to_2tuple
    from ..model.vit import VisionTransformer

    if args.pretrained:
        from ..interop.registry import list_pretrained

        rows = [["name", "architecture", "size", "top-1", "labels", "source"]]
        for e in list_pretrained(args.filter):
            rows.append([e.name, e.arch, str(e.img_size), f"{e.top1:.3f}" if e.top1 is not None else "-",
                         e.labels or "features", e.source])
        print(_table(rows, _terminal_columns()) + "\n\ntop-1: ImageNet-1k validation as its publisher reports it "
              "(timm: results-imagenet.csv)")
        return 0
    rows = [["name", "params", "image", "patch", "width", "depth", "heads", "hybrid"]]
    for name in sorted(n for n in PRESETS if args.filter in n):
        c = PRESETS[name]
        with torch.device("meta"):
            n = VisionTransformer(c).num_params
        rows.append([name, f"{n / 1e6:.1f}M", "x".join(map(str, to_2tuple(c.img_size))), str(c.patch_size),
                     str(c.embed_dim), str(c.depth), str(c.num_heads), c.hybrid or "-"])
    print(_table(rows))
    return 0
