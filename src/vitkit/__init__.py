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

__version__ = "0.1.0"


def optimize_for_inference(model, dtype=None):  # type: ignore[no-untyped-def]
    """The model prepared for the fastest inference on its device (see ``vitkit.speed``)."""
    from .speed import optimize_for_inference as _opt

    return _opt(model, dtype) if dtype is not None else _opt(model)


__all__ = ["PRESETS", "ViTConfig", "VisionTransformer", "create_model", "flops_per_image", "from_pretrained",
           "list_models", "optimize_for_inference", "resample_pos_embed", "save_pretrained", "__version__"]
