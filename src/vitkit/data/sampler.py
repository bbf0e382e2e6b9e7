"""Which images each process trains on, per epoch."""
from __future__ import annotations

import torch


class GlobalBatchSampler:
    """Shuffles once per epoch (seeded by ``seed`` and ``set_epoch``) and cuts the permutation into global batches
    of ``world * batch_size``; rank ``r`` takes the ``r``-th slice of each. So N processes with batch B see, step by
    step, exactly the images one process with batch N*B sees: DDP's averaged gradient is the same gradient.
    The incomplete last global batch is dropped."""

    def __init__(self, n: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = 0) -> None:
        if n < batch_size * world:
            raise ValueError(f"{n} training images are fewer than one global batch ({world} x {batch_size}); "
                             "lower --batch-size")
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
