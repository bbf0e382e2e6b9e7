"""Which device a run uses: CUDA when present, then Apple's MPS, else the CPU."""
from __future__ import annotations

import torch


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>``, ``mps`` or ``cpu``, the first this machine has; any other name as given."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)
