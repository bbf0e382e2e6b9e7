"""torch.compile and the attention path for training, chosen from measurements (docs: Speed)."""
from __future__ import annotations

import shutil
from typing import Callable

import torch
import torch.nn as nn

from ..model.vit import set_attention


def has_cxx_compiler() -> bool:
    """Whether Inductor can build its CPU kernels (it needs a C++ compiler on PATH)."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def training_attention(device: torch.device, precision: str) -> str:
    """The attention implementation for a training step. PyTorch's fused CPU attention is slow in bf16 *backward*
    (60% of a bf16 step for a 28 px / patch 4 / width 128 ViT); the exact path (two matmuls and a softmax) made the
    whole step 2.3x faster there. Everywhere else SDPA."""
    return "exact" if device.type == "cpu" and precision == "bf16" else "sdpa"


def configure_for_training(model: nn.Module, device: torch.device, precision: str) -> None:
    """Set ``model``'s attention implementation for training on ``device`` in ``precision``."""
    set_attention(model, training_attention(device, precision))


def compile_for_training(model: nn.Module, device: torch.device,
                         log: Callable[[str], None] = print) -> nn.Module:
    """torch.compile for a training step (the plain patch-7 Fashion-MNIST ViT: 2,000 -> 2,400 img/s on 2 cores; the
    first epoch then spends ~30-40 s compiling on a cold start, a few seconds once Inductor's cache is warm). On CPU,
    Inductor needs a C++ compiler: without one, training goes on uncompiled instead of failing at the first step.
    Inductor's cpp_wrapper and max-autotune did not pay for training (0.98-1.06x and 0.92-0.95x)."""
    if device.type == "cpu" and not has_cxx_compiler():
        log("torch.compile skipped: no C++ compiler (g++/clang++) on PATH for Inductor's CPU kernels")
        return model
    return torch.compile(model)
