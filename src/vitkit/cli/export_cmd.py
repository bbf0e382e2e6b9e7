"""``vitkit export --checkpoint DIR --format {safetensors,onnx,timm,hf} --out PATH``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .import_cmd import refuse_overwrite


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a vitkit folder (or any weights vitkit import reads)")
    p.add_argument("--format", required=True, choices=("safetensors", "onnx", "timm", "hf", "jax"))
    p.add_argument("--out", required=True)
    p.add_argument("--opset", type=int, default=18, help="ONNX opset")
    p.add_argument("--atol", type=float, default=1e-4, help="ONNX: largest allowed difference to PyTorch")
    p.add_argument("--int8", action="store_true",
                   help="ONNX: int8 weights (onnxruntime dynamic quantization; ViT-B/16 ~3x faster on a CPU with "
                        "VNNI/AMX). Changes the outputs a little: measure with `vitkit eval --checkpoint OUT`")


def hf_image_processor(pre: dict, config) -> dict:  # type: ignore[no-untyped-def]
    """transformers' ViTImageProcessor settings for ``pre`` (what ``AutoImageProcessor.from_pretrained`` reads). It
    resizes straight to the model's size: a centre crop (crop_pct < 1) has no field there, so it is kept under
    vitkit's own key beside them."""
    from ..model.config import to_2tuple

    h, w = to_2tuple(config.img_size)
    resample = {"nearest": 0, "bilinear": 2, "bicubic": 3}.get(pre.get("interpolation", "bicubic"), 3)
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": h, "width": w},
            "resample": resample, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(pre["mean"]), "image_std": list(pre["std"]),
            "vitkit_preprocessing": {k: pre[k] for k in ("crop_pct", "crop_mode") if k in pre}}


def run(args: argparse.Namespace) -> int:
    from ..interop import load

    if args.int8 and args.format != "onnx":
        raise ValueError("--int8 applies to --format onnx only")
    out = Path(args.out)
    refuse_overwrite(out)
    if args.format != "hf" and not out.parent.is_dir():  # said before the export, not as a temporary file's name
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist")
    model = load(args.checkpoint).eval()
    if message := write_weights(model, args.format, out, opset=args.opset, atol=args.atol, int8=args.int8):
        print(message)
    print(f"wrote {out}")
    return 0


def write_weights(model, fmt: str, out: Path, opset: int = 18, atol: float = 1e-4,  # type: ignore[no-untyped-def]
                  int8: bool = False) -> str | None:
    """Write ``model`` to ``out`` in ``fmt`` (what ``vitkit export`` and ``vitkit push`` write); returns a line to
    print about it (ONNX's measured difference to PyTorch), or None."""
    from safetensors.torch import save_file

    from ..data.preprocess import naflex_note, preprocessing_of
    from ..interop import to_hf, to_jax_npz, to_timm
    from ..model.serialization import atomic_write

    # what the weights cannot show, in the file's metadata: the config, and how inputs are prepared (mean, std,
    # resize + crop, class names), so every export is used as the checkpoint is
    meta = {"vitkit_config": json.dumps(model.config.to_dict()),
            "vitkit_preprocessing": json.dumps(preprocessing_of(model))}
    if fmt in ("onnx", "timm", "hf", "jax") and (
            note := naflex_note(preprocessing_of(model), model.config, f"the {fmt} export reads images",
                                "`vitkit predict` and `vitkit eval` of the vitkit checkpoint run")):
        print(note)  # (their runtimes feed one image size; the safetensors export keeps the NaFlex budget)
    if fmt == "safetensors":
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        atomic_write(out, lambda p: save_file(state, str(p), metadata=meta))
    elif fmt == "timm":  # timm's layout has no head count or pooling: the config rides in the metadata
        state = to_timm(model)
        atomic_write(out, lambda p: save_file(state, str(p), metadata=meta))
    elif fmt == "jax":
        to_jax_npz(model, out)
    elif fmt == "hf":
        sd, cfg = to_hf(model)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / "preprocessor_config.json").write_text(json.dumps(hf_image_processor(preprocessing_of(model),
                                                                                    model.config), indent=2))
    elif fmt == "onnx":
        from ..serving.onnx import export_onnx

        diff = export_onnx(model, out, opset=opset, atol=atol, int8=int8)
        if int8:
            return (f"int8 logits differ from PyTorch's fp32 by {diff:.1%} of their size on random images; the "
                    f"accuracy on your data: vitkit eval --checkpoint {out}")
        return f"onnxruntime max abs difference to PyTorch: {diff:.2e} (limit {atol:g})"
    else:
        raise ValueError(f"unknown format {fmt!r}; expected safetensors, onnx, timm, hf or jax")
    return None
