"""``vitkit probe {--checkpoint DIR | --model NAME.TAG} --dataset ...``: how good an encoder's features are, frozen:
a linear probe (BatchNorm + linear layer, MAE's) and weighted k-NN (DINO's), on a labelled dataset (or a share of
its labels, --train-fraction); --random probes the same architecture with fresh weights, the baseline to beat."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import add_data_flags, add_threads_flag, add_weights_flags, apply_threads, load_data_from_args, \
    load_weights, positive_int


def add_parser(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p)
    add_threads_flag(p)
    add_data_flags(p)
    p.add_argument("--method", default="linear,knn", help="linear, knn, or both joined by a comma (the default)")
    p.add_argument("--pool", choices=("cls", "mean"), default="cls",
                   help="the features: the class token's final state, or the mean of the patch tokens")
    p.add_argument("--train-fraction", type=float, default=1.0,
                   help="probe with this class-balanced share of the training labels (the same images as train's)")
    p.add_argument("--epochs", type=positive_int, default=100, help="linear probe: epochs over the features")
    p.add_argument("--lr", type=float, default=0.1, help="linear probe: SGD's learning rate (cosine to 0)")
    p.add_argument("--k", type=positive_int, default=20, help="k-NN: neighbours that vote")
    p.add_argument("--random", action="store_true",
                   help="probe the same architecture with fresh weights (drawn with --seed): what the features add "
                        "over it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a folder to write probe.json in, or a .json file (default: beside "
                                              "the checkpoint)")
    p.add_argument("--device", default="auto")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..data.augment import BatchAugment
    from ..data.images import crop_spec
    from ..model.config import to_2tuple
    from ..model.vit import VisionTransformer
    from ..runtime.device import resolve_device
    from ..training.features import extract_features, knn, linear_probe

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    if not methods or set(methods) - {"linear", "knn"}:
        raise ValueError(f"--method {args.method!r}: expected linear, knn, or both (linear,knn)")
    if not 0 < args.train_fraction <= 1:
        raise ValueError(f"--train-fraction {args.train_fraction:g}: expected more than 0 and at most 1")
    apply_threads(args)
    model = load_weights(args)
    pre = getattr(model, "preprocessing", None) or {}
    c = model.config
    if args.random:
        torch.manual_seed(args.seed)
        model = VisionTransformer(c)
    data = load_data_from_args(args, crop=crop_spec(pre, c.img_size))
    if c.in_chans != data.in_chans:
        raise ValueError(f"the encoder reads {c.in_chans}-channel images; {data.name} has {data.in_chans}")
    if data.num_classes < 2:  # every probe is "right" on one class: 100% that says nothing of the features
        raise ValueError(f"{data.name}: {data.num_classes} class ({', '.join(map(str, data.classes))}); a probe "
                         "measures how well the features tell classes apart and needs at least 2 (one folder per "
                         "class under train/ and val/)")
    mean, std = (pre["mean"], pre["std"]) if len(pre.get("mean") or []) == c.in_chans else data.mean_std()
    data = data.with_train_fraction(args.train_fraction)
    device = resolve_device(args.device)
    model = model.to(device)
    augment = BatchAugment(mean, std, to_2tuple(c.img_size), data.num_classes)
    train = extract_features(model, data.train, augment, device, pool=args.pool)
    val = extract_features(model, data.val, augment, device, pool=args.pool)
    what = f"{'fresh weights of ' if args.random else ''}{args.checkpoint or args.weights_model}"
    print(f"{data.name}: {len(train[0])} training and {len(val[0])} validation images; features of {what} "
          f"({args.pool}, {train[0].shape[1]} dimensions)")
    results = []
    for m in methods:
        r = (linear_probe(train, val, data.num_classes, args.epochs, args.lr, seed=args.seed, device=device)
             if m == "linear" else knn(train, val, data.num_classes, args.k, device=device))
        results.append(r.row())
        print(f"{r.method}: val top-1 {r.top1:.2f}%" + (f" (train {r.train_top1:.2f}%)" if r.train_top1 is not None
                                                         else ""))
    out = Path(args.out) if args.out else (Path(args.checkpoint) if args.checkpoint and Path(args.checkpoint).is_dir()
                                           else Path("probe"))
    name = "probe-random.json" if args.random else "probe.json"
    if out.suffix.lower() == ".json":  # --out x.json: that file (not a folder named x.json)
        out, name = out.parent, out.name
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({"dataset": data.name, "weights": what, "pool": args.pool,
                                        "train_fraction": args.train_fraction, "results": results}, indent=1))
    print(f"wrote {out / name}")
    return 0
