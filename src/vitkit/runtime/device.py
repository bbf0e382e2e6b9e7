"""Which device a run uses: CUDA when present, then Apple's MPS, else the CPU."""
from __future__ import annotations

import torch


def available_devices() -> list[str]:
    """The ``--device`` values that work on this machine."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names += ["cuda"] + [f"cuda:{i}" for i in range(n)]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>``, ``mps`` or ``cpu``, the first this machine has; any other name as given,
    once checked to exist here: a CUDA or MPS device this machine lacks is a ValueError naming what works (torch's
    own error comes later, mid-run, as a traceback: "Found no NVIDIA driver on your system")."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    works = ", ".join(available_devices())
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {name!r} is not a device name; the values that work here: {works}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device here (torch {torch.__version__}, "
                             f"{'a CPU-only build' if torch.version.cuda is None else 'no NVIDIA driver or GPU'}); "
                             f"the values that work here: {works}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"the values that work here: {works}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: no Apple MPS device here; the values that work here: {works}")
    elif device.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"--device {name}: vitkit runs on cpu, cuda or mps; the values that work here: {works}")
    return device
