"""Weights in and out: timm, Hugging Face and the official JAX checkpoints.

Converters are pure functions from one state dict to another (``timm_to_vitkit``, ``hf_to_vitkit``,
``jax_to_vitkit``, ``vitkit_to_hf``); ``from_*`` / ``to_*`` wrap them with config inference; ``load`` reads any
supported file or folder.
"""
from .files import load_state_file
from .hf import from_hf, hf_to_vitkit, to_hf, vitkit_to_hf
from .jax import jax_to_vitkit, to_jax_npz
from .load import detect_format, from_jax_npz, load
from .timm import from_timm, timm_kwargs, timm_model, timm_to_vitkit, to_timm

__all__ = ["from_timm", "to_timm", "from_hf", "to_hf", "from_jax_npz", "to_jax_npz", "load", "detect_format",
           "load_state_file", "timm_to_vitkit", "hf_to_vitkit", "vitkit_to_hf",
           "jax_to_vitkit", "timm_kwargs", "timm_model"]
