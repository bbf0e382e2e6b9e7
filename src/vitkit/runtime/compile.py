"""torch.compile for a training step. Whether a run compiles is decided by timing (training/plan.py)."""
from __future__ import annotations

import shutil
from typing import Callable

import torch
import torch.nn as nn


def has_cxx_compiler() -> bool:
    """Whether Inductor can build its CPU kernels (it needs a C++ compiler on PATH)."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def compile_for_training(model: nn.Module, device: torch.device,
                         log: Callable[[str], None] = print, mode: str | None = None) -> nn.Module:
    """torch.compile for a training step (the first epoch then spends ~30-40 s compiling on a cold start, a few
    seconds once Inductor's cache is warm). On CPU, Inductor needs a C++ compiler: without one, training goes on
    uncompiled instead of failing at the first step. Inductor's cpp_wrapper and max-autotune did not pay for training
    (0.98-1.06x and 0.92-0.95x)."""
    if device.type == "cpu" and not has_cxx_compiler():
        log("torch.compile skipped: no C++ compiler (g++/clang++) on PATH for Inductor's CPU kernels")
        return model
    return torch.compile(model, mode=mode)  # mode: None (Inductor's default), "reduce-overhead" (CUDA graphs)
