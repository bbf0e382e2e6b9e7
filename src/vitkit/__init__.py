"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", and what it takes to use one.

The model API is imported with the package; the rest (``vitkit.interop``, ``vitkit.inspect``, ``vitkit.runtime``,
``vitkit.training``, ...) is imported on first use, so ``import vitkit`` stays quick.
"""
import importlib
import time as _time
from typing import Any

_IMPORT_TIME = _time.time()  # before torch is imported: see cli.main.process_start_time
from .model import (  # noqa: E402
    PRESETS,
    ViTConfig,
    VisionTransformer,
    create_model,
    flops_per_image,
    from_pretrained,
    list_models,
    record_attention,
    resample_pos_embed,
    save_pretrained,
    set_attention,
)

__version__ = "0.1.0"

SUBPACKAGES = ("bench", "cli", "data", "inspect", "interop", "kernels", "model", "runtime", "serving", "speed",
               "training")
# public functions of a subpackage, offered at the top level too: name -> module
LAZY = {"optimize_for_inference": "runtime", "InferenceModel": "runtime", "load": "interop",
        "Trainer": "training", "TrainConfig": "training"}


def __getattr__(name: str) -> Any:
    if name in SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in LAZY:
        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vitkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SUBPACKAGES, *LAZY])


__all__ = ["PRESETS", "InferenceModel", "TrainConfig", "Trainer", "ViTConfig", "VisionTransformer", "create_model",
           "flops_per_image", "from_pretrained", "list_models", "load", "optimize_for_inference", "record_attention",
           "resample_pos_embed", "save_pretrained", "set_attention", "__version__"]
