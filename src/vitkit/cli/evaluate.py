"""``vitkit eval {--checkpoint DIR | --model NAME.TAG}``: top-1/top-5, loss, per-class accuracy and a
confusion-matrix PNG."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from .common import (ImageSize, add_data_flags, add_threads_flag, add_weights_flags, apply_threads,
                     load_data_from_args, load_weights, positive_int, weights_name)


def add_parser(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p)
    add_threads_flag(p)
    add_data_flags(p)
    p.add_argument("--split", choices=("val", "train"), default="val", help="which split to evaluate")
    p.add_argument("--img-size", action=ImageSize, default=None,
                   help="evaluate at another resolution (§3.2 resampling): 384, or H W / HxW")
    p.add_argument("-b", "--batch-size", type=positive_int, default=None, help="images a batch (default 256, as "
                                                                              "training evaluates)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="the weights' dtype: auto (the faster of fp32 and bf16, timed here on this model and cached, "
                        "as vitkit.optimize_for_inference chooses), exact fp32, or bf16")
    p.add_argument("--out", default=None, help="folder for eval.json and confusion.png (default: CHECKPOINT/eval for a "
                                               "folder, FILE.eval/ beside a single-file checkpoint)")
    p.add_argument("--device", default="auto",
                   help="where it runs: auto (a GPU where there is one, else the CPU), cpu, cuda, cuda:N, mps")


def _run_dataset_defaults(args: argparse.Namespace) -> None:
    """A checkpoint inside a run folder knows its dataset: use it unless flags say otherwise."""
    if not getattr(args, "checkpoint", None):
        return
    run_cfg = Path(args.checkpoint).resolve().parent / "config.yaml"
    if not getattr(args, "dataset", None) and run_cfg.is_file():
        saved = yaml.safe_load(run_cfg.read_text()) or {}
        args.dataset = saved.get("dataset")
        for k in ("data_dir", "cache_dir"):
            if saved.get(k) and not getattr(args, k, None):
                setattr(args, k, saved[k])


def run(args: argparse.Namespace) -> int:
    import torch

    from ..data import FILE_DATASETS
    from ..data.images import crop_spec
    from ..data.naflex import as_naflex
    from ..data.preprocess import naflex_note, normalizer
    from ..inspect.plots import plot_confusion
    from ..runtime.inference import optimize_for_inference
    from ..runtime.precision import dtype_of
    from ..training.evaluate import EVAL_BATCH_SIZE, evaluate
    from ..runtime.device import resolve_device
    from ..serving.onnx import OnnxModel

    apply_threads(args)
    args.batch_size = args.batch_size or EVAL_BATCH_SIZE
    _run_dataset_defaults(args)
    model = load_weights(args, onnx=True, **({"img_size": args.img_size} if args.img_size else {}))
    onnx = isinstance(model, OnnxModel)
    pre = getattr(model, "preprocessing", None) or {}
    c = model.config
    naflex = bool(pre.get("naflex_max_tokens")) and not onnx and (getattr(args, "dataset", None) in FILE_DATASETS)
    if pre.get("naflex_max_tokens") and not naflex:  # an ONNX graph takes one size; in-memory data has one size
        print(naflex_note(pre, c, "this evaluation runs", "`vitkit predict`, and `vitkit eval` of its PyTorch "
                                                          "weights on a folder, shards or a Hugging Face dataset, run"))
    # a folder: prepared as predict prepares it; a NaFlex checkpoint's: streamed as NaFlex batches, as it trained
    data = load_data_from_args(args, crop=crop_spec(pre, c.img_size), mode="stream" if naflex else "auto")
    if naflex:
        data = as_naflex(data, c.patch_size, pre["naflex_max_tokens"])
    trained_on = [str(n) for n in pre.get("class_names") or []]
    if (trained_on and len(trained_on) == c.num_classes < data.num_classes and not getattr(args, "classes", None)
            and set(trained_on) <= {str(n) for n in data.classes}):  # a run of --classes: evaluated on its classes
        data = data.with_classes(trained_on)
        if [str(n) for n in data.classes] != trained_on:  # its labels would not be the model's outputs' order
            raise ValueError(f"{weights_name(args)} lists its classes as {', '.join(trained_on)}; {data.name} holds "
                             f"them in another order ({', '.join(map(str, data.classes))}): not the data it "
                             "was trained on")
        print(f"{data.name}: {weights_name(args)} was trained on {len(trained_on)} of its classes "
              f"({', '.join(trained_on)}): evaluated on those (--classes)")
    if c.num_classes != data.num_classes or c.in_chans != data.in_chans:
        raise ValueError(f"{weights_name(args)} has {c.num_classes} classes / {c.in_chans} channels but {data.name} "
                         f"has {data.num_classes} / {data.in_chans}")
    if "mean" not in pre:
        pre = {**pre, **dict(zip(("mean", "std"), data.mean_std()))}
    device = torch.device("cpu") if onnx else resolve_device(args.device)
    fast = model if onnx else optimize_for_inference(
        model.to(device), "auto" if args.precision == "auto" else dtype_of(args.precision), batch_size=args.batch_size)
    split = data.val if args.split == "val" else data.train
    m = evaluate(fast, split, normalizer(pre, c), c.num_classes, device, args.batch_size)
    names = pre.get("class_names") or data.classes
    if onnx:
        print(f"{data.name} {args.split}: {m['n']} images, onnxruntime, "
              + (f"int8 ({model.int8})" if model.int8 else "fp32"))
    else:
        print(f"{data.name} {args.split}: {m['n']} images, {fast.precision}"
              + (" (auto: the faster here; --precision fp32 for exact fp32)" if args.precision == "auto" else ""))
    print(f"top-1 {m['top1']:.2f}%  top-5 {m['top5']:.2f}%  loss {m['loss']:.4f}")
    width = max(len(n) for n in names)
    for n, a in zip(names, m["per_class_acc"]):
        print(f"  {n:<{width}}  {a:6.2f}%")
    out = Path(args.out) if args.out else default_eval_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({"dataset": data.name, "split": args.split, "classes": names, **m},
                                              indent=1))
    plot_confusion(m["confusion"], names, out / "confusion.png",
                   f"{data.name} {args.split}: top-1 {m['top1']:.2f}%")
    print(f"wrote {out / 'eval.json'} and {out / 'confusion.png'}")
    return 0


def default_eval_folder(args: argparse.Namespace) -> Path:
    """``CHECKPOINT/eval`` for a checkpoint folder; ``NAME.SUFFIX.eval/`` beside a single file (a timm .safetensors,
    a JAX .npz, an ONNX file): never inside another checkpoint's folder, never in place of a file."""
    if not args.checkpoint:
        return Path("eval") / args.weights_model.replace("/", "_")
    ckpt = Path(args.checkpoint)
    return ckpt / "eval" if ckpt.is_dir() else ckpt.with_name(ckpt.name + ".eval")
