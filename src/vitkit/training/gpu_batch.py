"""The batch on a CUDA GPU: the recipe's doubled as long as the run's own step gets faster, fits in memory and
leaves an epoch enough optimizer steps; the learning rate scaled with it. The planner (training/plan.py) chooses it
first, and times every other setting at it: a GPU step at a small batch is launch-bound (the H200's CIFAR-10 step
at batch 128: fp32 9.2 ms, bf16 9.2 ms; at 1024: fp32 31.5 ms, bf16 21.0 ms; results/gpu-train-step-h200.csv),
so a precision chosen there is chosen on noise."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import TrainConfig

MEMORY_SHARE = 0.8  # of the GPU's free memory a step may peak at
MIN_GAIN = 1.05  # a doubled batch is kept only for at least 5% more images per second (the H200's CIFAR-10 step in
# bf16: 1024 -> 4096 gave 1.11x eager, but 2.7x once compiled; results/gpu-train-step-h200.csv)
# and only while an epoch keeps this many optimizer steps: small data needs its updates (a --time-limit run's
# schedule grows in epochs, up to the recipe's max_epochs, where the larger batch makes each epoch cheaper);
# 12 lets CIFAR-10's 50,000 images and Fashion-MNIST's 60,000 reach 4096
MIN_STEPS_PER_EPOCH = 12
MAX_BATCH = 4096


@dataclass
class BatchTrial:
    batch: int
    img_per_s: float
    peak_bytes: int
    fits: bool


def choose_batch(measure: Callable[[int], tuple[float, int]], base: int, n_train: int, free_bytes: int,
                 max_batch: int = MAX_BATCH) -> tuple[int, list[BatchTrial]]:
    """The batch for a GPU: of ``base`` doubled (up to ``max_batch`` and while an epoch keeps ``MIN_STEPS_PER_EPOCH``
    steps), the largest whose step peaks under ``MEMORY_SHARE`` of ``free_bytes`` and gives at least ``MIN_GAIN``
    times the images per second of half its batch; ``base`` where none does. ``measure(batch)`` -> (images per
    second, peak bytes), or raises ``torch.cuda.OutOfMemoryError``. Returns the batch and every trial.

    Searched from the top down: on the H200 every doubling from 128 to 4096 gained (results/gpu/), so the search
    from the bottom ran six sizes a model, twice a plan (the base model, then the tier's), where two answer. Where
    the gains flatten on the way up, both searches agree; where a flat stretch is followed by a gain (a compiled or
    launch-bound step), this one takes the gain. A size too large for the memory tells the next ones: a step's peak
    is a fixed part plus one growing with the batch, so half the batch peaks at least half as high, and the sizes
    whose lower bound is over the share are not run."""
    sizes = [base]
    while sizes[-1] * 2 <= max_batch and n_train // (sizes[-1] * 2) >= MIN_STEPS_PER_EPOCH:
        sizes.append(sizes[-1] * 2)
    share = MEMORY_SHARE * free_bytes
    trials: list[BatchTrial] = []
    upper: BatchTrial | None = None  # the largest size that ran and fitted
    floor = 0.0  # bytes per image a step is known to peak above (from a size that did not fit)
    for b in reversed(sizes) if len(sizes) > 1 else ():  # (one size: nothing to choose, nothing run)
        if upper is None and b != base and floor * b > share:
            continue
        try:
            speed, peak = measure(b)
        except torch.cuda.OutOfMemoryError:  # (its peak: above the free memory)
            speed, peak = 0.0, free_bytes + 1
        trials.append(BatchTrial(b, speed, min(peak, free_bytes), peak <= share))
        if not trials[-1].fits:
            if upper is not None:  # a smaller batch over the share a larger one fitted in (noise): the larger
                return upper.batch, trials
            floor = max(floor, peak / b)
        elif upper is not None and upper.img_per_s >= MIN_GAIN * speed:
            return upper.batch, trials
        else:
            upper = trials[-1]
    return base, trials


def checkpointing_fits(trials: list[BatchTrial], base: int, measure_checkpointed: Callable[[int], tuple[float, int]],
                       free_bytes: int) -> BatchTrial | None:
    """Where the run's own batch ``base`` was measured over the memory share (``choose_batch`` runs it whenever no
    larger size fits): the same step with activation checkpointing (each block's activations rebuilt in the backward
    pass: one more forward of each block, a fraction of the memory), measured; returned where it fits, else None.
    A ViT-L/16 fine-tuned at 384 px at its recipe's batch is that case on a 24 GB card; halving the batch would change
    the recipe (its learning rate with it), checkpointing changes only the time a step takes."""
    mine = next((t for t in trials if t.batch == base), None)
    if mine is None or mine.fits:
        return None
    try:
        speed, peak = measure_checkpointed(base)
    except torch.cuda.OutOfMemoryError:
        return None
    trial = BatchTrial(base, speed, min(peak, free_bytes), peak <= MEMORY_SHARE * free_bytes)
    return trial if trial.fits else None


def scale_lr(cfg: TrainConfig, batch: int) -> dict[str, Any]:
    """The learning rates for ``batch`` instead of ``cfg.batch_size``: linear scaling for SGD (Goyal et al. 2017),
    the square root for the adaptive optimizers (AdamW, and Muon's AdamW part; Malladi et al. 2022)."""
    k = batch / cfg.batch_size
    factor = k if cfg.opt == "sgd" else k ** 0.5
    return {"batch_size": batch, "lr": cfg.lr * factor, "min_lr": cfg.min_lr * factor}
