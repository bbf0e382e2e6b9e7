"""``vitkit bench``: the machine's matmul ceiling, then inference and training img/s of vitkit and its peers
(timm, Hugging Face, torchvision) on identical weights and inputs, in one process. A table and JSON.
``vitkit bench --time-to-accuracy RUN``: the cold-start time-to-accuracy rows of docs/results.md instead."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from .common import positive_int


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="vit_base_patch16_224,vit_small_patch16_224",
                   help="model presets to time, joined by commas (`vitkit models`)")
    p.add_argument("--batches", default="1,16", help="inference batch sizes to time, joined by commas")
    p.add_argument("--dtypes", default="auto",
                   help="groups to time, of auto,fp32,bf16 (default auto: vitkit as `optimize_for_inference(model)` "
                        "chooses here, against every peer in fp32 and in bf16, so its ratio is to the best peer in "
                        "that peer's fastest dtype)")
    p.add_argument("--peers", default="timm,hf,torchvision,onnxruntime",
                   help="implementations to time on the same weights (onnxruntime: the fp32 ONNX export)")
    p.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                   help="also time vitkit's int8 ONNX export (`vitkit export --int8`; fp32 rows, needs the onnx "
                        "extra); its logits differ a little, so the table gives its relative error")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the torch.compile'd vitkit model (max-autotune + freezing; ~15-25 s to compile "
                        "per model, batch and dtype); --no-compile to skip")
    p.add_argument("--device", default="auto",
                   help="where the inference rows run: auto (the GPU where there is one), cpu, cuda, cuda:N; on a GPU "
                        "each row also reports the peak GPU memory (the training rows stay on the CPU)")
    p.add_argument("--no-train", action="store_true", help="skip the training-throughput part")
    p.add_argument("--train-steps", type=positive_int, default=40,
                   help="training steps timed per loop, in three parts taken round-robin")
    p.add_argument("--no-infer", action="store_true", help="skip the inference part")
    p.add_argument("--json", default=None, help="write all rows here")
    p.add_argument("--time-to-accuracy", default=None, metavar="RUN[,RUN]",
                   help="instead of the throughput runs: the time-to-accuracy rows of docs/results.md (digits, "
                        "fmnist5, fmnist30, cifar30), each `vitkit train` with the shipped recipe in a fresh process "
                        "with an empty Inductor cache; prints top-1, epochs and wall time. Run nothing else on the "
                        "machine meanwhile")
    p.add_argument("--data-dir", default=None, help="time-to-accuracy: the dataset (cifar30: default "
                                                    "../shared/data/cifar10-jpg.zip)")
    p.add_argument("--runs-dir", default="runs", help="time-to-accuracy: where the run folders go")
    p.add_argument("--keep-cache", action="store_true", help="time-to-accuracy: keep Inductor's cache (warm start)")


def run(args: argparse.Namespace) -> int:
    if args.time_to_accuracy:
        return _time_to_accuracy(args)
    import torch

    from ..bench.inference import bench_inference
    from ..bench.timing import matmul_ceiling
    from ..runtime.cpu import cpu_kind
    from ..runtime.device import resolve_device

    device = resolve_device(args.device)
    dtypes = args.dtypes.split(",")
    bad = sorted(set(dtypes) - {"auto", "fp32", "bf16"})
    if bad:
        raise ValueError(f"--dtypes takes auto, fp32 and bf16, got {', '.join(bad)}")
    print(f"machine: {cpu_kind()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
          + (f"; inference on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""), flush=True)

    from ..runtime.cpu import BF16_SLOW, bf16_matmul_slowdown

    # a CPU that emulates bf16 (AVX2 only: its matmuls ~100x fp32's) took minutes on the bf16 ceiling's 2048^3
    # matmuls, printing nothing: timed only where bf16 keeps up (the training planner's check, ~0.1 s)
    slow = bf16_matmul_slowdown() if device.type == "cpu" else 1.0
    if slow >= BF16_SLOW:
        print(f"bf16 matmul ceiling not timed: its matmuls take {slow:.1f}x fp32's on this CPU (emulated)")

    def measure_ceiling(when: str) -> dict[str, float]:  # on the inference rows' device
        n = 8192 if device.type == "cuda" else 2048
        c = {"fp32": matmul_ceiling(torch.float32, n, device)}
        if slow < BF16_SLOW:
            c["bf16"] = matmul_ceiling(torch.bfloat16, n, device)
        print(f"matmul ceiling{when}: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in c.items()), flush=True)
        return c

    ceiling = measure_ceiling("")
    rows = []
    if not args.no_infer:
        groups = [(n, int(b), dt) for n in args.models.split(",") for b in args.batches.split(",") for dt in dtypes]
        for k, (name, b, dt) in enumerate(groups, 1):
            print(f"[{k}/{len(groups)}] inference {name} batch {b} {dt} ...", flush=True)
            rows += bench_inference(name, b, dt, tuple(p for p in args.peers.split(",") if p), repeats=args.repeats,
                                    compile=args.compile, int8=args.int8, device=device)
    if not args.no_train:
        print("training throughput ...", flush=True)
        rows += _train_rows(args.train_steps)
    # measured again at the end, the best of the two kept: the machine drifts (±10% over minutes here), and a
    # ceiling caught in a slow moment would flatter every "of ceiling" figure
    again = measure_ceiling(" again, the higher of the two is used")
    ceiling = {k: max(v, again[k]) for k, v in ceiling.items()}
    ceiling.setdefault("bf16", float("nan"))
    for r in rows:
        peers = [o["img_s"] for o in rows if o["impl"] not in ("vitkit",) and
                 (o["model"], o["batch"], o["dtype"], o.get("task")) == (r["model"], r["batch"], r["dtype"],
                                                                         r.get("task"))]
        r["ratio_to_best_peer"] = r["img_s"] / max(peers) if peers else None
        flop_s = r["gflop_per_img"] * 1e9 * r["img_s"] * (3 if r.get("task") == "train" else 1)
        same_device = r.get("task") != "train" or device.type == "cpu"  # the ceiling is the inference device's
        r["frac_of_ceiling"] = flop_s / ceiling.get(r["compute"], float("nan")) if same_device else float("nan")
    print(f"\n{'task':<6}{'model':<26}{'b':>4} {'dtype':<5} {'impl':<12}{'mode':<27}{'img/s':>9} "
          f"{'vs best peer':>13} {'of ceiling':>11}")
    for r in rows:
        ratio = f"{r['ratio_to_best_peer']:.2f}x" if r["ratio_to_best_peer"] else "-"
        print(f"{r.get('task', 'infer'):<6}{r['model']:<26}{r['batch']:>4} {r['dtype']:<5} {r['impl']:<12}"
              f"{r['mode']:<27}{r['img_s']:>9.1f} {ratio:>13} " + (f"{100 * r['frac_of_ceiling']:>10.0f}%"
                                                                   if r["frac_of_ceiling"] == r["frac_of_ceiling"]
                                                                   else f"{'-':>11}"))
    for r in rows:
        if r["compute"] == "int8":
            print(f"{r['model']} b{r['batch']} int8: logits {100 * r['max_abs_diff']:.1f}% off fp32 (relative, random "
                  "inputs); its accuracy on your data: `vitkit export --int8`, then `vitkit eval`")
    print(f"(measured on {cpu_kind()})")
    _write_json(args.json, {"cpu": cpu_kind(), "ceiling_flop_s": ceiling, "rows": rows})
    return 0


def _time_to_accuracy(args: argparse.Namespace) -> int:
    from ..bench.tta import time_to_accuracy, train_args

    names = args.time_to_accuracy.split(",")
    for name in names:  # every name and data path checked before the first run starts
        train_args(name, args.data_dir)
    rows = []
    for name in names:
        print(f"time to accuracy, {name}:", flush=True)
        rows.append(time_to_accuracy(name, args.runs_dir, args.data_dir, args.keep_cache))
    print(f"\n{'run':<10}{'top-1':>8}{'epochs':>8}{'elapsed s':>11}{'wall s':>9}  cache  command")
    for r in rows:
        print(f"{r['name']:<10}{r['val_top1']:>7.2f}%{r['epochs']:>8}{r['elapsed_s']:>11.1f}{r['wall_s']:>9.1f}  "
              f"{'cold' if r['cold_cache'] else 'warm'}   {r['command']}")
    _write_json(args.json, {"rows": rows})
    return 0


def _write_json(path: str | None, result: dict) -> None:
    """--json: every row of the run, for scripts."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def _train_rows(steps: int) -> list[dict]:
    """The Fashion-MNIST recipe's model: vitkit's trainer (its settings planned here, as `vitkit train` plans them)
    vs plain loops over timm's same model in fp32 and bf16."""
    import dataclasses

    import torch

    from ..bench.timing import interleaved_throughput
    from ..bench.training import plain_loop_steps, vitkit_train_steps
    from ..data.datasets import load_dataset
    from ..interop.timm import timm_model
    from ..model.vit import flops_per_image
    from ..training.build import build_model
    from ..training.config import TrainConfig, read_recipe
    from ..training.plan import make_plan

    try:
        data = load_dataset("fashion-mnist")
        name = "fashion-mnist"
    except (FileNotFoundError, ValueError):
        data, name = load_dataset("digits"), "digits"
    cfg = TrainConfig(**{**read_recipe(name), "dataset": name, "tiers": None})
    # timm has no conv stem: the comparison is on the recipe's ViT without its hybrid stem
    cfg = dataclasses.replace(cfg, model_args={k: v for k, v in cfg.model_args.items() if k != "hybrid"})
    cfg, the_plan = make_plan(cfg, data, name, log=lambda s: None)
    model = build_model(cfg, data)
    gf = flops_per_image(model.config) / 1e9
    rows = []
    precision = cfg.precision

    def row(impl: str, mode: str, img_s: float, compute: str) -> None:  # all grouped under the trainer's precision
        rows.append({"task": "train", "model": f"{name}-recipe-vit", "batch": cfg.batch_size, "dtype": precision,
                     "compute": compute, "impl": impl, "mode": mode, "img_s": img_s, "gflop_per_img": gf})
        print(f"  train {name}-recipe-vit b{cfg.batch_size} {impl:<11} {mode:<22} {img_s:8.1f} img/s")

    # --train-steps in all, timed round-robin in three parts: the machine's drift falls on every loop alike
    part = max(steps // 3, 1)
    runs = [("vitkit", f"trainer ({precision}, planned)", precision, vitkit_train_steps(cfg, data, part, the_plan))]
    loops = [("plain loop (fp32)", "fp32", False), ("plain loop (bf16)", "bf16", False),
             ("tutorial loop (PIL, fp32)", "fp32", True)]
    if importlib.util.find_spec("timm") is None:
        loops = []  # the trainer's row alone
    for mode, loop_precision, pil in loops:
        torch.manual_seed(0)
        ref = timm_model(model.config)
        runs.append(("timm", mode, loop_precision,
                     plain_loop_steps(ref, data, cfg.batch_size, part, loop_precision, pil=pil)))
    rates = interleaved_throughput([run for *_, run in runs], part * cfg.batch_size, warmup=0, repeats=3)
    for (impl, mode, compute, _), img_s in zip(runs, rates):
        row(impl, mode, img_s, compute)
    return rows
