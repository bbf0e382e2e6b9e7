"""Timing helpers: warm up, then the median of repeated timed runs."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device | str = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def throughput(fn: Callable[[], object], items: int, warmup: int = 2, repeats: int = 5, min_time: float = 0.0,
               device: torch.device | str = "cpu") -> float:
    """Items per second of ``fn``: median over ``repeats`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return items / statistics.median(times)


def round_robin_times(fns: list[Callable[[], object]], warmup: int = 1, repeats: int = 5,
                      device: torch.device | str = "cpu") -> list[list[float]]:
    """Seconds of each call of each of ``fns``, timed round-robin: each repeat runs every fn once, starting one
    further along each time, so that drift of the machine over the run, and whatever the previous call left in the
    caches, fall on all of them alike instead of on whichever ran last or first. ``times[j][r]`` is fn j in round r
    (for ratios taken within a round)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for i in range(len(fns)):
            j = (i + r) % len(fns)
            sync(device)
            t = time.perf_counter()
            fns[j]()
            sync(device)
            times[j].append(time.perf_counter() - t)
    return times


def interleaved_throughput(fns: list[Callable[[], object]], items: int, warmup: int = 1, repeats: int = 5,
                           device: torch.device | str = "cpu") -> list[float]:
    """Items per second of each of ``fns``, timed round-robin (``round_robin_times``), median per fn."""
    return [items / statistics.median(ts) for ts in round_robin_times(fns, warmup, repeats, device)]


def matmul_ceiling(dtype: torch.dtype, n: int = 4096, device: torch.device | str = "cpu") -> float:
    """FLOP/s of a large square matmul: what the machine can do in ``dtype`` at best."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return throughput(lambda: a @ b, items=2 * n ** 3, warmup=2, repeats=5, device=device)
