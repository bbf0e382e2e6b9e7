"""Streamed JPEGs decoded on the training device: the DataLoader workers read each file's bytes and look at its
header only; the main process decodes the batch's JPEGs in one call (``torchvision.io.decode_jpeg`` on a list:
nvJPEG's batched decode on a CUDA GPU, libjpeg-turbo on the CPU) and cuts them there (the inception crop or the
evaluation crop, then the model's size) with the same torchvision v2 geometry the workers apply to PIL images.

Why: a 16-core host decodes ~2,300 photos a second (an H100's logs, ../shared/gpu/), a third of what a compiled
ViT-S/16 step trains; the GPU's JPEG decoder is not bound by the host's cores. Where a file is not a JPEG the
device can take (a PNG, a CMYK JPEG, a photo of more than ``MAX_PIXELS``: its full-size decode would take a batch's
worth of GPU memory), the worker decodes it as before and the batch mixes both.
"""
from __future__ import annotations

import io
from typing import Any

import torch
from PIL import Image

from .images import crop_geometry, fit_within

JPEG_MAGIC = b"\xff\xd8\xff"
MAX_PIXELS = 4_000_000  # larger photos are decoded by the workers (at a reduced DCT scale, data/images.py)
EXIF_ORIENTATION = 0x0112
# full-size decoded bytes held at once: a batch is decoded in chunks of at most this, each cut to the model's size
# before the next (decoded whole, a batch of 4096 photos of up to 4 MP held up to 48 GB before any crop, outside the
# memory the batch was sized to, issue 80 N4); at ImageNet's ~0.4 MB a photo a chunk still holds ~1,300
DECODE_BYTES = 512 * 2**20


def jpeg_header(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int, tuple[int, int]] | None:
    """(EXIF orientation (1: as stored), pixels, (height, width) once oriented) of a JPEG that ``decode_jpeg`` can
    take on a device (8-bit gray or RGB, at most ``max_pixels``), read from its header alone; None for anything else
    (the workers decode those). A progressive JPEG is left to the workers too: nvJPEG's batched
    decode takes baseline JPEGs, and torchvision decodes the others one at a time in software, their Huffman stage
    on the host's one thread that feeds the GPU (decode_jpegs_cuda.cpp), where the workers decode them side by side
    (issue 80: one photo in ten was progressive in the shards an H200 decoded at 615 img/s against its host's 2,619)."""
    if not data.startswith(JPEG_MAGIC):
        return None
    try:
        img = Image.open(io.BytesIO(data))  # lazy: the header only
        if img.format != "JPEG" or img.mode not in ("L", "RGB") or img.width * img.height > max_pixels:
            return None
        if img.info.get("progressive"):
            return None
        orientation = int(img.getexif().get(EXIF_ORIENTATION, 1))
        hw = (img.width, img.height) if orientation in (5, 6, 7, 8) else (img.height, img.width)  # (turned 90)
        return orientation, img.width * img.height, hw
    except Exception:  # noqa: BLE001 - any header PIL cannot read: the workers' decode names what is wrong
        return None


