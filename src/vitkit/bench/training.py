"""Training throughput: vitkit's trainer against plain loops over the same model."""
from __future__ import annotations

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
from .timing import throughput

CPU = torch.device("cpu")


def vitkit_train_steps(cfg: TrainConfig, data: DataSplits, steps: int = 60, warmup: int = 5,
                       plan: "Plan | None" = None) -> Callable[[], None]:  # noqa: F821
    """A callable running ``steps`` steps of the real trainer (batch augmentation, precision, attention path as
    configured), after ``warmup`` steps (compiling included), for timing round-robin with the plain loops; an epoch
    too short for ``steps`` more is left for the next one. ``run.trainer`` is the Trainer."""
    t = Trainer(cfg, data=data, log=lambda s: None, progress=False, plan_=plan)
    t.total_steps = warmup
    with matmul_precision(t.precision):  # as fit() trains (tf32: the matmuls on TF32 tensor cores, not fp32)
        t.train_epoch()

    def run() -> None:
        if t.batch_in_epoch + steps > t.steps_per_epoch * cfg.grad_accum:  # not enough left: a new epoch
            t.epoch, t.batch_in_epoch = t.epoch + 1, 0
        t.total_steps = t.step + steps
        with matmul_precision(t.precision):
            t.train_epoch()
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
