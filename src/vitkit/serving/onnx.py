"""ONNX export with a dynamic batch, checked against onnxruntime before it is declared done; optionally int8.

int8 (``export_onnx(..., int8=True)``, ``vitkit export --format onnx --int8``) is onnxruntime's dynamic
quantization: the linear layers' weights stored as int8 per output channel, each layer's input quantized to uint8
on every call, products summed in int32. ViT-B/16 then runs 1.2-2.8x the fastest fp32 library, by CPU kind
(docs: Speed); the outputs change a little, so the file's accuracy is measured, not assumed: ``vitkit eval
--checkpoint model.onnx`` runs it on a dataset. Attention's two products (activation by activation) stay fp32.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.preprocess import preprocessing_of
from ..model.config import ViTConfig, to_2tuple
from ..model.serialization import atomic_write
from ..model.vit import VisionTransformer, set_attention


def export_onnx(model: VisionTransformer, path: str | Path, opset: int = 18, atol: float = 1e-4,
                int8: bool = False) -> float:
    """Write ``model`` to ``path`` and return the max abs difference of onnxruntime's logits to PyTorch's on a
    batch of 3 (a different batch size than traced: the batch axis is dynamic). Raises if above ``atol``. A model
    with ``dynamic_img_size`` (vitkit's default) is exported with a dynamic height and width too (any multiple of
    the patch; E_pos is resampled inside the graph) and checked at three sizes, non-square ones included.

    ``int8``: the fp32 export is checked as above, then quantized (``quantize_int8``) into ``path``; the returned
    number is then the int8 file's relative logit error to PyTorch (``check_int8``)."""
    # Everything is written and checked under a temporary name in the same folder, then renamed: an export that is
    # interrupted or fails its check never leaves a file under ``path``.
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        part = Path(tmp) / path.name
        if int8:
            fp32 = Path(tmp) / "fp32.onnx"
            export_onnx(model, fp32, opset, atol)
            quantize_int8(fp32, part)
            diff = check_int8(model, part)
        else:
            m = copy.deepcopy(model).float().eval()
            set_attention(m, "exact")  # plain MatMul/Softmax: every ONNX runtime has them
            c = m.config
            x = torch.randn(2, c.in_chans, *to_2tuple(c.img_size))
            axes: dict[int, object] = {0: torch.export.Dim("batch", min=1, max=4096)}
            if c.dynamic_img_size:  # H and W as multiples of the patch (x the hybrid's stride): the only valid sizes
                uh, uw = m.patch_embed.cell
                axes[2] = uh * torch.export.Dim("grid_h", min=1, max=1024)
                axes[3] = uw * torch.export.Dim("grid_w", min=1, max=1024)
            torch.onnx.export(m, (x,), str(part), input_names=["pixel_values"], output_names=["logits"],
                              opset_version=opset, dynamic_shapes={"x": axes}, dynamo=True, external_data=False,
                              verbose=False)
            write_metadata(part, {"vitkit.config": m.config.to_dict(), "vitkit.preprocessing": preprocessing_of(model)})
            diff = check_onnx(m, part, atol, sizes=check_sizes(m))
        os.replace(part, path)
    return diff


def write_metadata(path: Path, values: dict[str, object]) -> None:
    """Store ``values`` as JSON strings in the ONNX file's metadata_props, so the file alone says how to feed it
    (mean, std, image size, class names: ``onnxruntime.InferenceSession(p).get_modelmeta().custom_metadata_map``)."""
    import onnx  # optional: the onnx extra

    proto = onnx.load(str(path))
    for key, value in values.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    atomic_write(path, lambda p: onnx.save(proto, str(p)))


def ort_session(path: str | Path, threads: int | None = None):  # type: ignore[no-untyped-def]
    """An onnxruntime CPU session on ``threads`` threads (default: the ones torch was given, by ``--threads``,
    OMP_NUM_THREADS or the planner). onnxruntime's own default is one spinning thread per core, which holds back
    every other process on a shared machine."""
    import onnxruntime as ort  # optional: the onnx extra

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_sizes(model: VisionTransformer) -> list[tuple[int, int]]:
    """The sizes an export is checked at: the model's own, and for a dynamic model two more, each side a multiple
    of the patch: one taller (1.5x the height), one wider and smaller (half the height, 1.5x the width)."""
    (h, w), (uh, uw) = to_2tuple(model.config.img_size), model.patch_embed.cell
    if not model.config.dynamic_img_size:
        return [(h, w)]
    side = lambda n, u: max(u, round(n / u) * u)  # noqa: E731
    return [(h, w), (side(1.5 * h, uh), w), (side(0.5 * h, uh), side(1.5 * w, uw))]


