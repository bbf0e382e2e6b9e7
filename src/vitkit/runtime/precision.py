"""Precision, decided in one place for training, evaluation, inference and bench.

bf16 is a speed trick only where the hardware multiplies in it (a CUDA GPU that supports it, an x86 CPU with
AVX512-BF16 or AMX). Elsewhere oneDNN still runs bf16 matmuls by converting to fp32 inside, several times slower
than fp32 itself (docs: Speed), so ``auto`` means fp32 there.
"""
from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(precision: str) -> torch.dtype:
    """``"bf16"`` -> torch.bfloat16 (and fp16, fp32); ``auto`` must be resolved first (resolve_precision)."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {tuple(DTYPES)}, got {precision!r}")
    return DTYPES[precision]


def precision_of(dtype: torch.dtype | None) -> str:
    """The inverse of dtype_of; None (no cast) is fp32."""
    return next((p for p, d in DTYPES.items() if d == dtype), "fp32") if dtype is not None else "fp32"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX), as PyTorch's own CPU check sees it."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), as PyTorch's own CPU check sees it."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def has_native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively (a CPU with AVX512-BF16/AMX, a CUDA GPU that supports it)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 where ``device`` computes in bf16 natively, else fp32; any other value as given."""
    if precision != "auto":
        return precision
    return "bf16" if has_native_bf16(device) else "fp32"


def emulates_bf16(device: torch.device) -> bool:
    """Whether ``device`` is a CPU that runs bf16 matmuls by converting to fp32 (slower than fp32 itself)."""
    return device.type == "cpu" and not cpu_has_native_bf16()


def inference_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The weights' dtype for inference: bf16 asked for on a CPU that emulates it stays fp32 (None), which is faster."""
    return None if dtype == torch.bfloat16 and emulates_bf16(device) else dtype


def precision_note(precision: str, device: torch.device) -> str | None:
    """A warning for bf16 asked for on a CPU that emulates it."""
    if precision == "bf16" and emulates_bf16(device):
        return ("note: this CPU has no native bf16 (AVX512-BF16/AMX): bf16 matmuls are emulated, several times slower "
                "than fp32 (5x on a 2-core AVX-512 Xeon); --precision auto or fp32 trains faster")
    return None


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass: nothing for fp32, else torch.autocast in the precision's dtype."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype_of(precision))
