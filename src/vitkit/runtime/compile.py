"""torch.compile and the attention path for training, chosen from measurements (docs: Speed)."""
from __future__ import annotations

import shutil
from typing import Callable

import torch
import torch.nn as nn

from ..model.vit import set_attention
from .precision import cpu_has_amx


def has_cxx_compiler() -> bool:
    """Whether Inductor can build its CPU kernels (it needs a C++ compiler on PATH)."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def training_attention(device: torch.device, precision: str, compiled: bool = False) -> str:
    """The attention implementation for a training step. PyTorch's fused CPU attention is slow in bf16 *backward*
    (60% of a bf16 step for a 28 px / patch 4 / width 128 ViT); the exact path (two matmuls and a softmax) made the
    whole step 2.3x faster there. Compiled in fp32 on a CPU the exact path, fused by Inductor, was 2-3% faster than
    SDPA too (1.25 vs 1.22x and 1.19 vs 1.17x a plain loop, benchmarks/train_fp32_ab.py); eager fp32 keeps SDPA
    (the exact path was slower there). Everywhere else SDPA."""
    return "exact" if device.type == "cpu" and (precision == "bf16" or compiled) else "sdpa"


def configure_for_training(model: nn.Module, device: torch.device, precision: str, compiled: bool = False) -> None:
    """Set ``model``'s attention implementation for a training step on ``device`` in ``precision`` (``compiled``:
    the step goes through torch.compile). On a CPU the convolution weights go channels-last, the layout in which
    oneDNN runs a hybrid's small conv stem fastest (PatchEmbed puts its activations there; Inductor does the same
    when compiling): 1.15x the fp32 eager step of the 5-minute Fashion-MNIST model (benchmarks/train_fp32_ab.py)."""
    set_attention(model, training_attention(device, precision, compiled))
    if device.type == "cpu":
        model.to(memory_format=torch.channels_last)  # moves only 4-D tensors: conv weights, the patch embedding's E


SHORT_BUDGET_MIN = 3.0  # below this a cold compile (~30-40 s on 2 cores) eats more of the budget than it gives back


def cpu_is_avx2_only() -> bool:
    """Whether PyTorch's CPU kernels run with AVX2 at most here: an x86 CPU without AVX-512 (its own dispatch check)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def should_compile(setting: bool | str, device: torch.device, precision: str,
                   time_limit: float | None) -> tuple[bool, str]:
    """``compile: auto`` decided for this device, precision and budget, and why (for the run log); True/False as
    given. Measured on 2-core CPUs (docs: Speed, results/train-throughput-cpu.csv): compiled bf16 steps ran 1.2x
    faster on a Xeon with AMX (Fashion-MNIST ViT, 2,000 -> 2,400 img/s) but 0.88-1.00x on an AMD EPYC with
    AVX512-BF16 and no AMX. Compiled fp32 steps with the exact attention path (which Inductor fuses) ran 1.17x the
    eager trainer for the Fashion-MNIST recipe's 5-minute model and 1.28x a plain loop (30-minute model); a
    5-minute run gained more from the extra epoch than its ~30 s cold compile cost (91.26% against 90.92/90.93%
    eager). So fp32 compiles under a ``--time-limit`` of ``SHORT_BUDGET_MIN`` minutes or more; without a budget
    the run's length is unknown (a few epochs of a small model finish before the compile would), so it stays eager
    unless asked. With AVX2 only (no AVX-512) compiled fp32 steps ran no faster than the eager trainer's (0.96x
    for the 30-minute Fashion-MNIST model and 0.91x for the CIFAR-10 recipe at one thread, 0.95-1.04x at two;
    benchmarks/train_fp32_ab.py run as AVX2, results/train-fp32-ab.csv) and compiling cost ~23 s of a 5-minute
    run: fp32 stays eager there. GPUs are compiled without a
    measurement of our own."""
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"compile must be true, false or auto, got {setting!r}")
    if setting != "auto":
        return bool(setting), f"torch.compile {'on' if setting else 'off'} (as configured)"
    if device.type == "cpu":
        if not has_cxx_compiler():
            return False, "compile auto -> off: no C++ compiler for Inductor's CPU kernels"
        if precision == "bf16" and not cpu_has_amx():
            return False, ("compile auto -> off: compiled bf16 steps ran no faster on a CPU without AMX where "
                           "measured (docs: Speed) and compiling costs 20-40 s; --compile to compile anyway")
        if precision != "bf16" and cpu_is_avx2_only():
            return False, (f"compile auto -> off: compiled {precision} steps ran no faster than eager ones on a CPU "
                           "without AVX-512 where measured (docs: Speed) and compiling costs 20-40 s; --compile to "
                           "compile anyway")
        if precision != "bf16" and time_limit is None:
            return False, (f"compile auto -> off: {precision} without a --time-limit (compiling costs 20-40 s, "
                           "which a short run does not win back); --compile to compile anyway")
    if time_limit is not None and time_limit < SHORT_BUDGET_MIN:
        return False, (f"compile auto -> off: a {time_limit:g}-minute budget is too short to win back ~35 s of "
                       "compiling")
    if device.type != "cpu":
        return True, f"compile auto -> on ({precision} on {device.type})"
    what = "a CPU with AMX" if precision == "bf16" else f"a {time_limit:g}-minute budget"
    return True, f"compile auto -> on ({precision} on {what})"


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
