"""What a streamed run costs before it is run (``vitkit train ... --estimate``): the trainer's own step on images
read from their files, against the same step on images already in memory (the same shapes, random pixels), timed
round-robin; the workers' reading alone; and the hours the schedule takes at the streamed rate.

The in-memory step is what the model and the device allow; the streamed step is what the run will get. Where the
streamed rate falls short of it, reading and decoding (the CPU's share) bind, not the model: more workers (cores),
shards on faster storage, or decoding elsewhere would buy it back.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..data.splits import DataSplits, ImageTensors
from ..data.stream import PREFETCH
from ..runtime.device import resolve_device
from ..training.config import TrainConfig
from .timing import round_robin_times
from .training import vitkit_train_steps

IMAGENET_TRAIN_IMAGES = 1_281_167  # ImageNet-1k's training split (ILSVRC-2012)


@dataclass
class StreamCost:
    """Images per second: the streamed step, the in-memory step, the workers alone."""

    streamed: float
    in_memory: float
    reading: float
    workers: int
    batch: int
    device: str
    decoded_on_device: bool = False  # the workers read the JPEGs' bytes; the device decodes and cuts them

    def hours(self, epochs: float, images: int, processes: int = 1) -> float:
        """Wall hours for ``epochs`` over ``images`` at the streamed rate, on ``processes`` devices each as fast as
        this one (the gradient's all-reduce not counted: small beside a ViT's step)."""
        return epochs * images / (self.streamed * processes) / 3600


def in_memory_like(data: DataSplits, n: int, seed: int = 0) -> DataSplits:
    """``n`` random uint8 images of ``data``'s shape and classes, held in memory: the same step without reading."""
    _, c, h, w = data.train.shape
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, data.num_classes, (n,), generator=g)
    val = ImageTensors(images[:min(n, 256)], labels[:min(n, 256)])
    return DataSplits(f"{data.name} (random pixels in memory)", ImageTensors(images, labels), val, data.classes)


def reading_rate(data: DataSplits, batch: int, batches: int) -> float:
    """Images per second the workers read, decode and cut, with no training beside them, in steady state: the
    clock starts once the first batch has come (the workers have started), and the batches they had ready by
    then are not counted (a start-up in the rate made a short timing say half of what 16 workers read). Where the
    split holds fewer images than that needs (16 workers keep 64 batches ready: 16,384 images at batch 256), the
    files are read again from the first: an H200's 12,000 photos were refused "too few" at the first call."""
    skip = PREFETCH * max(data.train.workers, 1)
    idx = [i % len(data.train) for i in range(batch * (batches + skip + 1))]  # (stream_cost: >= 4 batches there)
    chunks = [idx[i:i + batch] for i in range(0, len(idx), batch)]
    t, n = None, 0
    # the workers' own output (decoded images, or a JPEG's bytes where the device decodes): the loader, not batches()
    for i, (_, y, _) in enumerate(data.train.loader(chunks, torch.device("cpu"))):
        if i == skip:
            t = time.perf_counter()
        elif i > skip:
            n += len(y)
    assert t is not None  # (skip + 1 + batches chunks)
    return n / max(time.perf_counter() - t, 1e-9)


def stream_cost(cfg: TrainConfig, data: DataSplits, plan: object, steps: int = 30, warmup: int = 3,
                repeats: int = 3) -> StreamCost:
    """The streamed and the in-memory step of ``cfg`` (planned: no ``auto`` left), ``steps`` a timing, round-robin."""
    if not data.streamed:
        raise ValueError(f"--estimate times a streamed run against the same step in memory; {data.name} is held in "
                         "memory already (--data-mode stream to time reading it from the files)")
    device = resolve_device(cfg.device)
    per_epoch = len(data.train) // cfg.batch_size
    if per_epoch < warmup + 1:
        raise ValueError(f"--estimate: {data.name} has {len(data.train)} training images, {per_epoch} batches of "
                         f"{cfg.batch_size}; timing needs at least {warmup + 1} (a smaller --batch-size)")
    # each timing inside one epoch (one loader pass, as a run reads it), clocked in steady state: whole rounds of
    # the workers after their first (bench/training.py, vitkit_train_steps)
    w = max(data.train.workers, 1)
    skip = w if 2 * w + 1 <= per_epoch else 0
    steps = min(steps, per_epoch - skip - 1)
    if steps >= w:  # (whole rounds where an epoch holds one)
        steps -= steps % w
    memory = in_memory_like(data, cfg.batch_size * (skip + steps + warmup + 3))
    fns = [vitkit_train_steps(cfg, d, steps, warmup, plan, skip=skip) for d in (data, memory)]  # type: ignore[arg-type]
    windows: list[list[float]] = [[], []]

    def timed(i: int) -> Callable[[], None]:
        def call() -> None:
            fns[i]()
            windows[i].append(fns[i].window)  # type: ignore[attr-defined]
        return call
    round_robin_times([timed(0), timed(1)], warmup=0, repeats=repeats, device=device)
    streamed, in_memory = (steps * cfg.batch_size / max(statistics.median(ws), 1e-9) for ws in windows)
    reading = reading_rate(data, cfg.batch_size, max(steps + warmup, 8))
    return StreamCost(streamed, in_memory, reading, data.train.workers, cfg.batch_size, str(device),
                      cfg.decode == "device")


def report(cost: StreamCost, epochs: float, images: int, say: Callable[[str], None] = print,
           processes: tuple[int, ...] = (1, 8)) -> None:
    """The measured rates, then the schedule's hours at the streamed rate on 1 and 8 such devices."""
    share = cost.streamed / cost.in_memory
    workers = f"{cost.workers} worker{'s' if cost.workers != 1 else ''}"
    say(f"streamed step: {cost.streamed:,.0f} img/s on {cost.device} (batch {cost.batch}, {workers}); "
        f"the same step on images in memory: {cost.in_memory:,.0f} img/s ({share:.0%} of it streamed)")
    say(f"the workers alone read, decode and cut {cost.reading:,.0f} img/s" if not cost.decoded_on_device else
        f"the workers alone read {cost.reading:,.0f} img/s (their JPEGs are decoded and cut on {cost.device})")
    for n in processes:
        hours = cost.hours(epochs, images, n)
        if n == 1:
            say(f"{epochs:g} epochs of {images:,} images: {hours:.1f} h on one such device")
        else:
            need = cost.streamed * n
            say(f"on {n} such devices (torchrun): {hours:.1f} h if their hosts read {need:,.0f} img/s between them "
                f"({need / cost.reading:.1f}x what this host's workers read alone)")
