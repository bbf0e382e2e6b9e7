"""Decoding one image file the same way everywhere (training folders, predict, serve)."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "F"}
DECODE_ERRORS = (OSError, SyntaxError, ValueError, UnidentifiedImageError, Image.DecompressionBombError)


class BadImageError(ValueError):
    """An image file that cannot be decoded; ``path`` names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot decode image {path}: {reason}")
        self.path = path


def open_image(data: bytes, path: str = "<bytes>", max_pixels: int | None = None) -> Image.Image:
    """Decode fully (so truncated files fail here, not later), EXIF orientation applied, first frame only."""
    try:
        img = Image.open(io.BytesIO(data))
        if max_pixels is not None and img.width * img.height > max_pixels:
            raise BadImageError(path, f"{img.width}x{img.height} pixels is more than the limit of {max_pixels}")
        img.seek(0)
        img.load()
        return ImageOps.exif_transpose(img)
    except BadImageError:
        raise
    except DECODE_ERRORS as e:
        raise BadImageError(path, f"{type(e).__name__}: {e}") from None


def is_gray(img: Image.Image) -> bool:
    return img.mode in GRAY_MODES or (img.mode == "P" and _p_is_gray(img))


def _p_is_gray(img: Image.Image) -> bool:
    r, g, b = img.convert("RGB").split()
    return r.tobytes() == g.tobytes() == b.tobytes()


def to_array(img: Image.Image, channels: int, size: tuple[int, int] | None = None) -> np.ndarray:
    """(C, H, W) uint8 with ``channels`` 1 or 3; transparency composited on white; resized to ``size`` (H, W)."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    img = img.convert("L" if channels == 1 else "RGB")
    if size is not None and (img.height, img.width) != tuple(size):
        img = img.resize((size[1], size[0]), Image.BICUBIC)
    a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy()  # h w c -> c h w
