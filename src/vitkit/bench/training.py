"""Training throughput: vitkit's trainer against plain loops over the same model."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms

from ..data.datasets import DataSplits
from ..runtime.precision import autocast_for, matmul_precision
from ..training.config import TrainConfig
from ..training.trainer import Trainer
from .timing import sync, throughput

CPU = torch.device("cpu")


def vitkit_train_steps(cfg: TrainConfig, data: DataSplits, steps: int = 60, warmup: int = 5,
                       plan: "Plan | None" = None, skip: int | None = None) -> Callable[[], None]:  # noqa: F821
    """A callable running ``steps`` steps of the real trainer (batch augmentation, precision, attention path as
    configured), after ``warmup`` steps (compiling included), for timing round-robin with the plain loops; an epoch
    too short for ``steps`` more is left for the next one. ``run.trainer`` is the Trainer.

    With ``skip``: each call runs ``skip`` steps, then ``steps`` more, and ``run.window`` is the seconds from the
    start of step ``skip`` to the start of step ``skip + steps`` (the device synced at both): the steady rate of a
    pass over files. Each call is a new pass over the loader, whose first batch waits for one worker to decode a
    whole batch (256 photos at 118 a second: 2.2 s, which was the whole of the H200's streamed-vs-workers gap for
    ViT-B/16, results/gpu/h200-2026-12-04b) while the workers' first round then comes at once; a run reads one pass
    an epoch, thousands of steps long. Clocked from one round's first batch to a later round's first, with ``steps``
    a multiple of the workers, the window holds whole rounds."""
    t = Trainer(cfg, data=data, log=lambda s: None, progress=False, plan_=plan)
    t.total_steps = warmup
    with matmul_precision(t.precision):  # as fit() trains (tf32: the matmuls on TF32 tensor cores, not fp32)
        t.train_epoch()
    g = cfg.grad_accum
    per_call = steps if skip is None else -(-(skip + steps + 1) // g)  # (optimizer steps; skip, steps: batches)
    marks: list[float] = []
    seen = [0]  # batches of this call
    augment = t.augment

    def clocked(x, y, **kw):  # type: ignore[no-untyped-def]  # (called once a batch, the batch come)
        if seen[0] in (skip, skip + steps):  # type: ignore[operator]
            sync(t.device)
            marks.append(time.perf_counter())
        seen[0] += 1
        return augment(x, y, **kw)
    if skip is not None:
        t.augment = clocked

    def run() -> None:
        if t.batch_in_epoch + per_call * g > t.steps_per_epoch * g:  # not enough left: a new epoch
            t.epoch, t.batch_in_epoch = t.epoch + 1, 0
        marks.clear()
        seen[0] = 0
        t.total_steps = t.step + per_call
        with matmul_precision(t.precision):
            t.train_epoch()
        if skip is not None:
            run.window = marks[1] - marks[0]  # type: ignore[attr-defined]
    run.trainer = t  # type: ignore[attr-defined]
    return run


def vitkit_train_throughput(cfg: TrainConfig, data: DataSplits, steps: int = 60, warmup: int = 5) -> float:
    """img/s of the real trainer over ``steps`` (one timed call)."""
    return throughput(vitkit_train_steps(cfg, data, steps, warmup), steps * cfg.batch_size, warmup=0, repeats=1)


class _PilDataset(torch.utils.data.Dataset):
    """The tutorial pipeline: one PIL image at a time through torchvision's ToTensor and Normalize."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: list[float], std: list[float]) -> None:
        self.images, self.labels = images, labels
        self.tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        a = self.images[i].numpy()
        img = Image.fromarray(a[0]) if a.shape[0] == 1 else Image.fromarray(a.transpose(1, 2, 0))
        return self.tf(img), int(self.labels[i])


def plain_loop_steps(model: nn.Module, data: DataSplits, batch_size: int, steps: int = 30, precision: str = "fp32",
                     pil: bool = True, lr: float = 1e-3) -> Callable[[], None]:
    """A callable running ``steps`` steps of a plain loop (after 3 warm-up steps): DataLoader (PIL per image) or
    in-memory tensors, AdamW, fp32 or bf16 autocast."""
    mean, std = data.mean_std()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    if pil:
        loader = torch.utils.data.DataLoader(_PilDataset(data.train.images, data.train.labels, mean, std),
                                             batch_size=batch_size, shuffle=True, drop_last=True)
        it = iter(loader)

        def next_batch():  # type: ignore[no-untyped-def]
            nonlocal it
            try:
                return next(it)
            except StopIteration:  # the next epoch
                it = iter(loader)
                return next(it)
    else:
        m = torch.tensor(mean).view(1, -1, 1, 1)
        s = torch.tensor(std).view(1, -1, 1, 1)
        gen = torch.Generator().manual_seed(0)

        def next_batch():  # type: ignore[no-untyped-def]
            idx = torch.randint(0, len(data.train), (batch_size,), generator=gen)
            return (data.train.images[idx].float() / 255 - m) / s, data.train.labels[idx]

    def step() -> None:
        x, y = next_batch()
        with autocast_for(CPU, precision):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()

    def run() -> None:
        for _ in range(steps):
            step()
    return run
