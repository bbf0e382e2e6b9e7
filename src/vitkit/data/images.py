"""Decoding one image file the same way everywhere (training folders, predict, serve)."""
from __future__ import annotations

import io
import math
import re
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
# The most pixels one image may decode to, everywhere (training, predict, serve, eval): a 40-megapixel photo
# decodes; a 12000x12000 PNG of 419 KB (2 GB and 25 s to decode, or a kill under 1 GiB) does not. A JPEG is counted
# at the reduced scale it is decoded at (DCT scaling), so a large photo read for a small model still decodes.
MAX_PIXELS = 40_000_000
DECODE_ERRORS = (OSError, SyntaxError, ValueError, UnidentifiedImageError, Image.DecompressionBombError)


class BadImageError(ValueError):
    """An image file that cannot be decoded; ``path`` names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot decode image {path}: {reason}")
        self.path = path


def too_many_pixels(e: Exception, limit: int | None = MAX_PIXELS) -> str:
    """The reason for PIL's DecompressionBombError (raised at open, far above PIL's own limit): the image's size,
    not "an image PIL cannot read"."""
    found = re.search(r"\((\d+) pixels\)", str(e))
    has = f"{int(found[1]):,} pixels" if found else "too many pixels"
    return f"{has}, more than the limit of {limit or Image.MAX_IMAGE_PIXELS:,} an image may decode to"


def open_image(data: bytes, path: str = "<bytes>", max_pixels: int | None = MAX_PIXELS,
               max_side: int | None = None) -> Image.Image:
    """Decode fully (so truncated files fail here, not later), EXIF orientation applied, first frame only;
    with ``max_side``, no larger than that on its longer side (see decode_within)."""
    return decode_within(data, path, max_pixels, max_side)[0]


def decode_within(data: bytes, path: str = "<bytes>", max_pixels: int | None = MAX_PIXELS,
                  max_side: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """The image (as open_image) and its full size (H, W) after EXIF rotation. With ``max_side`` the image is
    made to fit in max_side x max_side, aspect kept, *while* it is read: a JPEG is decoded at a reduced scale
    (``Image.draft``: DCT scaling, never below the wanted size), anything else shrunk right after decoding. So a
    12-megapixel photo costs its file size and a thumbnail, not 36 MB of pixels."""
    try:
        with warnings.catch_warnings():  # PIL's warning of a large image: the limit below is vitkit's own
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        img.seek(0)
        stored = img.size  # (W, H) as stored, before a reduced-scale decode
        rotated = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientations that swap width and height
        full = (img.width, img.height) if rotated else (img.height, img.width)
        box = fit_within(full, max_side) if max_side else None
        if box is not None and img.format == "JPEG":
            img.draft(img.mode, (box[0], box[1]) if rotated else (box[1], box[0]))  # (W, H) as stored
        if max_pixels is not None and img.width * img.height > max_pixels:  # (as it will decode: after the draft)
            raise BadImageError(path, f"{stored[0]}x{stored[1]} = {stored[0] * stored[1]:,} pixels, more than the "
                                      f"limit of {max_pixels:,} an image may decode to")
        img.load()
        img = ImageOps.exif_transpose(img)
        if box is not None and (img.height, img.width) != box:
            img = _resizable(img).resize((box[1], box[0]), Image.BICUBIC, reducing_gap=2.0)
    except BadImageError:
        raise
    except Image.DecompressionBombError as e:
        raise BadImageError(path, too_many_pixels(e, max_pixels)) from None
    except UnidentifiedImageError:  # PIL's own text names its BytesIO, not the file
        raise BadImageError(path, "not an image format PIL can read") from None
    except DECODE_ERRORS as e:
        raise BadImageError(path, f"{type(e).__name__}: {e}") from None
    return img, full


def _resizable(img: Image.Image) -> Image.Image:
    """A mode that resizes with interpolation: palettes become L/RGB(A), high bit depths 8-bit (to_8bit)."""
    if img.mode == "P":
        alpha = "transparency" in img.info
        return img.convert(("LA" if alpha else "L") if _p_is_gray(img) else ("RGBA" if alpha else "RGB"))
    return to_8bit(img) if img.mode != "1" else img.convert("L")


def fit_within(hw: tuple[int, int], max_side: int) -> tuple[int, int] | None:
    """(H, W) scaled to fit in max_side x max_side, aspect kept; None when it already fits."""
    if max(hw) <= max_side:
        return None
    scale = max_side / max(hw)
    return max(1, round(hw[0] * scale)), max(1, round(hw[1] * scale))


def is_gray(img: Image.Image) -> bool:
    return img.mode in GRAY_MODES or (img.mode == "P" and _p_is_gray(img))


def _p_is_gray(img: Image.Image) -> bool:
    r, g, b = img.convert("RGB").split()
    return r.tobytes() == g.tobytes() == b.tobytes()


def to_8bit(img: Image.Image) -> Image.Image:
    """High bit depth grayscale (16-bit PNG/TIFF as I;16 or I, 32-bit float as F) to 8-bit "L" by *scaling*, not
    clipping: PIL's own convert("L") clips I;16 at 255, which turns a 16-bit gradient into two values.
    Integer images take the 16-bit range (0-65535, as PNG and TIFF store them); float images 0-1 when their values
    lie there, else 0-255."""
    if img.mode not in ("I", "F") and not img.mode.startswith("I;16"):
        return img
    a = np.asarray(img)
    if a.dtype.kind == "f":
        a = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        scale = 255.0 if a.size and a.min() >= 0 and a.max() <= 1 else 1.0
        out = np.clip(a * scale, 0, 255)
    else:
        out = np.clip(a.astype(np.float64), 0, 65535) * (255.0 / 65535.0)
    return Image.fromarray(np.round(out).astype(np.uint8), mode="L")


def to_mode(img: Image.Image, channels: int) -> Image.Image:
    """8-bit ``L`` (1 channel) or ``RGB`` (3); transparency composited on white."""
    img = to_8bit(img)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return img.convert("L" if channels == 1 else "RGB")


def to_array(img: Image.Image, channels: int, size: tuple[int, int] | None = None) -> np.ndarray:
    """(C, H, W) uint8 with ``channels`` 1 or 3; transparency composited on white; resized to ``size`` (H, W)."""
    img = to_mode(img, channels)
    if size is not None and (img.height, img.width) != tuple(size):
        img = img.resize((size[1], size[0]), Image.BICUBIC)
    a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy()  # h w c -> c h w


def crop_spec(pre: dict[str, Any], img_size: int | tuple[int, int]) -> dict[str, Any] | None:
    """The evaluation geometry of weights that carry their publisher's transform (timm's resize + centre crop), at
    ``img_size``; None for a model trained on images simply resized to its size (vitkit's own from-scratch runs)."""
    if "crop_pct" not in pre:
        return None
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    return {"img_size": [h, w], "crop_pct": float(pre["crop_pct"]), "crop_mode": pre.get("crop_mode", "center"),
            "interpolation": pre.get("interpolation", "bicubic")}


def crop_decode_side(spec: dict[str, Any]) -> int:
    """The longer side an image need not exceed when decoded for ``spec``: four times what the transform resizes
    to, so the short side of any photo up to 4:1 still covers the resize. A 12-megapixel photo for a 224-pixel model
    is then decoded at about 1000x750, not 4000x3000 (2 MB instead of 36)."""
    return 4 * math.ceil(max(spec["img_size"]) / (spec["crop_pct"] or 1.0))


def inception_crop(spec: dict[str, Any], channels: int):  # -> a v2 transform, PIL image -> PIL image
    """A training image as ImageNet training cuts it (Szegedy et al. 2015's "inception crop"; big_vision's
    ``inception_crop``, torchvision's RandomResizedCrop): a random box of ``spec["train_area"]`` of the image's
    area and an aspect ratio in [3/4, 4/3], resized to ``img_size``. Drawn from torch's generator, which a
    DataLoader seeds in each worker from the run's seed: a new crop every epoch, the same ones for the same seed."""
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    return v2.Compose([v2.Lambda(lambda im: to_mode(im, channels)), crop_geometry(spec, train=True)])


def crop_geometry(spec: dict[str, Any], train: bool = False):  # -> a v2 transform
    """The cut alone, for a PIL image or a decoded (C, H, W) uint8 tensor on any device (a GPU's nvJPEG output):
    ``train`` and a ``train_area``, the inception crop; else the evaluation geometry (``resize_and_crop``)."""
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    interp = v2.InterpolationMode(spec["interpolation"])
    if train and "train_area" in spec:
        return v2.RandomResizedCrop(tuple(spec["img_size"]), scale=tuple(spec["train_area"]), ratio=(3 / 4, 4 / 3),
                                    interpolation=interp, antialias=True)
    h, w = spec["img_size"]
    scale = (math.floor(h / spec["crop_pct"]), math.floor(w / spec["crop_pct"]))
    if spec["crop_mode"] == "squash":
        resize = v2.Resize(scale, interpolation=interp, antialias=True)
    else:
        resize = v2.Resize(scale[0] if scale[0] == scale[1] else scale, interpolation=interp, antialias=True)
    return v2.Compose([resize, v2.CenterCrop((h, w))])


def resize_and_crop(spec: dict[str, Any], channels: int):  # -> a v2 transform, PIL image -> PIL image
    """timm's evaluation geometry for ``spec`` (``crop_spec``): 8-bit L or RGB, the short side resized to size /
    crop_pct, the centre cropped (``crop_mode="squash"``: both sides resized). Training folders, predict, serve and
    eval all go through this one transform, so a fine-tuned model sees the same pixels everywhere."""
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    return v2.Compose([v2.Lambda(lambda im: to_mode(im, channels)), crop_geometry(spec)])
