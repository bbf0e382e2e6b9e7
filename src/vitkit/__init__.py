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
    flops_per_image,
    from_pretrained,
    record_attention,
    resample_pos_embed,
    save_pretrained,
    set_attention,
)

from .model.backbone import FeatureExtractor  # noqa: E402
from .model.naflex import NaFlexBatch  # noqa: E402
from .model.registry import create_model as _create_preset, list_models as _list_presets  # noqa: E402

__version__ = "0.1.0"


def create_model(name: str, pretrained: Any = False, features_only: bool = False,
                 out_indices: int | list[int] = 3, **overrides: Any) -> Any:
    """A preset (``vit_base_patch16_224``), or pretrained weights: ``pretrained=True`` with a registered name
    (``vit_base_patch16_224.augreg2_in21k_ft_in1k``, ``google/vit-base-patch16-224``), or ``pretrained=`` a Hub id,
    URL or local path. See ``vitkit.interop.pretrained.create_model``.

    ``features_only=True`` (as timm's): a backbone whose forward gives the feature maps (B, D, h, w) of the blocks
    ``out_indices`` (an int: the last n; a list: those blocks), the model pruned after the deepest of them."""
    if not pretrained and name in PRESETS:
        model = _create_preset(name, **overrides)
    else:
        from .interop.pretrained import create_model as create  # downloads and converters load on first use

        model = create(name, pretrained, **overrides)
    if features_only:
        return FeatureExtractor(model, out_indices)
    return model


def list_models(pattern: str = "", pretrained: bool = False) -> list[str]:
    """Preset names, or with ``pretrained=True`` the registered weights (containing ``pattern``)."""
    if not pretrained:
        return _list_presets(pattern)
    from .interop.registry import list_pretrained  # the registry is data, read on first use

    return [e.name for e in list_pretrained(pattern)]


SUBPACKAGES = ("bench", "cli", "data", "inspect", "interop", "model", "reproduce", "runtime", "serving", "training")
# public functions of a subpackage, offered at the top level too: name -> module
LAZY = {"optimize_for_inference": "runtime", "InferenceModel": "runtime", "load": "interop",
        "data_config": "data", "transforms": "data",
        "Trainer": "training", "TrainConfig": "training"}


def __getattr__(name: str) -> Any:
    if name in SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in LAZY:
        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vitkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SUBPACKAGES, *LAZY])


__all__ = ["PRESETS", "InferenceModel", "NaFlexBatch", "TrainConfig", "Trainer", "ViTConfig", "VisionTransformer",
           "create_model",
           "data_config", "transforms", "flops_per_image", "from_pretrained", "list_models", "load",
           "optimize_for_inference", "record_attention",
           "resample_pos_embed", "save_pretrained", "set_attention", "__version__"]
