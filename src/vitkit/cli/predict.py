"""``vitkit predict {--checkpoint DIR | --model NAME.TAG} IMAGE... --topk 5 [--json]``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import add_threads_flag, add_weights_flags, apply_threads, load_weights, positive_int


def add_parser(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p)
    add_threads_flag(p)
    p.add_argument("images", nargs="*", help="image files (PNG, JPEG, WebP, BMP, GIF, ...) or folders of them")
    p.add_argument("--topk", type=positive_int, default=5, help="classes listed an image, most likely first")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default="auto",
                   help="where it runs: auto (a GPU where there is one, else the CPU), cpu, cuda, cuda:N, mps")


BATCH = 16  # images decoded and predicted at a time: memory stays bounded whatever the count


def predict(model, preprocessing: dict, paths: list[str], topk: int,  # type: ignore[no-untyped-def]
            progress: bool = False) -> list[dict]:
    """Top-k per image file: EXIF orientation applied, transparency on white, channels and size as the model wants.
    Images are decoded ``BATCH`` at a time, each no larger than the model needs (``decode_side``) and within the
    pixel limit training and serving keep. A file that does not decode is reported in its row (``error``) and the
    others are predicted (one bad file lost every result before)."""
    import torch
    from tqdm import tqdm

    from ..data.images import BadImageError
    from ..data.preprocess import decode_side, image_files, images_to_tensor, load_images

    paths = image_files(paths)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # an OnnxModel has none
    side = decode_side(preprocessing, model.config)
    rows: dict[str, dict] = {}
    with tqdm(total=len(paths), unit="img", disable=not progress, leave=False) as bar, torch.no_grad():
        for i in range(0, len(paths), BATCH):
            good, images = [], []
            for p in paths[i:i + BATCH]:
                try:
                    images += load_images([p], max_side=side)
                    good.append(p)
                except BadImageError as e:
                    rows[p] = {"image": p, "error": str(e)}
            if images:
                x = images_to_tensor(images, preprocessing, model.config, naflex=True).to(device)
                probs = torch.softmax(model(x).float(), dim=-1)
                names = preprocessing.get("class_names") or [str(c) for c in range(probs.shape[1])]
                top = probs.topk(min(topk, probs.shape[1]), dim=-1)
                for j, p in enumerate(good):
                    rows[p] = {"image": p, "top": [{"class": names[int(c)], "index": int(c), "prob": float(v)}
                                                   for v, c in zip(top.values[j], top.indices[j])]}
            bar.update(len(paths[i:i + BATCH]))
    return [rows[p] for p in paths]


def run(args: argparse.Namespace) -> int:
    from ..data.preprocess import preprocessing_of
    from ..runtime.inference import optimize_for_inference
    from ..runtime.device import resolve_device
    from ..serving.onnx import OnnxModel

    from ..data.folder import IMAGE_EXTENSIONS

    pretrained = getattr(args, "pretrained", True)
    if isinstance(pretrained, str) and Path(pretrained).suffix.lower() in IMAGE_EXTENSIONS \
            and Path(pretrained).is_file():
        # `--model NAME --pretrained a.jpg`: argparse gave the image to --pretrained; an image is no weights source
        args.images, args.pretrained = [pretrained, *args.images], True
    if not args.images:
        raise ValueError("no images given: vitkit predict --checkpoint DIR IMAGE [IMAGE ...] (files or folders)")
    apply_threads(args)
    model = load_weights(args, onnx=True)
    pre = preprocessing_of(model)
    fast = model if isinstance(model, OnnxModel) else optimize_for_inference(model.to(resolve_device(args.device)))
    results = predict(fast, pre, args.images, args.topk, progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            if "top" in r:
                print(r["image"])
                for t in r["top"]:
                    print(f"  {t['prob'] * 100:6.2f}%  {t['class']}")
    bad = [r for r in results if "error" in r]
    for r in bad:
        print(f"vitkit predict: {r['error']}", file=sys.stderr)
    if bad:
        print(f"vitkit predict: {len(bad)} of {len(results)} images did not decode; the others are above",
              file=sys.stderr)
    return 1 if bad else 0

