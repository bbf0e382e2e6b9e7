"""``vitkit calibrate``: time the candidates for a run's ``auto`` settings on this machine, print the plan, and
refresh the cache the next ``vitkit train`` (and ``predict``/``eval``/``serve``/``bench``) read."""
from __future__ import annotations

import argparse
import time

from . import train


def add_parser(p: argparse.ArgumentParser) -> None:
    train.add_parser(p)
    p.add_argument("--inference-batch", dest="_inference_batch", type=int, default=8, metavar="N",
                   help="also time the inference dtypes of the run's model at this batch (at most 32; 0: skip)")
    p.add_argument("--keep-cache", dest="_keep_cache", action="store_true",
                   help="use cached timings where there are any (default: time everything again and replace them)")


def run(args: argparse.Namespace) -> int:
    start = time.time()
    from ..runtime.calibrate import cache_file
    from ..runtime.inference import CALIBRATION_BATCH, choose_inference_dtype
    from ..training.build import build_data
    from ..training.plan import _probe, make_plan, resolve

    cfg, data, recipe = train.resolve_sources(args, resolve)
    data = data or build_data(cfg)
    cfg, p = make_plan(cfg, data, recipe, print, start, refresh=not args._keep_cache)
    if args._inference_batch > 0:
        model = _probe(cfg, data, _device(cfg)).model
        batch = min(args._inference_batch, CALIBRATION_BATCH)  # as optimize_for_inference times it (and memory bounded)
        dtype, cal = choose_inference_dtype(model, batch, refresh=not args._keep_cache)
        print(f"{cal.heading}\n{cal.table()}")
    print(f"cache: {cache_file()}")
    return 0


def _device(cfg):  # type: ignore[no-untyped-def]
    from ..runtime.device import resolve_device

    return resolve_device(cfg.device)
