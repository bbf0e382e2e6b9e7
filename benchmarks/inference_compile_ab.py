"""A/B in one process: vitkit's eager and compiled inference paths (compiled with and without vitkit's AMX
attention kernel, vitkit/runtime/kernels) against timm, Hugging Face and torchvision with bf16 weights, timed
round-robin (each repeat runs every one once), on identical weights and inputs.

    python benchmarks/inference_compile_ab.py [--model vit_base_patch16_224] [--batch 16] [--repeats 8]
"""
import argparse

import torch

import vitkit
from vitkit.bench.inference import PEERS, _runner
from _helpers import exit_unless_native_bf16
from vitkit.bench.timing import interleaved_throughput

p = argparse.ArgumentParser()
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--repeats", type=int, default=8)
args = p.parse_args()

exit_unless_native_bf16()
torch.manual_seed(0)
model = vitkit.create_model(args.model).eval()
with torch.no_grad():
    model.head.weight.normal_(0, 0.02)
x = torch.randn(args.batch, 3, *vitkit.model.config.to_2tuple(model.config.img_size))
eager = vitkit.optimize_for_inference(model)
compiled = vitkit.optimize_for_inference(model, compile=True)
sdpa_compiled = vitkit.optimize_for_inference(model, compile=True, cpu_kernel=False)
eager_kernel = vitkit.optimize_for_inference(model, cpu_kernel=True)
names = ["vitkit optimize_for_inference", "vitkit optimize_for_inference(compile=True)",
         "  the same, cpu_kernel=False (PyTorch's SDPA)", "vitkit optimize_for_inference(cpu_kernel=True)"]
fns = [lambda: eager(x), lambda: compiled(x), lambda: sdpa_compiled(x), lambda: eager_kernel(x)]
for peer, make in PEERS.items():
    names.append(f"{peer}, bf16 weights")
    fns.append(_runner(make(model).eval(), x, "bf16-weights"))
for fn in fns:
    fn()  # compile and warm up before the timed round-robin
speeds = interleaved_throughput(fns, args.batch, repeats=args.repeats)
best_peer = max(speeds[4:])
print(f"{args.model}, batch {args.batch}, bf16, {torch.get_num_threads()} threads, torch {torch.__version__}")
for n, s in zip(names, speeds):
    print(f"{n:<46} {s:8.2f} img/s   {s / best_peer:.2f}x the best peer")
