"""ONNX export with a dynamic batch, checked against onnxruntime before it is declared done."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from ..data.preprocess import preprocessing_of
from ..model.config import to_2tuple
from ..model.serialization import atomic_write
from ..model.vit import VisionTransformer, set_attention


def export_onnx(model: VisionTransformer, path: str | Path, opset: int = 18, atol: float = 1e-4) -> float:
    """Write ``model`` to ``path`` and return the max abs difference of onnxruntime's logits to PyTorch's on a
    batch of 3 (a different batch size than traced: the batch axis is dynamic). Raises if above ``atol``."""
    m = copy.deepcopy(model).float().eval()
    set_attention(m, "exact")  # plain MatMul/Softmax: every ONNX runtime has them
    c = m.config
    x = torch.randn(2, c.in_chans, *to_2tuple(c.img_size))
    path = Path(path)
    batch = torch.export.Dim("batch", min=1, max=4096)
    torch.onnx.export(m, (x,), str(path), input_names=["pixel_values"], output_names=["logits"], opset_version=opset,
                      dynamic_shapes={"x": {0: batch}}, dynamo=True, external_data=False)
    write_metadata(path, {"vitkit.config": m.config.to_dict(), "vitkit.preprocessing": preprocessing_of(model)})
    return check_onnx(m, path, atol)


def write_metadata(path: Path, values: dict[str, object]) -> None:
    """Store ``values`` as JSON strings in the ONNX file's metadata_props, so the file alone says how to feed it
    (mean, std, image size, class names: ``onnxruntime.InferenceSession(p).get_modelmeta().custom_metadata_map``)."""
    import onnx  # optional: the onnx extra

    proto = onnx.load(str(path))
    for key, value in values.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    atomic_write(path, lambda p: onnx.save(proto, str(p)))


def check_onnx(model: VisionTransformer, path: str | Path, atol: float = 1e-4, batch: int = 3) -> float:
    import onnxruntime as ort  # optional: the onnx extra

    c = model.config
    x = torch.randn(batch, c.in_chans, *to_2tuple(c.img_size), generator=torch.Generator().manual_seed(0))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"pixel_values": x.numpy()})[0]
    with torch.no_grad():
        want = model.float().eval()(x).numpy()
    diff = float(np.abs(got - want).max())
    if not diff <= atol:
        raise ValueError(f"{path}: onnxruntime differs from PyTorch by {diff:.3g} (> {atol:g})")
    return diff
