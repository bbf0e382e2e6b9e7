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


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from ..interop import load, to_hf, to_jax_npz, to_timm
    from ..model.serialization import atomic_write

    if args.int8 and args.format != "onnx":
        raise ValueError("--int8 applies to --format onnx only")
    out = Path(args.out)
    refuse_overwrite(out)
    if args.format != "hf" and not out.parent.is_dir():  # said before the export, not as a temporary file's name
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist")
    model = load(args.checkpoint).eval()
    meta = {"vitkit_config": json.dumps(model.config.to_dict())}
    if args.format == "safetensors":
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        atomic_write(out, lambda p: save_file(state, str(p), metadata=meta))
    elif args.format == "timm":  # timm's layout has no head count or pooling: the config rides in the metadata
        state = to_timm(model)
        atomic_write(out, lambda p: save_file(state, str(p), metadata=meta))
    elif args.format == "jax":
        to_jax_npz(model, out)
    elif args.format == "hf":
        sd, cfg = to_hf(model)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    elif args.format == "onnx":
        from ..serving.onnx import export_onnx

        diff = export_onnx(model, out, opset=args.opset, atol=args.atol, int8=args.int8)
        if args.int8:
            print(f"int8 logits differ from PyTorch's fp32 by {diff:.1%} of their size on random images; the "
                  f"accuracy on your data: vitkit eval --checkpoint {out}")
        else:
            print(f"onnxruntime max abs difference to PyTorch: {diff:.2e} (limit {args.atol:g})")
    print(f"wrote {out}")
    return 0