def draw_box(crop: dict[str, Any] | None, train: bool, hw: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """The training crop's (top, left, height, width) in an image of ``hw`` (once oriented), drawn where the file was
    read (a DataLoader worker, from its own seeded generator, as its PIL decode draws it), so that the decode on the
    device is a function of the batch alone and can run ahead of the step on another thread (issue 80, N2); None
    where the cut draws nothing (the evaluation crop, or no crop)."""
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    if crop is None or not train or "train_area" not in crop:
        return None
    shape = torch.empty((1, 1, 1), dtype=torch.uint8).expand(1, *hw)  # the size alone (no pixels allocated)
    p = crop_geometry(crop, train).make_params([shape])  # RandomResizedCrop's own draw
    return p["top"], p["left"], p["height"], p["width"]


def jpeg_orientation(data: bytes, max_pixels: int = MAX_PIXELS) -> int | None:
    """The EXIF orientation of a JPEG the device can decode (``jpeg_header``), None for anything else."""
    return None if (h := jpeg_header(data, max_pixels)) is None else h[0]


def chunks(pixels: list[int], channels: int, budget: int) -> list[range]:
    """Consecutive ranges of the images whose full-size decodes (``pixels`` x ``channels`` bytes each) hold at most
    ``budget`` bytes together (an image larger alone: a range of its own)."""
    out, start, held = [], 0, 0
    for i, p in enumerate(pixels):
        if i > start and held + p * channels > budget:
            out.append(range(start, i))
            start, held = i, 0
        held += p * channels
    return out + [range(start, len(pixels))] if pixels else out


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """A decoded (C, H, W) image as PIL's ``ImageOps.exif_transpose`` turns it for EXIF ``orientation``."""
    if orientation == 2:
        return img.flip(-1)
    if orientation == 3:
        return img.flip(-1).flip(-2)
    if orientation == 4:
        return img.flip(-2)
    if orientation == 5:
        return img.transpose(-2, -1)
    if orientation == 6:
        return torch.rot90(img, -1, (-2, -1))
    if orientation == 7:
        return img.flip(-1).flip(-2).transpose(-2, -1)
    if orientation == 8:
        return torch.rot90(img, 1, (-2, -1))
    return img


def cut(img: torch.Tensor, crop: dict[str, Any] | None, size: tuple[int, int] | None, train: bool,
        decode_side: int | None = None, box: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """A decoded image cut as the workers cut a PIL image (``stream.Prepare``): the crop (inception crop when
    training with a ``train_area``: at ``box`` where the worker drew it, ``draw_box``; else the evaluation crop);
    without one, first made to fit ``decode_side`` (as the workers' reduced-scale decode does), then the model's size
    (bicubic, antialiased)."""
    from torchvision.transforms import v2  # torchvision's transforms load on first use

    bicubic = v2.InterpolationMode.BICUBIC
    if crop is not None and box is not None:
        img = v2.functional.resized_crop(img, *box, size=list(crop["img_size"]),
                                         interpolation=v2.InterpolationMode(crop["interpolation"]), antialias=True)
    elif crop is not None:
        img = crop_geometry(crop, train)(img)
    elif decode_side and (box := fit_within(tuple(img.shape[-2:]), decode_side)) is not None:
        img = v2.functional.resize(img, list(box), interpolation=bicubic, antialias=True)
    if size is not None and tuple(img.shape[-2:]) != tuple(size):
        img = v2.functional.resize(img, list(size), interpolation=bicubic, antialias=True)
    return img


def _decode_all(decode_jpeg, datas: list[torch.Tensor], mode: Any, device: torch.device
                ) -> list[torch.Tensor | None]:
    """``datas`` decoded in one call, None for a file the decoder refuses: where the call fails, its two halves
    apart, and so on down to the file (a damaged file among a chunk's ~1,300 photos costs ~2 log2(1,300) = ~21 calls;
    decoded one at a time, 1,300 calls, each its own wait for the device, on the training thread)."""
    try:
        return list(decode_jpeg(datas, mode=mode, device=device))
    except RuntimeError:
        if len(datas) == 1:
            return [None]
        half = len(datas) // 2
        return _decode_all(decode_jpeg, datas[:half], mode, device) + \
            _decode_all(decode_jpeg, datas[half:], mode, device)


def decode_batch(items: list[Any], channels: int, crop: dict[str, Any] | None, size: tuple[int, int] | None,
                 train: bool, device: torch.device, fallback, decode_side: int | None = None
                 ) -> list[torch.Tensor | None]:
    """The batch's images as (C, H, W) uint8 on ``device``: ``items`` are either images the workers decoded
    (tensors) or ``(bytes, orientation, where, pixels, box)`` of JPEGs (``box``: the training crop's, ``draw_box``), decoded here in one call a chunk of at most
    ``DECODE_BYTES`` decoded (pixels unknown: ``MAX_PIXELS``). A JPEG the device's decoder refuses (a damaged file
    whose header read; found by decoding its chunk's halves apart, ``_decode_all``) is handed to ``fallback(bytes, where)`` (the workers' decode:
    its image, or a BadImageError naming the file; None in its place when bad files are skipped)."""
    from torchvision.io import ImageReadMode, decode_jpeg  # torchvision's io loads on first use

    out: list[torch.Tensor | None] = [None if isinstance(it, tuple) else it.to(device, non_blocking=True)
                                      for it in items]
    raw = [i for i, it in enumerate(items) if isinstance(it, tuple)]
    if not raw:
        return out
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    pixels = [items[i][3] if len(items[i]) > 3 else MAX_PIXELS for i in raw]  # (the workers read it in the header)
    for part in chunks(pixels, channels, DECODE_BYTES):  # each chunk decoded and cut before the next is decoded
        ids = [raw[k] for k in part]
        decoded = _decode_all(decode_jpeg, [items[i][0] for i in ids], mode, device)
        for i, img in zip(ids, decoded):
            if img is None:
                out[i] = fallback(bytes(items[i][0].numpy()), items[i][2])
            else:
                box = items[i][4] if len(items[i]) > 4 else None
                out[i] = cut(orient(img, items[i][1]), crop, size, train, decode_side, box)
        del decoded  # (the chunk's full-size images, freed before the next chunk's)
    return out

