"""Old home of the speed helpers, kept so existing imports work: everything here now lives in ``vitkit.runtime``."""
from __future__ import annotations

import torch.nn as nn

from .model.vit import set_attention
from .runtime import (InferenceModel, compile_for_training, configure_for_training, cpu_has_native_bf16,
                      has_cxx_compiler, optimize_for_inference, precision_note, resolve_precision,
                      use_cpu_attention_kernel)


def set_fused_attention(model: nn.Module, fused: bool) -> None:
    """Old spelling of ``set_attention(model, "sdpa" if fused else "exact")``."""
    set_attention(model, "sdpa" if fused else "exact")


__all__ = ["InferenceModel", "compile_for_training", "configure_for_training", "cpu_has_native_bf16",
           "has_cxx_compiler", "optimize_for_inference", "precision_note", "resolve_precision", "set_fused_attention",
           "use_cpu_attention_kernel"]
