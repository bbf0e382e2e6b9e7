"""Images from files -> the normalised tensors a checkpoint expects (predict, serve, inspect)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..model.config import to_2tuple
from ..model.serialization import DEFAULT_PREPROCESSING, fit_channels
from .augment import BatchAugment
from .folder import IMAGE_EXTENSIONS, is_junk
from .images import BadImageError, open_image, to_array


def normalizer(preprocessing: dict[str, Any], config: Any) -> BatchAugment:
    """The evaluation half of the training augmentation: resize to the model's size and standardise."""
    return BatchAugment(preprocessing["mean"], preprocessing["std"], to_2tuple(config.img_size), config.num_classes)


def images_to_tensor(images: list[Image.Image], preprocessing: dict[str, Any], config: Any) -> torch.Tensor:
    size = to_2tuple(config.img_size)
    arrays = np.stack([to_array(im, config.in_chans, size) for im in images])
    return normalizer(preprocessing, config).normalize(torch.from_numpy(arrays))


def image_files(paths: list[str]) -> list[str]:
    """``paths`` with every folder replaced by the image files in it (sorted; hidden and system files left out)."""
    out = []
    for p in paths:
        if Path(p).is_dir():
            found = sorted(str(f) for f in Path(p).iterdir()
                           if f.suffix.lower() in IMAGE_EXTENSIONS and not is_junk(f.name) and f.is_file())
            if not found:
                raise ValueError(f"{p} is a folder with no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            out += found
        else:
            out.append(p)
    return out


def load_images(paths: list[str], max_pixels: int | None = None) -> list[Image.Image]:
    out = []
    for p in paths:
        try:
            data = Path(p).read_bytes()
        except OSError as e:
            raise BadImageError(p, f"cannot read it ({e.strerror or e})") from None
        out.append(open_image(data, p, max_pixels))
    return out


def preprocessing_of(model: Any) -> dict[str, Any]:
    """A loaded model's preprocessing (mean, std, class names), with defaults and the mean/std fitted to its
    channel count (weights imported from elsewhere carry 3-channel defaults)."""
    return fit_channels({**DEFAULT_PREPROCESSING, **(getattr(model, "preprocessing", None) or {})},
                        model.config.in_chans)
