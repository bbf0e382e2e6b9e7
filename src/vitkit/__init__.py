"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", and what it takes to use one."""
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
