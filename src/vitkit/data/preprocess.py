"""Images from files -> the normalised tensors a checkpoint expects (predict, serve, inspect)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from ..model import naflex as nf
from ..model.config import to_2tuple
from ..model.serialization import DEFAULT_PREPROCESSING, fit_channels
from .augment import BatchAugment
from .folder import IMAGE_EXTENSIONS, is_junk
from .images import (MAX_PIXELS, BadImageError, crop_decode_side, crop_spec, decode_within, open_image,
                     resize_and_crop, to_array, to_mode)
from .naflex import decode_side as naflex_decode_side, naflex_patches


def normalizer(preprocessing: dict[str, Any], config: Any) -> BatchAugment:
    """The evaluation half of the training augmentation: resize to the model's size and standardise."""
    return BatchAugment(preprocessing["mean"], preprocessing["std"], to_2tuple(config.img_size), config.num_classes)


def data_config(model: Any) -> dict[str, Any]:
    """How images must be prepared for ``model``, in timm's ``resolve_data_config`` terms: input_size (C, H, W),
    interpolation, crop_pct, crop_mode, mean, std (pretrained weights carry their publisher's values)."""
    return _data_config(preprocessing_of(model), model.config)


def _data_config(pre: dict[str, Any], config: Any) -> dict[str, Any]:
    return {"input_size": (config.in_chans, *to_2tuple(config.img_size)),
            "interpolation": pre.get("interpolation", "bicubic"), "crop_pct": pre.get("crop_pct", 1.0),
            "crop_mode": pre.get("crop_mode", "squash"), "mean": tuple(pre["mean"]), "std": tuple(pre["std"])}


def transforms(model: Any) -> Callable[[Image.Image], torch.Tensor]:
    """The evaluation transform of ``model`` (a PIL image -> a normalised (C, H, W) tensor): resize the short side
    to size / crop_pct and crop the centre (or, ``crop_mode="squash"``, resize both sides), as timm's
    ``create_transform`` does for the same data config."""
    return eval_transform(preprocessing_of(model), model.config)


def eval_transform(pre: dict[str, Any], config: Any) -> Callable[[Image.Image], torch.Tensor]:
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    cfg = _data_config(pre, config)
    chans, h, w = cfg["input_size"]
    geometry = resize_and_crop({"img_size": [h, w], **{k: cfg[k] for k in ("crop_pct", "crop_mode", "interpolation")}},
                               chans)
    return v2.Compose([geometry, v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(list(cfg["mean"]), list(cfg["std"]))])


def images_to_tensor(images: list[Image.Image], preprocessing: dict[str, Any], config: Any, naflex: bool = False
                     ) -> torch.Tensor:
    """The model's input batch: resized (or cropped) to its size and standardised. With ``naflex`` and a model
    trained on NaFlex batches (``naflex_max_tokens`` in its preprocessing), a NaFlex batch of the images at their own
    aspect ratios, as it trained."""
    if naflex and preprocessing.get("naflex_max_tokens"):
        n, patch = preprocessing["naflex_max_tokens"], config.patch_size
        batch = nf.collate([naflex_patches(im, config.in_chans, patch, n) for im in images], n)
        return normalizer(preprocessing, config)(batch, torch.empty(0), train=False)[0]
    if "crop_pct" in preprocessing:  # weights with their publisher's evaluation transform
        tf = eval_transform(preprocessing, config)
        return torch.stack([tf(im) for im in images])
    size = to_2tuple(config.img_size)
    arrays = np.stack([to_array(im, config.in_chans, size) for im in images])
    return normalizer(preprocessing, config).normalize(torch.from_numpy(arrays))


def model_view(image: Image.Image, preprocessing: dict[str, Any], config: Any) -> Image.Image:
    """``image`` as the model sees it, before standardising: cropped as its transform crops, or resized to its
    size (what an attention map drawn over the input must be drawn over)."""
    spec = crop_spec(preprocessing, to_2tuple(config.img_size))
    if spec is not None:
        return resize_and_crop(spec, config.in_chans)(image)
    h, w = to_2tuple(config.img_size)
    return to_mode(image, config.in_chans).resize((w, h), Image.BICUBIC)


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


def load_images(paths: list[str], max_pixels: int | None = MAX_PIXELS, max_side: int | None = None
                ) -> list[Image.Image]:
    """The images, decoded (``max_side``: no larger than that on their longer side, a JPEG decoded at a reduced
    scale while it is read)."""
    return [open_image(read_image_file(p), p, max_pixels, max_side) for p in paths]


def read_image_file(path: str) -> bytes:
    """The file's bytes, or one line naming it."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise BadImageError(path, f"cannot read it ({e.strerror or e})") from None


def image_size(path: str) -> tuple[int, int]:
    """An image file's (H, W) as it is shown (EXIF orientation applied), decoding no more than a thumbnail; a file
    that does not decode is one line naming it."""
    return decode_within(read_image_file(path), path, max_side=64)[1]


def decode_side(preprocessing: dict[str, Any], config: Any) -> int:
    """The longer side an image need not exceed when it is decoded for ``config``'s model (``crop_decode_side``);
    for a model trained on NaFlex batches, at least what its training decoded (its budget's size at up to 4:1): a
    photo decoded at the fixed size was then scaled up to its NaFlex size, pixels training never saw."""
    side = crop_decode_side(crop_spec({"crop_pct": 1.0, **preprocessing}, to_2tuple(config.img_size)))
    if preprocessing.get("naflex_max_tokens"):
        side = max(side, naflex_decode_side(config.patch_size, preprocessing["naflex_max_tokens"]))
    return side


def naflex_note(preprocessing: dict[str, Any], config: Any, what: str,
                as_trained: str = "`vitkit predict` and `vitkit eval` run") -> str | None:
    """For a checkpoint trained on NaFlex batches, one line saying that ``what`` runs at the fixed size instead, and
    what runs as it trained."""
    if not preprocessing.get("naflex_max_tokens"):
        return None
    h, w = to_2tuple(config.img_size)
    return (f"this checkpoint trained on NaFlex batches (each photo at its aspect ratio, at most "
            f"{preprocessing['naflex_max_tokens']} patches): {what} at the fixed size {h}x{w} ({as_trained} as it "
            "trained)")


def preprocessing_of(model: Any) -> dict[str, Any]:
    """A loaded model's preprocessing (mean, std, class names), with defaults and the mean/std fitted to its
    channel count (weights imported from elsewhere carry 3-channel defaults)."""
    return fit_channels({**DEFAULT_PREPROCESSING, **(getattr(model, "preprocessing", None) or {})},
                        model.config.in_chans)
