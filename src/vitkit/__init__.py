"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", and what it takes to use one."""
import time as _time

_IMPORT_TIME = _time.time()  # before torch is imported: see cli.main.process_start_time
from .model import (
    PRESETS,
    ViTConfig,
    VisionTransformer,
    create_model,
    flops_per_image,
    from_pretrained,
    list_models,
    resample_pos_embed,
    save_pretrained,
)

from .speed import optimize_for_inference

__version__ = "0.1.0"


__all__ = ["PRESETS", "ViTConfig", "VisionTransformer", "create_model", "flops_per_image", "from_pretrained",
           "list_models", "optimize_for_inference", "resample_pos_embed", "save_pretrained", "__version__"]
