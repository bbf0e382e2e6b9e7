"""Top-1/top-5, loss, per-class accuracy and the confusion matrix of a model on in-memory images."""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.augment import BatchAugment, batches
from ..data.datasets import ImageTensors
from ..model.readout import readout_logits
from ..runtime.precision import autocast_for

# Evaluating 10,000 images of the recipes' models takes about the least time at batch 128-256 and up to 60% longer
# at 512 (Fashion-MNIST 5-minute model 1.36 vs 2.16 s, CIFAR-10 8.9 vs 13.7 s, bf16; fp32 alike):
# python benchmarks/eval_batch.py
EVAL_BATCH_SIZE = 256


def rank_batches(data: ImageTensors, rank: int, world: int, batch_size: int,
                 device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """This rank's share of ``data`` (every ``world``-th image) in batches, each with ``True``; then, where another
    rank has a batch more, one image marked ``False`` to run and not count: a sharded model's forward is a
    collective (its layers' weights gathered from every rank), so every rank runs as many."""
    idx = torch.arange(rank, len(data), world)
    for x, y in batches(data, idx, batch_size, drop_last=False, device=device):
        yield x, y, True
    most = math.ceil(math.ceil(len(data) / world) / batch_size)  # the batches of a rank with the most images
    for _ in range(most - math.ceil(len(idx) / batch_size)):
        x, y = next(iter(batches(data, torch.arange(1), 1, drop_last=False, device=device)))
        yield x, y, False


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ImageTensors, augment: BatchAugment, num_classes: int,
             device: torch.device, batch_size: int = EVAL_BATCH_SIZE, precision: str = "fp32",
             rank: int = 0, world: int = 1) -> dict:
    """Metrics over ``data``; under DDP each rank takes every ``world``-th image and the sums are all-reduced."""
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    top5 = torch.zeros((), dtype=torch.int64, device=device)
    for x, y, counted in rank_batches(data, rank, world, batch_size, device):
        x, _ = augment(x, y, train=False)
        with autocast_for(device, precision):
            logits = readout_logits(model, x)  # (the last layer for the class token only: the same logits)
        if not counted:
            continue
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        k = min(5, num_classes)
        top5 += (logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).sum()
        # (index_add_, not bincount: CUDA's bincount reads the labels' min and max back to the host, two waits for
        # the device a batch)
        confusion.view(-1).index_add_(0, y * num_classes + logits.argmax(1), torch.ones_like(y))
    if world > 1:
        for t in (confusion, loss_sum, top5):
            dist.all_reduce(t)
    model.train(was_training)
    n = int(confusion.sum())
    per_class = (confusion.diag().double() / confusion.sum(1).clamp_min(1)).tolist()
    return {"top1": 100.0 * float(confusion.diag().sum()) / max(n, 1), "top5": 100.0 * float(top5) / max(n, 1),
            "loss": float(loss_sum) / max(n, 1), "n": n, "per_class_acc": [100.0 * a for a in per_class],
            "confusion": confusion.cpu().tolist()}
