"""Every speed trick in one place, chosen from measurements on the device at hand (see README, Speed).

Measured on this project's 2-core AVX-512/AMX CPU (benchmarks/train_throughput.py, vitkit bench):
- PyTorch's fused CPU attention (SDPA flash kernel) is slow in bf16 *backward*: 60% of a bf16 training step for a
  28 px / patch 4 / width 128 ViT. The exact path (two bf16 matmuls on AMX and a softmax) is 2.3x faster for the
  whole step, so on CPU with bf16 we train with the exact path.
- For inference the fused kernel is the faster one (ViT-B/16, batch 16, bf16 weights: 41 vs 36 img/s), so
  inference keeps it.
- bf16 weights (not autocast) for inference avoid re-casting every weight on every call (ViT-B/16 batch 16:
  41 vs 32 img/s).
- On CPUs with AMX, vitkit's own attention kernel (vitkit/kernels, KernelAttention below) beats the fused SDPA
  kernel for inference: 1.6x for the attention alone, +13% for the compiled ViT-B/16 batch 16 (53.8 vs 47.7 img/s).
- All of the above is bf16 on a CPU that computes in bf16 (AMX, AVX512-BF16). On a 2-core AVX-512 Xeon without
  them, bf16 matmuls are emulated (61 vs 305 GFLOP/s fp32), so there inference keeps fp32 weights and the recipes'
  `precision: auto` trains in fp32 (cpu_has_native_bf16, resolve_precision below; README, "On a CPU without native
  bf16").
"""
from __future__ import annotations

import contextlib
import copy
import shutil
from typing import Callable, Iterator

import torch
import torch.nn as nn

from . import kernels
from .model.vit import Attention


def set_fused_attention(model: nn.Module, fused: bool) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = fused


def fused_attention_pays_in_training(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether F.scaled_dot_product_attention beats the exact path for a training step (measured: not for bf16
    on CPU, where its backward is slow)."""
    return not (device.type == "cpu" and dtype == torch.bfloat16)


def configure_for_training(model: nn.Module, device: torch.device, precision: str) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    set_fused_attention(model, fused_attention_pays_in_training(device, dtype))


def has_cxx_compiler() -> bool:
    """Whether Inductor can build its CPU kernels (it needs a C++ compiler on PATH)."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def compile_for_training(model: nn.Module, device: torch.device,
                         log: Callable[[str], None] = print) -> nn.Module:
    """torch.compile for a training step (measured in the trainer: the plain patch-7 Fashion-MNIST ViT 2,000 ->
    2,400 img/s on 2 cores; the first epoch then spends ~30-40 s compiling on a cold start, a few seconds once
    Inductor's cache is warm). On CPU, Inductor needs a
    C++ compiler: without one, training goes on uncompiled instead of failing at the first step."""
    if device.type == "cpu" and not has_cxx_compiler():
        log("torch.compile skipped: no C++ compiler (g++/clang++) on PATH for Inductor's CPU kernels")
        return model
    # Inductor's cpp_wrapper and max-autotune were measured and not taken: 0.98-1.06x and 0.92-0.95x
    # (benchmarks/train_compile_ab.py, round-robin)
    return torch.compile(model)


