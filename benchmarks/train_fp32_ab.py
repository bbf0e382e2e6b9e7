"""A/B in one process: ways to speed up an fp32 training step on a CPU, against the plain loop (eager, AdamW's
default for-each step), on a fixed batch, timed round-robin. What docs/speed.md says about the fp32 step comes
from here.

    python benchmarks/train_fp32_ab.py [--depth 6] [--hybrid conv:32,32|none] [--batch 128] [--recipe cifar10]
                                       [--variants plain fused channels_last compiled compiled_exact whole_step
                                                   plain_conv_embed ... whole_step_conv_embed]
                                       [--csv results/train-fp32-ab.csv] [--simdlen 256]

An AVX2-only CPU's instruction set can be stood in for on an AVX-512 one: ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/train_fp32_ab.py --simdlen 256`` (PyTorch's,
oneDNN's and MKL's kernels, and Inductor's generated code, all limited to 256-bit vectors; its speed is still the
AVX-512 CPU's, not an AVX2 CPU's).

Variants: ``fused`` AdamW's fused step; ``channels_last`` that and NHWC activations for the conv stem; ``compiled``
torch.compile of the model (what the trainer does) and the fused step; ``compiled_exact`` that with the exact
attention path (two matmuls and a softmax, fused by Inductor) instead of SDPA; ``whole_step`` forward, backward
(compiled autograd) and the optimizer step captured by one torch.compile; ``*_conv_embed`` the patch embedding computed
as the P x P stride-P convolution (timm's and the tutorials' way; vitkit's is one matmul over the flattened patches).
The ratios are against the first variant given. Not a test: numbers, no assertions.
"""
import argparse

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo import compiled_autograd

import vitkit
from _helpers import (append_csv_rows, cpu_label, csv_arg, fashion_mnist_vit_config, recipe_vit_config,
                      steps_on_one_batch)
from vitkit.bench.timing import interleaved_throughput

VARIANTS = ("plain", "fused", "channels_last", "compiled", "compiled_exact", "whole_step")
p = argparse.ArgumentParser()
p.add_argument("--recipe", choices=("fashion-mnist", "cifar10"), default="fashion-mnist",
               help="whose model: cifar10 times the CIFAR-10 recipe's hybrid as configured (--depth, --hybrid unused)")
p.add_argument("--depth", type=int, default=6)
p.add_argument("--hybrid", default="conv:32,32", help="the conv stem (the recipes: conv:32,32), or 'none'")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--steps", type=int, default=8, help="training steps per timed call")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--variants", nargs="+", choices=VARIANTS + tuple(f"{v}_conv_embed" for v in VARIANTS),
               default=list(VARIANTS))
p.add_argument("--csv", type=csv_arg, help="append the rows to this CSV (with the CPU kind and this command)")
p.add_argument("--simdlen", type=int, help="Inductor's vector width in bits (256: AVX2 code on an AVX-512 CPU)")
args = p.parse_args()
if args.simdlen:
    inductor_config.cpp.simdlen = args.simdlen

if args.recipe == "cifar10":
    cfg = recipe_vit_config("cifar10", in_chans=3, num_classes=10)
    args.depth, args.hybrid = cfg.depth, cfg.hybrid
else:
    cfg = fashion_mnist_vit_config(args.depth, args.hybrid)
x, y = torch.randn(args.batch, cfg.in_chans, cfg.img_size, cfg.img_size), torch.randint(0, 10, (args.batch,))


def make(variant: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = vitkit.VisionTransformer(cfg)
    inputs = x
    if variant.endswith("_conv_embed"):
        variant = variant.removesuffix("_conv_embed")
        embed = model.patch_embed
        embed.forward = lambda x: embed.proj(embed.backbone(x) if hasattr(embed, "backbone") else x).flatten(2).mT
    if variant == "channels_last":
        model, inputs = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if variant == "compiled_exact":
        model.set_attention("exact")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=variant != "plain")
    if variant != "whole_step":
        forward = torch.compile(model) if variant.startswith("compiled") else model
        return steps_on_one_batch(forward, opt, inputs, y, args.steps, precision="fp32")

    @torch.compile
    def step() -> None:
        F.cross_entropy(model(inputs), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run() -> None:
        for _ in range(args.steps):
            with compiled_autograd._enable(torch.compile(dynamic=False)):  # the backward inside the same capture
                step()
    return run


model = (f"{'' if args.recipe == 'fashion-mnist' else 'cifar10 recipe, '}depth {args.depth}, stem {args.hybrid}, "
         f"batch {args.batch}, fp32")
print(f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}, kernels "
      f"{torch.backends.cpu.get_cpu_capability()}" + (f", Inductor simdlen {args.simdlen}" if args.simdlen else ""),
      flush=True)
rates = interleaved_throughput([make(v) for v in args.variants], args.steps * args.batch, warmup=2,
                               repeats=args.repeats)
cpu = cpu_label()
first = args.variants[0]
plain = dict(zip(args.variants, rates)).get("plain")
rows = [{"cpu": cpu, "model": model, "variant": v, "img_per_s": round(r, 1),
         # the ratio column is against the plain loop: without it, the ratio to the first variant goes in the source
         **({"vs_plain_loop": round(r / plain, 2)} if plain else
            {"source": f"{r / rates[0]:.2f}x the {first} row (the plain loop not timed)"})}
        for v, r in zip(args.variants, rates)]
for v, r in zip(args.variants, rates):
    print(f"{v:26s} {r:8.1f} img/s  {r / rates[0]:.2f}x {first}")
if args.csv:
    append_csv_rows(args.csv, rows)
