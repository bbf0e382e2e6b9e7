"""Where the time of the trainer's compiled training step goes (bf16 autocast, or --precision fp32), by kind of
kernel (torch.profiler, with Inductor's per-kernel records on), for a Fashion-MNIST model on a fixed batch; and the
step time without the profiler. ``--eager``: the uncompiled step, as ``compile: auto`` runs fp32 on an AVX2-only
CPU, with its largest operators instead of Inductor's kernels.

    python benchmarks/train_step_profile.py [--depth 3] [--hybrid none|conv:32,32] [--batch 128] [--steps 10]
                                            [--precision bf16|fp32] [--eager]

The defaults are the issue's tutorial model (plain patch-7 ViT, width 128, depth 3, batch 128). Used in docs/speed.md
to explain why the trainer is 2.2-2.5x a plain fp32 loop and not 4x. Not a test: numbers, no assertions.
"""
import argparse
import time
from collections import defaultdict

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch.profiler import profile
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from _helpers import fashion_mnist_vit_config, steps_on_one_batch
from vitkit.runtime import compile_for_training, configure_for_training

KINDS = {"aten::mm": "matmuls (oneDNN)", "aten::addmm": "matmuls (oneDNN)", "aten::bmm": "matmuls (oneDNN)",
         "aten::mkldnn_convolution": "convolutions (oneDNN)", "aten::convolution_backward": "convolutions (oneDNN)",
         "aten::copy_": "copies and casts outside Inductor's kernels", "aten::_fused_adamw_": "AdamW (fused step)"}

p = argparse.ArgumentParser()
p.add_argument("--depth", type=int, default=3)
p.add_argument("--hybrid", default="none", help="the conv stem (the recipes: conv:32,32), or 'none'")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
p.add_argument("--eager", action="store_true", help="the step uncompiled (attention as the eager trainer runs it)")
args = p.parse_args()

inductor_config.cpp.enable_kernel_profile = True  # a profiler record per generated C++ kernel
torch.manual_seed(0)
cfg = fashion_mnist_vit_config(args.depth, args.hybrid)
model = vitkit.VisionTransformer(cfg)
configure_for_training(model, torch.device("cpu"), args.precision, compiled=not args.eager)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
with FlopCounterMode(display=False) as flops:  # one forward + backward, counted on the uncompiled model
    F.cross_entropy(model(x), y).backward()
model.zero_grad(set_to_none=True)
run = steps_on_one_batch(model if args.eager else compile_for_training(model, torch.device("cpu")), opt, x, y,
                         args.steps, args.precision)
run()
run()
start = time.perf_counter()
run()
step_ms = (time.perf_counter() - start) / args.steps * 1e3
with profile() as prof:
    run()

rest = ("everything else (pointwise, norms, attention, Python, autograd, dispatch)" if args.eager else
        "everything else (Python, autograd, dispatch)")  # eager: no Inductor kernels take those
by_kind: dict[str, float] = defaultdict(float)
others: dict[str, float] = {}  # Inductor's kernels (compiled) or the other operators (eager), by name
for e in prof.key_averages():
    ms = e.self_cpu_time_total / 1e3 / args.steps
    if "cpp_fused" in e.key:
        by_kind["Inductor's generated kernels (pointwise, norms, softmax)"] += ms
        others[e.key] = ms
    else:
        by_kind[KINDS.get(e.key, rest)] += ms
        if args.eager and e.key not in KINDS:
            others[e.key] = ms
total = sum(by_kind.values())
print(f"model depth {cfg.depth}, hybrid {cfg.hybrid}, batch {args.batch}, {args.precision}, "
      f"{'eager' if args.eager else 'compiled'}: {step_ms:.1f} ms per step "
      f"without the profiler ({args.batch / step_ms * 1e3:.0f} img/s), {total:.1f} ms with it")
matmul_ms = by_kind["matmuls (oneDNN)"]
print(f"  {flops.get_total_flops() / 1e9:.2f} GFLOP per step (FlopCounterMode): the matmuls run at "
      f"≈{flops.get_total_flops() / matmul_ms / 1e6:.0f} GFLOP/s (all of the step's FLOPs over the matmuls' time)")
for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    print(f"  {ms:6.2f} ms  {ms / total:5.1%}  {kind}")
title = "the other operators" if args.eager else "Inductor's kernels"
print(f"largest of {title} (ms per step):")
for name, ms in sorted(others.items(), key=lambda kv: -kv[1])[:10 if args.eager else 6]:
    print(f"  {ms:6.2f} ms  {name[:90]}")