def optimize_for_inference(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16,
                           compile: bool = False, cpu_kernel: bool | None = None) -> nn.Module:
    """A copy of ``model`` in eval mode for the fastest inference on its device: weights cast to ``dtype``
    (bf16 by default; None keeps fp32; a CPU without native bf16 keeps fp32 too, see cpu_has_native_bf16), fused
    attention, and optionally torch.compile.
    Inputs may be fp32: they are cast on entry.

    ``cpu_kernel``: run attention with vitkit's AMX kernel (vitkit/kernels) where it applies (bf16 on a CPU with
    AMX, a C++ compiler at hand); None (default) uses it when compiling, the mode that already pays a start-up cost
    (building the kernel takes ~22 s once per machine)."""
    device = next(model.parameters()).device
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        dtype = None
    m = copy.deepcopy(model).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    if dtype is not None:
        m = m.to(dtype)
    set_fused_attention(m, True)  # fused SDPA is the faster inference path on every device we measured
    if (compile if cpu_kernel is None else cpu_kernel) and dtype == torch.bfloat16 and device.type == "cpu":
        use_cpu_attention_kernel(m)
    if not compile:
        return _CastInput(m, dtype, torch.inference_mode)
    # The model, not the wrapper, is compiled, and run under no_grad: Dynamo cannot trace under inference_mode.
    # max-autotune lets Inductor choose its own C++ GEMMs (AMX micro-kernels with bias/GELU fused in) where they
    # beat oneDNN, and freezing (read when compiling, hence set around each call) folds the weights in as
    # constants. Measured (benchmarks/inference_compile_ab.py, ViT-B/16 batch 16 bf16, before the attention
    # kernel): 43.8 vs 40.9 img/s eager, torchvision 41.1; without freezing or without max-autotune no gain.
    # Compiling takes ~12-25 s per input shape.
    return _CastInput(torch.compile(m, mode="max-autotune"), dtype, _frozen_no_grad)


class KernelAttention(Attention):
    """Attention whose softmax(q k^T / sqrt(D_h)) v runs in vitkit's AMX kernel (``torch.ops.vitkit.vit_attention``,
    straight from the qkv linear's output); inference only: training and attention maps take Attention's path.
    Measured (benchmarks/inference_compile_ab.py, ViT-B/16, batch 16, compiled): see README, Speed."""

    def forward(self, x: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if need_weights or self.training:
            return super().forward(x, need_weights)
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, D // self.num_heads)
        x = kernels.vit_attention(qkv, self.scale).reshape(B, T, D)
        return self.proj_drop(self.proj(x)), None


def use_cpu_attention_kernel(model: nn.Module) -> int:
    """Swaps every Attention of ``model`` (bf16 weights, on a CPU) whose head size the kernel takes (a multiple of
    16) for KernelAttention, if the kernel can be built and loaded here. Returns how many were swapped."""
    attns = [m for m in model.modules() if type(m) is Attention and (m.qkv.in_features // m.num_heads) % 16 == 0]
    if not attns or not kernels.load():
        return 0
    for m in attns:
        m.__class__ = KernelAttention  # same parameters and buffers: only forward differs
    return len(attns)


@contextlib.contextmanager
def _frozen_no_grad() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    with torch.no_grad(), inductor_config.patch(freezing=True):
        yield


class _CastInput(nn.Module):
    """Casts inputs to the weights' dtype and logits back to fp32; forwards the ViT's other methods."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None,
                 grad_mode: Callable[[], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.model, self.dtype, self.grad_mode = model, dtype, grad_mode

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if self.dtype is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.grad_mode():
            return self.model(self._cast(x)).float()

    def forward_attention(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        with self.grad_mode():
            logits, attns = _uncompiled(self.model).forward_attention(self._cast(x))
            return logits.float(), [a.float() for a in attns]

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return _uncompiled(self.model).config


def _uncompiled(m: nn.Module) -> nn.Module:
    return getattr(m, "_orig_mod", m)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX). Without them oneDNN still runs bf16
    matmuls, converting to fp32 inside: on a 2-core AVX-512 CPU without either (Xeon, hypervisor-masked), a 4096^3
    matmul ran at 61 GFLOP/s in bf16 vs 305 in fp32 (``vitkit bench``'s ceiling line), so bf16 is only a speed trick
    where this is True."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 where the device computes in bf16 natively (a CUDA GPU that supports it, a CPU with
    AVX512-BF16/AMX), else fp32; any other value as given."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"


def precision_note(precision: str, device: torch.device) -> str | None:
    """A warning for bf16 asked for on a CPU that emulates it."""
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return ("note: this CPU has no native bf16 (AVX512-BF16/AMX): bf16 matmuls are emulated, several times slower "
                "than fp32 (5x on a 2-core AVX-512 Xeon); --precision auto or fp32 trains faster")
    return None
