"""A/B in one process: a training step of the 5-minute Fashion-MNIST model compiled by torch.compile with Inductor's
defaults (what ``vitkit.speed.compile_for_training`` uses) and with ``cpp_wrapper`` (the step's kernels called from C++
instead of Python), timed round-robin. Measured: cpp_wrapper 0.978x, 0.987x, 0.984x in three runs -> not used.

    python benchmarks/train_compile_ab.py [--steps 20] [--repeats 5]
"""
import argparse

import torch

import vitkit
from vitkit.bench.timing import interleaved_throughput
from vitkit.bench.training import bf16_steps_on_one_batch
from vitkit.speed import configure_for_training

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=128)
p.add_argument("--steps", type=int, default=20, help="training steps per timed call")
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()

torch.manual_seed(0)
cfg = vitkit.ViTConfig(img_size=28, in_chans=1, num_classes=10, patch_size=7, embed_dim=128, depth=3, num_heads=4,
                       hybrid="conv:32,32")
x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))


def trainer_step(options: dict):
    model = vitkit.VisionTransformer(cfg)
    configure_for_training(model, torch.device("cpu"), "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return bf16_steps_on_one_batch(torch.compile(model, options=options), opt, x, y, args.steps)


names = ["torch.compile (Inductor defaults)", "torch.compile, cpp_wrapper=True"]
fns = [trainer_step({}), trainer_step({"cpp_wrapper": True})]
rates = interleaved_throughput(fns, args.batch * args.steps, warmup=1, repeats=args.repeats)
for name, r in zip(names, rates):
    print(f"{name:40s} {r:8.1f} img/s   {r / rates[0]:.3f}x")
