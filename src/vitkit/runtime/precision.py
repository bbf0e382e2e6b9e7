"""Precision names and the autocast context, for training, evaluation, inference and bench.

Which precision is *fast* on a device is never read from its flags: the planner times it (training/plan.py for a
training step, runtime/inference.py for a forward pass; docs: Speed).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
# Training also takes tf32 on CUDA: fp32 weights and activations, the matmuls on TF32 tensor cores (Ampere and later)
TRAIN_PRECISIONS = (*PRECISIONS, "tf32")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(precision: str) -> torch.dtype:
    """``"bf16"`` -> torch.bfloat16 (and fp16, fp32); ``auto`` must be decided first."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {tuple(DTYPES)}, got {precision!r}")
    return DTYPES[precision]


def precision_of(dtype: torch.dtype | None) -> str:
    """The inverse of dtype_of; None (no cast) is fp32."""
    return next((p for p, d in DTYPES.items() if d == dtype), "fp32") if dtype is not None else "fp32"


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass: nothing for fp32 and tf32 (see ``matmul_precision``), else
    torch.autocast in the precision's dtype."""
    if precision in ("fp32", "tf32"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype_of(precision))


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """For ``tf32``: fp32 matmuls on TF32 tensor cores (``torch.set_float32_matmul_precision("high")``) for the
    forward *and* backward passes inside; the previous setting afterwards. Nothing for any other precision."""
    if precision != "tf32":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
