"""Old home of vitkit's CPU attention kernel, kept so existing imports work: it lives in ``vitkit.runtime.kernels``."""
from .runtime.kernels import SOURCE, cpu_supported, load, vit_attention

__all__ = ["SOURCE", "cpu_supported", "load", "vit_attention"]
