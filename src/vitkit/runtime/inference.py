"""``optimize_for_inference``: a model prepared for the fastest inference on its device (docs: Speed).

- bf16 weights (not autocast) where the device computes in bf16 natively: no re-cast of every weight on every call
  (ViT-B/16 batch 16 on an AMX CPU: 41 vs 32 img/s). A CPU without native bf16 keeps fp32 (precision.py).
- PyTorch's fused attention (SDPA): the faster inference path on every device measured.
- Optionally torch.compile with Inductor's max-autotune and freezing, and on CPUs with AMX vitkit's own attention
  kernel (kernels/), 1.6x SDPA for the attention alone.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..model.vit import ATTENTION_KERNELS, register_attention, set_attention
from . import kernels
from .precision import inference_dtype


def use_cpu_attention_kernel(model: nn.Module) -> int:
    """Set every Attention of ``model`` whose head size the AMX kernel takes (a multiple of 16) to ``"cpu_kernel"``,
    if the kernel can be built and loaded here. Returns how many were set (0 where it cannot run)."""
    if not kernels.load():
        return 0
    if "cpu_kernel" not in ATTENTION_KERNELS:
        register_attention("cpu_kernel", kernels.vit_attention, kernels.takes_head_size)
    return set_attention(model, "cpu_kernel")


def optimize_for_inference(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16,
                           compile: bool = False, cpu_kernel: bool | None = None) -> "InferenceModel":
    """A copy of ``model`` in eval mode for the fastest inference on its device: weights cast to ``dtype``
    (bf16 by default; None keeps fp32; a CPU without native bf16 keeps fp32 too), fused attention, and optionally
    torch.compile. Inputs may be fp32: they are cast on entry; logits come back in fp32.

    ``cpu_kernel``: run attention with vitkit's AMX kernel where it applies (bf16 on a CPU with AMX, a C++ compiler
    at hand); None (default) uses it when compiling, the mode that already pays a start-up cost (building the
    kernel takes ~22 s once per machine)."""
    device = next(model.parameters()).device
    dtype = inference_dtype(dtype, device)
    m = copy.deepcopy(model).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    if dtype is not None:
        m = m.to(dtype)
    set_attention(m, "sdpa")
    if (compile if cpu_kernel is None else cpu_kernel) and dtype == torch.bfloat16 and device.type == "cpu":
        use_cpu_attention_kernel(m)
    if not compile:
        return InferenceModel(m, dtype)
    # max-autotune lets Inductor choose its own C++ GEMMs (AMX micro-kernels with bias/GELU fused in) where they
    # beat oneDNN, and freezing folds the weights in as constants: ViT-B/16 batch 16 bf16, 43.8 vs 40.9 img/s eager;
    # without either, no gain. Compiling takes ~12-25 s per input shape.
    return InferenceModel(m, dtype, compiled=torch.compile(m, mode="max-autotune"))


class InferenceModel(nn.Module):
    """What ``optimize_for_inference`` returns: the prepared ViT (``.model``, in ``.dtype``; None = fp32) and, when
    compiled, its compiled forward. Casts inputs to the weights' dtype and logits back to fp32, without autograd.
    ``forward_attention`` always runs the uncompiled model (the exact path records the attention maps)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, compiled: Callable | None = None) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype
        self._compiled = compiled  # not a submodule: state_dict and modules() see the model once

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.model.config

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if self.dtype is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._compiled is None:
            with torch.inference_mode():
                return self.model(self._cast(x)).float()
        with _frozen_no_grad():  # Dynamo cannot trace under inference_mode
            return self._compiled(self._cast(x)).float()

    def forward_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.inference_mode():
            logits, attns = self.model.forward_attention(self._cast(x))
        return logits.float(), [a.float() for a in attns]


@contextlib.contextmanager
def _frozen_no_grad() -> Iterator[None]:
    import torch._inductor.config as inductor_config  # Inductor's config is read when compiling: set per call

    with torch.no_grad(), inductor_config.patch(freezing=True):
        yield
