"""``vitkit models [--pretrained] [FILTER]``: the presets, or the registered pretrained weights, as a table."""
from __future__ import annotations

import argparse
import shutil
import sys


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("filter", nargs="?", default="", help="only names containing this")
    p.add_argument("--pretrained", action="store_true", help="list the pretrained weights (name.tag) instead")
    p.add_argument("--sources", action="store_true", help="with --pretrained: where each one downloads from")


NAME_WIDTH = 48  # a name longer than this (the official code's .npz files) gets a line of its own


def _table(rows: list[list[str]], columns: int = 0, first: int = 0) -> str:
    """Left-aligned columns; with ``columns`` (a terminal's width) the last column is cut to fit, with "…". With
    ``first``, a first cell longer than that is printed whole on a line of its own, its row under it (names are
    copied from here, so they are never cut)."""
    widths = [max(len(r[i]) for r in rows if not (i == 0 and first and len(r[0]) > first))
              for i in range(len(rows[0]))]
    if columns:
        room = max(12, columns - sum(widths[:-1]) - 2 * (len(widths) - 1) - 1)
        rows = [r[:-1] + [r[-1] if len(r[-1]) <= room else r[-1][:room - 1] + "…"] for r in rows]
        widths[-1] = min(widths[-1], room)
    lines = []
    for r in rows:
        if first and len(r[0]) > first:
            lines.append(r[0])
            r = [""] + r[1:]
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def _terminal_columns() -> int:
    """The terminal's width when printing to one (a pipe or a file gets whole lines)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 0


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model.config import PRESETS, to_2tuple
    from ..model.vit import VisionTransformer

    if args.pretrained:
        from ..interop.registry import list_pretrained

        entries = list_pretrained(args.filter)
        if not entries:
            print(f"no registered weights' name contains {args.filter!r} (`vitkit models --pretrained` lists them all)")
            return 1
        if args.sources:
            print(_table([["name", "source"]] + [[e.name, e.source] for e in entries], first=NAME_WIDTH))
            return 0
        rows = [["name", "architecture", "size", "top-1", "labels"]]
        for e in entries:
            rows.append([e.name, e.arch, str(e.img_size), f"{e.top1:.3f}" if e.top1 is not None else "-",
                         e.labels or "features"])
        print(_table(rows, _terminal_columns(), first=NAME_WIDTH) + "\n\ntop-1: ImageNet-1k validation as its "
              "publisher reports it (timm: results-imagenet.csv)\n--sources: where each one downloads from")
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
