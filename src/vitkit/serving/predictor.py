"""One uploaded image -> top-5 and an attention-rollout overlay, with the limits a public upload needs."""
from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..data.images import BadImageError, open_image
from ..data.preprocess import images_to_tensor
from ..inspect.analysis import rollout_from_attentions
from ..runtime.inference import optimize_for_inference

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP", "GIF"}


class UploadError(ValueError):
    """A message for the person who uploaded the file (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Limits:
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 40_000_000  # a 40-megapixel photo decodes; a decompression bomb does not
    body_timeout_s: float = 30.0  # the whole upload must arrive within this
    workers: int = 1  # predictions at once (each uses the machine's threads)
    max_queue: int = 32  # predictions waiting or running; beyond it "busy, retry" (503)
    max_connections: int = 64  # open connections; beyond it uvicorn answers 503


def decode_upload(data: bytes, limits: Limits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise UploadError(f"file is {len(data) / 1e6:.1f} MB; the limit is {limits.max_bytes / 1e6:.0f} MB", 413)
    if not data:
        raise UploadError("the file is empty")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
    except Image.DecompressionBombError as e:  # PIL refuses at open when far above its own limit
        found = re.search(r"\((\d+) pixels\)", str(e))
        has = f"the image has {int(found[1]):,} pixels" if found else "the image has too many pixels"
        raise UploadError(f"{has}, more than the limit of {limits.max_pixels:,}") from None
    except Exception:  # noqa: BLE001 - anything PIL cannot identify is "not an image" to the user
        raise UploadError("not an image PIL can read; upload PNG, JPEG, WebP, BMP or GIF") from None
    if fmt not in ALLOWED_FORMATS:
        raise UploadError(f"{fmt} images are not accepted; upload PNG, JPEG, WebP, BMP or GIF")
    try:
        return open_image(data, "upload", max_pixels=limits.max_pixels)
    except BadImageError as e:
        raise UploadError(str(e).replace("cannot decode image upload: ", "")) from None


def overlay_png(image: Image.Image, heat: np.ndarray, size: int = 256) -> bytes:
    """The image with the rollout heat map (jet colours, 50% alpha) over it, as PNG bytes."""
    from matplotlib import colormaps  # matplotlib's import (≈0.5 s) only when an overlay is drawn

    img = image.convert("RGB")
    scale = size / max(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BICUBIC)
    h = Image.fromarray((heat / max(float(heat.max()), 1e-12) * 255).astype(np.uint8)).resize(img.size,
                                                                                            Image.BILINEAR)
    colour = (colormaps["jet"](np.asarray(h) / 255.0)[..., :3] * 255).astype(np.uint8)
    blended = Image.blend(img, Image.fromarray(colour), 0.5)
    buf = io.BytesIO()
    blended.save(buf, format="PNG")
    return buf.getvalue()


class Predictor:
    """Holds an inference-ready model and its preprocessing."""

    def __init__(self, model: torch.nn.Module, preprocessing: dict[str, Any], limits: Limits | None = None) -> None:
        self.model = model.eval()
        self.fast = optimize_for_inference(model)
        self.pre = preprocessing
        self.limits = limits or Limits()
        n = model.config.num_classes
        self.names = preprocessing.get("class_names") or [str(i) for i in range(n)]

    def __call__(self, data: bytes, topk: int = 5) -> dict[str, Any]:
        image = decode_upload(data, self.limits)
        x = images_to_tensor([image], self.pre, self.model.config)
        logits, attns = self.fast.forward_attention(x)
        probs = torch.softmax(logits[0], -1)
        top = probs.topk(min(topk, len(probs)))
        grid = self.model.patch_embed.grid_for(tuple(x.shape[-2:]))
        heat = rollout_from_attentions(attns, self.model.num_prefix_tokens, grid)[0].numpy()
        return {"top": [{"class": self.names[int(i)], "prob": round(float(p), 5)}
                        for p, i in zip(top.values, top.indices)],
                "overlay": "data:image/png;base64," + base64.b64encode(overlay_png(image, heat)).decode()}
