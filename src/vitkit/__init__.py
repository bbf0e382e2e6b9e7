"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", and what it takes to use one.

Every name here is imported on first use (``vitkit.create_model``, ``vitkit.interop``, ``vitkit.training``, ...), so
``import vitkit`` is quick and ``vitkit --help`` imports no torch.
"""
import time as _time
from typing import Any

_IMPORT_TIME = _time.time()  # before torch is imported: see cli.main.process_start_time
__version__ = "0.1.0"

from ._lazy import lazy_exports  # noqa: E402

SUBPACKAGES = ("bench", "cli", "data", "inspect", "interop", "model", "reproduce", "runtime", "serving", "training")
# name -> the module it comes from: the model API, and public functions of a subpackage offered at the top level too
EXPORTS = {**{name: ".model" for name in ("PRESETS", "ViTConfig", "VisionTransformer", "flops_per_image",
                                          "from_pretrained", "record_attention", "resample_pos_embed",
                                          "save_pretrained", "set_attention")},
           "FeatureExtractor": ".model.backbone", "NaFlexBatch": ".model.naflex",
           "optimize_for_inference": ".runtime", "InferenceModel": ".runtime", "load": ".interop",
           "data_config": ".data", "transforms": ".data", "Trainer": ".training", "TrainConfig": ".training"}


def create_model(name: str, pretrained: Any = False, features_only: bool = False,
                 out_indices: int | list[int] = 3, **overrides: Any) -> Any:
    """A preset (``vit_base_patch16_224``), or pretrained weights: ``pretrained=True`` with a registered name
    (``vit_base_patch16_224.augreg2_in21k_ft_in1k``, ``google/vit-base-patch16-224``), or ``pretrained=`` a Hub id,
    URL or local path. See ``vitkit.interop.pretrained.create_model``.

    ``features_only=True`` (as timm's): a backbone whose forward gives the feature maps (B, D, h, w) of the blocks
    ``out_indices`` (an int: the last n; a list: those blocks), the model pruned after the deepest of them."""
    from .model import PRESETS  # (imported on first use: see the module's docstring)
    from .model.backbone import FeatureExtractor  # (the same)

    if not pretrained and name in PRESETS:
        from .model.registry import create_model as create_preset  # (the same)

        model = create_preset(name, **overrides)
    else:
        from .interop.pretrained import create_model as create  # downloads and converters load on first use

        model = create(name, pretrained, **overrides)
    if features_only:
        return FeatureExtractor(model, out_indices)
    return model


def list_models(pattern: str = "", pretrained: bool = False) -> list[str]:
    """Preset names, or with ``pretrained=True`` the registered weights (containing ``pattern``)."""
    if not pretrained:
        from .model.registry import list_models as list_presets  # (imported on first use: the module's docstring)

        return list_presets(pattern)
    from .interop.registry import list_pretrained  # the registry is data, read on first use

    return [e.name for e in list_pretrained(pattern)]


__getattr__, __dir__ = lazy_exports(__name__, {**EXPORTS, **{p: f".{p}" for p in SUBPACKAGES}}, globals())


__all__ = ["PRESETS", "InferenceModel", "NaFlexBatch", "TrainConfig", "Trainer", "ViTConfig", "VisionTransformer",
           "create_model",
           "data_config", "transforms", "flops_per_image", "from_pretrained", "list_models", "load",
           "optimize_for_inference", "record_attention",
           "resample_pos_embed", "save_pretrained", "set_attention", "__version__"]
