"""Where and how a model runs: device, distributed group, precision, compilation, inference preparation, and
vitkit's CPU attention kernel. Every speed decision lives here, chosen from measurements (docs: Speed)."""
from .compile import compile_for_training, configure_for_training, has_cxx_compiler, training_attention
from .device import resolve_device
from .distributed import destroy_process_group, init_distributed, rank_and_world
from .inference import InferenceModel, optimize_for_inference, use_cpu_attention_kernel
from .precision import (DTYPES, PRECISIONS, autocast_for, cpu_has_native_bf16, dtype_of, has_native_bf16,
                        inference_dtype, precision_note, precision_of, resolve_precision)

__all__ = ["DTYPES", "PRECISIONS", "InferenceModel", "autocast_for", "compile_for_training", "configure_for_training",
           "cpu_has_native_bf16", "destroy_process_group", "dtype_of", "has_cxx_compiler", "has_native_bf16",
           "inference_dtype", "init_distributed", "optimize_for_inference", "precision_note", "precision_of",
           "rank_and_world", "resolve_device", "resolve_precision", "training_attention", "use_cpu_attention_kernel"]
