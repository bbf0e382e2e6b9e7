"""A/B in one process: the compiled bf16 training step of the 5-minute Fashion-MNIST model (the recipe's
``--time-limit 5`` settings) at batch 32 / 64 / 128, with AdamW's fused step (what the trainer uses) and its
for-each step, timed round-robin on the same number of images per call. This is where "batch 64 costs no more per
image than 128" and "the fused step is faster" come from (docs/speed.md).

    python benchmarks/train_step_ab.py [--images 2560] [--repeats 5]
"""
import argparse

import torch

from vitkit.bench.timing import interleaved_throughput
from _helpers import steps_on_one_batch
from vitkit.model.registry import create_model
from vitkit.runtime import configure_for_training
from vitkit.training.config import recipe

p = argparse.ArgumentParser()
p.add_argument("--images", type=int, default=2560, help="images per timed call (a multiple of every batch size)")
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()

r = recipe("fashion-mnist", 5)
model_args = {**r["model_args"], "in_chans": 1, "num_classes": 10}


def step_fn(batch: int, fused: bool):
    torch.manual_seed(0)
    model = create_model(r["model"], **model_args)
    configure_for_training(model, torch.device("cpu"), "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    step_model = torch.compile(model)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return steps_on_one_batch(step_model, opt, x, y, args.images // batch)


variants = [(b, f) for b in (32, 64, 128) for f in (True, False)]
print(f"model {r['model']} {model_args}; {torch.get_num_threads()} threads, torch {torch.__version__}")
rates = interleaved_throughput([step_fn(b, f) for b, f in variants], args.images, warmup=2, repeats=args.repeats)
for (b, f), rate in zip(variants, rates):
    print(f"batch {b:4d}  AdamW {'fused   ' if f else 'for-each'}  {rate:8.1f} img/s")
