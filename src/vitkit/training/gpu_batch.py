"""The batch on a CUDA GPU: doubled from the recipe's while the run's own step gets faster, fits in memory and
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
    """The batch for a GPU: from ``base``, doubled while the step at twice the batch still peaks under
    ``MEMORY_SHARE`` of ``free_bytes``, leaves an epoch ``MIN_STEPS_PER_EPOCH`` steps, and gives at least
    ``MIN_GAIN`` times the images per second. ``measure(batch)`` -> (images per second, peak bytes), or raises
    ``torch.cuda.OutOfMemoryError``. Returns the batch and every trial."""
    trials = [BatchTrial(base, *measure(base), True)]
    best = trials[0]
    b = base * 2
    while b <= max_batch and n_train // b >= MIN_STEPS_PER_EPOCH:
        try:
            speed, peak = measure(b)
        except torch.cuda.OutOfMemoryError:
            trials.append(BatchTrial(b, 0.0, free_bytes, False))
            break
        trials.append(BatchTrial(b, speed, peak, peak <= MEMORY_SHARE * free_bytes))
        if not trials[-1].fits or speed < MIN_GAIN * best.img_per_s:
            break
        best = trials[-1]
        b *= 2
    return best.batch, trials


def scale_lr(cfg: TrainConfig, batch: int) -> dict[str, Any]:
    """The learning rates for ``batch`` instead of ``cfg.batch_size``: linear scaling for SGD (Goyal et al. 2017),
    the square root for the adaptive optimizers (AdamW, and Muon's AdamW part; Malladi et al. 2022)."""
    k = batch / cfg.batch_size
    factor = k if cfg.opt == "sgd" else k ** 0.5
    return {"batch_size": batch, "lr": cfg.lr * factor, "min_lr": cfg.min_lr * factor}
