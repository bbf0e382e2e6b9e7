"""``vitkit shard``: a folder or zip of images as WebDataset shards (data/shards.py), for ``--dataset shards``."""
from __future__ import annotations

import argparse

from .common import positive_int


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", required=True, help="a folder or .zip with train/<class>/* and val/ or test/")
    p.add_argument("--out", required=True, help="a new or empty folder for the shards and classes.json")
    p.add_argument("--per-shard", type=positive_int, default=None, metavar="N",
                   help="images a shard holds at most (default 10,000)")
    p.add_argument("--seed", type=int, default=0, help="the training images' order in the shards")


def run(args: argparse.Namespace) -> int:
    from ..data.shards import SHARD_IMAGES, write_shards
    from .train import _progress

    write_shards(args.data_dir, args.out, args.per_shard or SHARD_IMAGES, args.seed, progress=_progress())
    return 0
