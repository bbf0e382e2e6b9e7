"""``vitkit predict {--checkpoint DIR | --model NAME.TAG} IMAGE... --topk 5 [--json]``."""
from __future__ import annotations

import argparse
import json

from .common import add_threads_flag, add_weights_flags, apply_threads, load_weights


def add_parser(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p)
    add_threads_flag(p)
    p.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP, GIF, ...) or folders of them")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default="auto")


def predict(model, preprocessing: dict, paths: list[str], topk: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """Top-k per image file: EXIF orientation applied, transparency on white, channels and size as the model wants."""
    import torch

    from ..data.preprocess import image_files, images_to_tensor, load_images

    paths = image_files(paths)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # an OnnxModel has none
    x = images_to_tensor(load_images(paths), preprocessing, model.config).to(device)
    probs = torch.softmax(model(x).float(), dim=-1)
    names = preprocessing.get("class_names") or [str(i) for i in range(probs.shape[1])]
    k = min(topk, probs.shape[1])
    top = probs.topk(k, dim=-1)
    return [{"image": p, "top": [{"class": names[int(i)], "index": int(i), "prob": float(v)}
                                 for v, i in zip(top.values[j], top.indices[j])]} for j, p in enumerate(paths)]


def run(args: argparse.Namespace) -> int:
    from ..data.preprocess import preprocessing_of
    from ..runtime.inference import optimize_for_inference
    from ..runtime.device import resolve_device
    from ..serving.onnx import OnnxModel

    apply_threads(args)
    model = load_weights(args, onnx=True)
    pre = preprocessing_of(model)
    fast = model if isinstance(model, OnnxModel) else optimize_for_inference(model.to(resolve_device(args.device)))
    results = predict(fast, pre, args.images, args.topk)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(r["image"])
            for t in r["top"]:
                print(f"  {t['prob'] * 100:6.2f}%  {t['class']}")
    return 0

