"""Training throughput in one run, timed round-robin: vitkit's trainer against a plain fp32 loop over the same
model (the tutorial's DataLoader of PIL images + ToTensor) and plain loops over in-memory tensors (fp32 and
bf16 autocast; vitkit's model and, where it has the model, timm's). The trainer's settings are planned as
`vitkit train` plans them (every ``auto`` timed here).

    python benchmarks/train_throughput.py [--steps 40] [--repeats 3] [--models 30min 5min tutorial]
                                          [--precision auto|fp32|bf16] [--compile auto|true|false]

Models: ``30min`` is the Fashion-MNIST recipe (conv:32,32 stem, depth 6), ``5min`` the recipe's tier that a
5-minute budget picks on this machine, ``tutorial`` a plain patch-7 ViT (width 128, depth 3, no stem, batch 128).
Prints img/s for each and the ratios. Not a test: numbers, no assertions.
"""
import argparse
import platform

import torch

from vitkit.bench.timing import interleaved_throughput
from vitkit.bench.training import plain_loop_steps, vitkit_train_steps
from vitkit.data.datasets import load_dataset
from vitkit.interop.timm import timm_model
from vitkit.training.build import build_model
from vitkit.training.config import TrainConfig, read_recipe
from vitkit.training.plan import make_plan

# name: (the --time-limit whose tier is taken, model overrides, other TrainConfig overrides)
MODELS = {"30min": (None, {}, {}), "5min": (5, {}, {}),
          "tutorial": (None, {"hybrid": None, "depth": 3}, {"batch_size": 128})}

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=40, help="training steps per timed call")
p.add_argument("--repeats", type=int, default=3, help="timed calls of each, round-robin (the median counts)")
p.add_argument("--dataset", default="fashion-mnist")
p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help="the trainer's precision")
p.add_argument("--compile", choices=("auto", "true", "false"), default="auto", help="the trainer's compile setting")
args = p.parse_args()

data = load_dataset(args.dataset)
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
LOOPS = [("plain loop, PIL DataLoader, fp32 (tutorial)", "fp32", True),
         ("plain loop, tensors in memory, fp32", "fp32", False),
         ("plain loop, tensors in memory, bf16 autocast", "bf16", False)]
for key in args.models:
    time_limit, model_overrides, overrides = MODELS[key]
    r = read_recipe(args.dataset)
    settings = {"precision": args.precision, "time_limit": time_limit,
                "compile": {"true": True, "false": False}.get(args.compile, args.compile)}
    cfg = TrainConfig(**{**r, **overrides, **settings, "dataset": args.dataset,
                         "model_args": {**r.get("model_args", {}), **model_overrides}})
    cfg, the_plan = make_plan(cfg, data, args.dataset, log=lambda s: None)
    print(f"\n[{key}] model: {cfg.model} {cfg.model_args}, batch {cfg.batch_size}")
    names = [f"vitkit trainer ({cfg.precision}, compile={cfg.compile}, batch augmentation on tensors)"]
    runs = [vitkit_train_steps(cfg, data, args.steps, plan=the_plan)]
    for name, precision, pil in LOOPS:
        for impl in ("vitkit model", "timm model"):
            torch.manual_seed(0)
            model = build_model(cfg, data)
            if impl == "timm model" and model.config.hybrid:
                continue  # timm has no such stem (vitkit bench compares with timm on the recipe's ViT without it)
            if impl == "timm model":
                model = timm_model(model.config)
            names.append(f"{name} [{impl}]")
            runs.append(plain_loop_steps(model, data, cfg.batch_size, args.steps, precision, pil=pil))
    rates = interleaved_throughput(runs, args.steps * cfg.batch_size, warmup=0, repeats=args.repeats)
    print(f"{names[0]:<62} {rates[0]:8.1f} img/s")
    for name, rate in zip(names[1:], rates[1:]):
        print(f"{name:<62} {rate:8.1f} img/s   vitkit trainer is {rates[0] / rate:.2f}x", flush=True)
