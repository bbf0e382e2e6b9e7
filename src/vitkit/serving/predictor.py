"""One uploaded image -> top-5 and an overlay of why (attention rollout, or a class-specific map of
``vitkit.inspect.explain`` for the method and class the page asks about), with the limits a public upload needs."""
from __future__ import annotations

import base64
import importlib.util
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..data.images import MAX_PIXELS, BadImageError, open_image, too_many_pixels
from ..data.preprocess import decode_side, images_to_tensor, model_view
from ..inspect.analysis import rollout_from_attentions
from ..inspect.explanations import CLASS_SPECIFIC, METHODS, explain, resolve_target
from ..model.config import to_2tuple
from ..runtime.inference import optimize_for_inference
from ..runtime.threads import choose_threads, usable_cores

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP", "GIF"}


class UploadError(ValueError):
    """A message for the person who uploaded the file (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Limits:
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = MAX_PIXELS  # a 40-megapixel photo decodes; a decompression bomb does not
    body_timeout_s: float = 30.0  # the whole upload must arrive within this
    first_byte_timeout_s: float = 5.0  # ... and its first bytes within this: headers and no body do not hold a slot
    header_timeout_s: float = 10.0  # a request's headers complete within this of the connection (or the previous
    # response): half-sent headers (slowloris) are closed instead of holding a connection for ever
    workers: int | None = None  # batches predicted at once; None: the usable cores / the threads each batch uses
    max_batch: int = 16  # uploads waiting together are predicted in one forward pass of up to this many
    max_queue: int = 64  # predictions waiting or running; beyond it "busy, retry" (503)
    max_connections: int = 64  # uploads in progress at once; beyond it "busy, retry" (JSON 503 + Retry-After), while
    # the page and /api/info are still served (uvicorn's own limit, far above, only bounds memory)


@dataclass(frozen=True)
class Ask:
    """What the overlay of an upload explains: ``method`` (one of ``vitkit.inspect.METHODS``) for class
    ``target`` (an index; None: the predicted class)."""
    method: str = "rollout"
    target: int | None = None


def available_methods() -> list[str]:
    """The explanation methods this server can draw (``gradcam`` needs the optional grad-cam package)."""
    return [m for m in METHODS if m != "gradcam" or importlib.util.find_spec("pytorch_grad_cam") is not None]


def decode_upload(data: bytes, limits: Limits, max_side: int | None = None) -> Image.Image:
    """The upload decoded, no larger than ``max_side`` on its longer side (``decode_side``: what the model needs, as
    ``vitkit predict`` decodes the same file), or an UploadError saying what is wrong with it. Decoded whole, a
    burst of 40-megapixel uploads held gigabytes that the process kept after answering."""
    if len(data) > limits.max_bytes:
        raise UploadError(f"file is {len(data) / 1e6:.1f} MB; the limit is {limits.max_bytes / 1e6:.0f} MB", 413)
    if not data:
        raise UploadError("the file is empty")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
    except Image.DecompressionBombError as e:  # PIL refuses at open when far above its own limit
        raise UploadError(f"the image has {too_many_pixels(e, limits.max_pixels)}") from None
    except Exception:  # noqa: BLE001 - anything PIL cannot identify is "not an image" to the user
        raise UploadError("not an image PIL can read; upload PNG, JPEG, WebP, BMP or GIF") from None
    if fmt not in ALLOWED_FORMATS:
        raise UploadError(f"{fmt} images are not accepted; upload PNG, JPEG, WebP, BMP or GIF")
    try:
        return open_image(data, "upload", max_pixels=limits.max_pixels, max_side=max_side)
    except BadImageError as e:
        raise UploadError(str(e).replace("cannot decode image upload: ", "")) from None


def overlay_png(image: Image.Image, heat: np.ndarray, size: int = 256) -> bytes:
    """The image (as the model saw it: ``preprocess.model_view``) with a heat map (scaled to its maximum; jet
    colours, 50% alpha: the page's legend) over it, as PNG bytes."""
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
    """Holds an inference-ready model and its preprocessing. ``threads`` (None: measured on a one-image forward,
    runtime/threads.py) and ``limits.workers`` (None: the cores left over, one batch per ``threads``) size the work
    for latency."""

    def __init__(self, model: torch.nn.Module, preprocessing: dict[str, Any], limits: Limits | None = None,
                 threads: int | None = None) -> None:
        self.model = model.eval()
        self.fast = optimize_for_inference(model)
        self.pre = preprocessing
        self.decode_side = decode_side(preprocessing, model.config)  # uploads decoded at what the model needs
        self.limits = limits or Limits()
        n = model.config.num_classes
        self.names = preprocessing.get("class_names") or [str(i) for i in range(n)]
        c = model.config
        self.device = next(model.parameters()).device  # a model on a GPU is given its batches there
        probe = torch.zeros(1, c.in_chans, *to_2tuple(c.img_size), device=self.device)
        self.threads, self.threads_note = choose_threads(lambda: self.fast.forward_attention(probe), threads,
                                                         "prediction", self.device)
        self.workers = self.limits.workers or max(1, usable_cores() // self.threads)

    def ask(self, method: str | None = None, target: str | None = None) -> Ask:
        """The request's method and class checked (an UploadError naming what was wrong and what is expected)."""
        method = method or "rollout"
        methods = available_methods()
        if method not in methods:
            why = " (it needs the grad-cam package on the server)" if method == "gradcam" else ""
            raise UploadError(f"unknown explanation method {method!r}{why}; this server draws {', '.join(methods)}")
        if target in (None, ""):
            return Ask(method)
        try:
            return Ask(method, resolve_target(self.names, target))
        except ValueError as e:
            raise UploadError(str(e)) from None

    def __call__(self, data: bytes, topk: int = 5, ask: Ask = Ask()) -> dict[str, Any]:
        """One upload's top-k and overlay; an UploadError for a file that is not an acceptable image."""
        result = self.predict_batch([(data, ask)], topk)[0]
        if isinstance(result, UploadError):
            raise result
        return result

    def predict_batch(self, uploads: list[bytes | tuple[bytes, Ask]], topk: int = 5
                      ) -> list[dict[str, Any] | UploadError]:
        """Each upload's answer, in order: one forward pass over all that decode (its rollout is the overlay where
        that is what was asked), an explanation per upload that asks for another method or class, an UploadError
        for the files that do not decode."""
        out: list[dict[str, Any] | UploadError] = []
        images: list[tuple[int, Image.Image, Ask]] = []
        for i, item in enumerate(uploads):
            data, ask = item if isinstance(item, tuple) else (item, Ask())
            try:
                images.append((i, decode_upload(data, self.limits, self.decode_side), ask))
                out.append({})
            except UploadError as e:
                out.append(e)
        if not images:
            return out
        x = images_to_tensor([im for _, im, _ in images], self.pre, self.model.config).to(self.device)
        logits, attns = self.fast.forward_attention(x)
        if self.pre.get("naflex_max_tokens"):  # trained on NaFlex batches: predicted as it trained, and as `vitkit
            # predict` predicts (the overlay is the fixed-size pass's attention)
            logits = self.fast(images_to_tensor([im for _, im, _ in images], self.pre, self.model.config,
                                                naflex=True).to(self.device))
        probs = torch.softmax(logits.float(), -1).cpu()
        top = probs.topk(min(topk, probs.shape[-1]))
        grid = self.model.patch_embed.grid_for(tuple(x.shape[-2:]))
        rollout = rollout_from_attentions(attns, self.model.num_prefix_tokens, grid,
                                          readout=self.model.num_readout_tokens).cpu().numpy()
        for j, (i, image, ask) in enumerate(images):
            target = int(probs[j].argmax()) if ask.target is None else ask.target
            # a class-agnostic map (rollout, attention-last) explains no class: it is the same for all
            specific = ask.method in CLASS_SPECIFIC
            explained = {"method": ask.method, "class_specific": specific,
                         "class": self.names[target] if specific else None, "index": target if specific else None,
                         "prob": round(float(probs[j, target]), 5) if specific else None}
            heat = (rollout[j] if ask.method == "rollout"
                    else explain(self.model, x[j:j + 1], target, ask.method).maps[0])
            out[i] = {"top": [{"class": self.names[int(k)], "index": int(k), "prob": round(float(p), 5)}
                              for p, k in zip(top.values[j], top.indices[j])],
                      "explained": explained,
                      "overlay": "data:image/png;base64," + base64.b64encode(
                          overlay_png(model_view(image, self.pre, self.model.config), heat)).decode()}
        return out
