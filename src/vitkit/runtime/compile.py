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


class CompileTrial:
    """A module's compiled forward, tried on a run's own training steps (training/tune.py): where Inductor cannot
    build it, the module's eager forward from then on, and ``failed`` is told why (the run goes on: the step is
    trained eagerly). Attributes are the module's own, as torch.compile's wrapper gives them."""

    def __init__(self, module: nn.Module, failed: Callable[[BaseException], None]) -> None:
        self.module, self.compiled, self.failed = module, torch.compile(module), failed
        self.error: BaseException | None = None

    def __call__(self, *args, **kwargs):
        if self.error is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a backend's failure of any kind: the eager step instead
                self.error = e
                self.failed(e)
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "CompileTrial":
        self.module.train(mode)
        return self

    def __getattr__(self, name: str):
        return getattr(self.module, name)
