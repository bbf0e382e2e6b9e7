"""How long the trainer's evaluation of 10,000 images takes at each evaluation batch size, for the shipped recipes'
models (what ``--eval-batch-size`` and its default are chosen from). Calls vitkit's own ``evaluate`` (bf16 autocast, or
fp32 with ``--precision fp32``; the exact attention path the trainer leaves set) on random uint8 images, timed
round-robin in one process.

    python benchmarks/eval_batch.py [--batches 64 128 256 512 1024] [--repeats 3] [--precision fp32]
"""
import argparse

import torch

from vitkit.bench.timing import interleaved_throughput
from vitkit.data.augment import BatchAugment
from vitkit.data.datasets import ImageTensors
from vitkit.model.registry import create_model
from vitkit.runtime import configure_for_training
from vitkit.training.config import recipe
from vitkit.training.evaluate import evaluate

p = argparse.ArgumentParser()
p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
args = p.parse_args()

N = 10_000
device = torch.device("cpu")
print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; seconds to evaluate {N:,} images "
      f"({args.precision})")
for name, minutes, chans, size in [("fashion-mnist", 5, 1, 28), ("fashion-mnist", 30, 1, 28), ("cifar10", 30, 3, 32)]:
    r = recipe(name, minutes)
    model = create_model(r["model"], **{**r["model_args"], "in_chans": chans, "num_classes": 10})
    configure_for_training(model, device, "bf16")
    g = torch.Generator().manual_seed(0)
    data = ImageTensors(torch.randint(0, 256, (N, chans, size, size), dtype=torch.uint8, generator=g),
                        torch.randint(0, 10, (N,), generator=g))
    augment = BatchAugment([0.5] * chans, [0.25] * chans, (size, size), 10)

    def run(b: int):
        return lambda: evaluate(model, data, augment, 10, device, b, args.precision)
    rates = interleaved_throughput([run(b) for b in args.batches], N, warmup=1, repeats=args.repeats)
    print(f"{name} --time-limit {minutes} ({r['model_args']}):")
    print("  " + "  ".join(f"batch {b}: {N / rate:5.2f} s" for b, rate in zip(args.batches, rates)))
