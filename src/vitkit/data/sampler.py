"""Which images each process trains on, per epoch."""
from __future__ import annotations

import torch


def check_batches(name: str, n: int, batch_size: int, grad_accum: int = 1, world: int = 1) -> None:
    """Refuse, from the counts alone, ``n`` training images that make no optimizer step an epoch: fewer than one
    global batch, or fewer whole batches than one step accumulates (the loop would never end). The trainer and the
    sampler ask it, and the planner before it measures memory (training/plan.py, _batches_make_a_step)."""
    if n < batch_size * world:
        raise ValueError(f"{name}: {n:,} training images are fewer than one global batch of {batch_size * world:,} "
                         f"({world} process{'es' * (world > 1)} x --batch-size {batch_size:,}); lower --batch-size")
    batches = n // (batch_size * world)  # whole batches an epoch, per process
    if batches < grad_accum:
        over = f" over {world} processes" if world > 1 else ""
        per_process = n // world
        fits = per_process // grad_accum  # the largest batch that keeps --grad-accum (0: none does)
        advice = (f"lower --batch-size (at most {fits}) or --grad-accum" if fits >= 1 else
                  f"lower --grad-accum (at most {max(1, batches)} at batch {batch_size}; even batch 1 makes "
                  f"only {per_process} batches, fewer than {grad_accum})")
        raise ValueError(f"{name}: {n} training images{over} make {batches} whole batch{'es' * (batches != 1)} of "
                         f"{batch_size} an epoch, fewer than the {grad_accum} one optimiser step accumulates: "
                         f"{advice}")


class GlobalBatchSampler:
    """Shuffles once per epoch (seeded by ``seed`` and ``set_epoch``) and cuts the permutation into global batches
    of ``world * batch_size``; rank ``r`` takes the ``r``-th slice of each. So N processes with batch B see, step by
    step, exactly the images one process with batch N*B sees: DDP's averaged gradient is the same gradient.
    The incomplete last global batch is dropped."""

    def __init__(self, n: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = 0) -> None:
        check_batches("the training split", n, batch_size, 1, world)
        self.n, self.batch_size, self.rank, self.world, self.seed, self.epoch = n, batch_size, rank, world, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def steps(self) -> int:
        return self.n // (self.batch_size * self.world)

    def __len__(self) -> int:
        return self.steps * self.batch_size

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        perm = torch.randperm(self.n, generator=g)
        gb = self.batch_size * self.world
        mine = perm[: self.steps * gb].view(self.steps, self.world, self.batch_size)[:, self.rank]
        return iter(mine.reshape(-1).tolist())