def check_onnx(model: VisionTransformer, path: str | Path, atol: float = 1e-4, batch: int = 3,
               sizes: list[tuple[int, int]] | None = None) -> float:
    """The largest difference of onnxruntime's logits to PyTorch's at each of ``sizes`` (default: the model's own),
    one session for all; raises above ``atol``, naming the size."""
    c = model.config
    sess, diff = ort_session(path), 0.0
    for size in sizes or [to_2tuple(c.img_size)]:
        x = torch.randn(batch, c.in_chans, *size, generator=torch.Generator().manual_seed(0))
        got = sess.run(["logits"], {"pixel_values": x.numpy()})[0]
        with torch.no_grad():
            want = model.float().eval()(x).numpy()
        diff = max(diff, float(np.abs(got - want).max()))
        if not diff <= atol:
            raise ValueError(f"{path}: onnxruntime differs from PyTorch by {diff:.3g} (> {atol:g}) at {tuple(size)}")
    return diff


# Weights quantized to 7 bits: CPUs without VNNI (AVX2, AVX-512 without VNNI: the AMD EPYC kind) multiply uint8 by
# int8 with an instruction that adds pairs of products in int16 and saturates there; with 7-bit weights no pair can
# overflow. The file is portable, so it is quantized for the CPU that does the least.
REDUCE_RANGE = True


def quantize_int8(src: str | Path, dst: str | Path) -> None:
    """Dynamic int8 quantization of an fp32 ONNX file from ``export_onnx`` (onnxruntime.quantization): every MatMul
    and Gemm with a constant weight gets int8 weights per output channel. onnxruntime keeps the file's metadata (the
    vitkit config and preprocessing); ``vitkit.int8`` is added."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # optional: the onnx extra

    dst = Path(dst)
    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        out = Path(tmp) / "int8.onnx"
        root.setLevel(logging.ERROR)  # its advice to "pre-process" first: measured, no faster or more accurate here
        try:
            quantize_dynamic(Path(src), out, weight_type=QuantType.QInt8, per_channel=True,
                             reduce_range=REDUCE_RANGE, op_types_to_quantize=["MatMul", "Gemm"])
        finally:
            root.setLevel(level)
        write_metadata(out, {"vitkit.int8": f"dynamic, per channel, {7 if REDUCE_RANGE else 8}-bit weights"})
        os.replace(out, dst)


# Above this relative logit error an int8 file is broken, not merely quantized (ViT-B/16, random weights: 3.9%).
INT8_LIMIT = 0.1


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ (the max abs difference where ``want`` is all zeros: a fresh model's zero head)."""
    scale = float(want.norm())
    return float((got - want).norm()) / scale if scale > 0 else float((got - want).abs().max())


def check_int8(model: VisionTransformer, path: str | Path, limit: float = INT8_LIMIT, batch: int = 8) -> float:
    """The int8 file's logits against PyTorch's fp32 on ``batch`` random images (``relative_error``). Raises above
    ``limit`` (a broken quantization, not an accuracy figure: measure that with ``vitkit eval``)."""
    c = model.config
    x = torch.randn(batch, c.in_chans, *to_2tuple(c.img_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = relative_error(OnnxModel(path)(x), model.float().eval()(x))
    if not err <= limit:
        raise ValueError(f"{path}: the int8 logits differ from PyTorch's fp32 by {err:.3g} of their size (> {limit:g})")
    return err


class OnnxModel(torch.nn.Module):
    """An ONNX file written by ``export_onnx`` run by onnxruntime on the CPU, with what ``vitkit eval`` and
    ``vitkit predict`` use of a model: ``config`` and ``preprocessing`` (read from the file's metadata) and
    ``forward(x) -> logits`` (fp32 torch tensors in and out). It has no parameters and cannot be trained."""

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        try:
            self.session = ort_session(self.path, threads)
        except Exception as e:  # onnxruntime raises its own classes for missing, truncated or invalid files
            raise ValueError(f"{self.path}: not an ONNX model onnxruntime can run ({str(e).splitlines()[0]})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if "vitkit.config" not in meta:
            raise ValueError(f"{self.path}: no 'vitkit.config' in the ONNX metadata; vitkit runs the ONNX files "
                             "`vitkit export --format onnx` writes (they say how to feed them)")
        self.config = ViTConfig.from_dict(json.loads(meta["vitkit.config"]))
        self.preprocessing: dict[str, Any] = json.loads(meta.get("vitkit.preprocessing", "{}"))
        self.int8 = json.loads(meta["vitkit.int8"]) if "vitkit.int8" in meta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # a NaFlex batch (model/naflex.py): the graph takes one size
            raise ValueError(f"{self.path} takes fixed-size image batches, not NaFlex batches; predict with the "
                             "checkpoint the ONNX file was exported from for images at their own aspect ratio")
        want = (self.config.in_chans, *to_2tuple(self.config.img_size))
        if tuple(x.shape[1:]) != want:
            raise ValueError(f"{self.path} takes images of shape (B, {', '.join(map(str, want))}); got "
                             f"{tuple(x.shape)}")
        logits = self.session.run(["logits"], {"pixel_values": x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(logits).to(x.device)
