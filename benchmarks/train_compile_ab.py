"""A/B in one process: a training step of a Fashion-MNIST model compiled by torch.compile with Inductor's defaults
(what ``vitkit.runtime.compile_for_training`` uses), with ``cpp_wrapper`` (the step's kernels called from C++ instead
of Python) and with ``mode="max-autotune"`` (Inductor benchmarks its own C++ GEMMs against oneDNN's per matmul),
timed round-robin; also the time of each variant's compile and first call (the later variants reuse kernels the
earlier ones put in Inductor's cache, so only the differences are meaningful).

    python benchmarks/train_compile_ab.py [--depth 3] [--hybrid conv:32,32|none] [--batch 128] [--steps 20]
                                          [--precision bf16|fp32]

Measured (2-core AVX-512/AMX CPU): cpp_wrapper 0.978x, 0.987x, 0.984x in three runs of the 5-minute model at batch
128 (AdamW for-each step), then 1.056x (defaults), 0.983x / 1.002x (``--depth 6``, the 30-minute model) and 1.001x
(``--hybrid none``, the issue's tutorial model); max-autotune 0.954x, 0.934x and 0.919x in the same three runs ->
neither is used.
"""
import argparse
import time

import torch

import vitkit
from vitkit.bench.timing import interleaved_throughput
from _helpers import fashion_mnist_vit_config, steps_on_one_batch
from vitkit.runtime import configure_for_training

p = argparse.ArgumentParser()
p.add_argument("--depth", type=int, default=3, help="3: the 5-minute model, 6: the 30-minute one")
p.add_argument("--hybrid", default="conv:32,32", help="the conv stem, or 'none' for the plain patch-7 ViT")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--steps", type=int, default=20, help="training steps per timed call")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
               help="bf16 autocast (the AMX trainer) or fp32 (a CPU without native bf16)")
args = p.parse_args()

torch.manual_seed(0)
cfg = fashion_mnist_vit_config(args.depth, args.hybrid)
x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
VARIANTS = {"torch.compile (Inductor defaults)": {},
            "torch.compile, cpp_wrapper=True": {"options": {"cpp_wrapper": True}},
            "torch.compile, mode='max-autotune'": {"mode": "max-autotune"}}


def trainer_step(compile_kwargs: dict):
    model = vitkit.VisionTransformer(cfg)
    configure_for_training(model, torch.device("cpu"), args.precision, compiled=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the trainer's optimizer step
    compiled = torch.compile(model, **compile_kwargs)
    start = time.perf_counter()
    steps_on_one_batch(compiled, opt, x, y, 1, args.precision)()
    print(f"compile + first step {time.perf_counter() - start:6.1f} s  {compile_kwargs or 'defaults'}", flush=True)
    return steps_on_one_batch(compiled, opt, x, y, args.steps, args.precision)


fns = [trainer_step(kw) for kw in VARIANTS.values()]
rates = interleaved_throughput(fns, args.batch * args.steps, warmup=1, repeats=args.repeats)
print(f"model {cfg.depth=} {cfg.hybrid=}, batch {args.batch}, {args.precision}")
for name, r in zip(VARIANTS, rates):
    print(f"{name:40s} {r:8.1f} img/s   {r / rates[0]:.3f}x")
