"""Random draws where their generator lives: a GPU's generator draws on the GPU, with no copy from the host and no
wait for it (a CPU-drawn crop offset or mask copied over costs the training step a blocking copy)."""
from __future__ import annotations

from typing import Callable

import torch


def draw(fn: Callable[..., torch.Tensor], *args, generator: torch.Generator | None, on: torch.device
         ) -> torch.Tensor:
    """``fn(*args)`` (``torch.rand``, ``torch.randint``, ...) drawn from ``generator`` on its device, then moved to
    ``on`` (nothing to move when they are the same). Without a generator: torch's global one, on the CPU."""
    where = generator.device if generator is not None else torch.device("cpu")
    return fn(*args, generator=generator, device=where).to(on, non_blocking=True)
