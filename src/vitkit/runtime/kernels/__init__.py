"""vitkit's one hand-written kernel: multi-head attention for bf16 inference on CPUs with AMX (cpu_attention.cpp).

It is built from source on first use with torch.utils.cpp_extension (a C++ compiler and ninja; ~21 s once per
machine, then loaded from torch's extension cache in ~0.05 s) and registered as the operator
``torch.ops.vitkit.vit_attention``, which torch.compile treats as one opaque call. Where it cannot be built or the
CPU lacks AMX, ``load()`` returns False and the model keeps PyTorch's fused attention. ``VITKIT_CPU_KERNELS=0``
turns it off.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

from ..compile import has_cxx_compiler

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpu_flags() -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    try:
        return next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_supported() -> bool:
    """Linux on an x86 CPU with AVX-512 BF16 and AMX (read from /proc/cpuinfo)."""
    flags = _cpu_flags()
    return all(f in flags for f in _CPU_FLAGS)


def _build_name() -> str:
    """The extension's name in torch's cache, one per CPU feature set: it is built with -march=native, so a cache
    shared between machines never hands one CPU another's build."""
    return "vitkit_cpu_attention_" + hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:10]


@functools.cache
def load(verbose: bool = False) -> bool:
    """Build (once) and load the kernel; True when ``torch.ops.vitkit.vit_attention`` is ready to use."""
    if os.environ.get("VITKIT_CPU_KERNELS", "1") == "0" or not cpu_supported():
        return False
    from torch.utils import cpp_extension  # only here: its import warns "No CUDA runtime" on CPU-only machines

    if not (has_cxx_compiler() and cpp_extension.is_ninja_available()):
        return False
    try:
        cpp_extension.load(
            name=_build_name(), sources=[str(SOURCE)], is_python_module=False, verbose=verbose,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
            extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - a failed build must not stop inference: PyTorch's attention is used
        warnings.warn(f"vitkit: could not build the CPU attention kernel {SOURCE} ({type(e).__name__}: {e}); "
                      "using PyTorch's attention", stacklevel=2)
        return False

    init_amx = getattr(torch._C._cpu, "_init_amx", None)  # Linux: ask the kernel for AMX's tile state
    if init_amx is not None and not init_amx():
        return False

    @torch.library.register_fake("vitkit::vit_attention")
    def _(qkv: torch.Tensor, scale: float) -> torch.Tensor:
        B, T, _, H, D = qkv.shape
        return qkv.new_empty(B, T, H, D)

    return True


def takes_head_size(head_size: int) -> bool:
    """The head sizes the kernel works on: multiples of 16 (cpu_attention.cpp refuses any other)."""
    return head_size % 16 == 0


def vit_attention(qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, from the qkv linear's output (B, T, 3, H, D) bf16 to (B, T, H, D)."""
    return torch.ops.vitkit.vit_attention(qkv, scale)
