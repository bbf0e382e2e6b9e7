"""Where a compiled bf16 ViT-B/16 forward spends its time: torch.profiler over three batch-16 forwards of
``optimize_for_inference(model, compile=True)`` (docs/speed.md), by operator and by operator and input shape.

    python benchmarks/inference_profile.py [--batch 16] [--no-kernel]

Set TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 to see Inductor's generated kernels by name. Numbers only.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import vitkit

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--no-kernel", action="store_true", help="PyTorch's SDPA instead of vitkit's attention kernel")
args = p.parse_args()

torch.manual_seed(0)
model = vitkit.create_model("vit_base_patch16_224").eval()
fast = vitkit.optimize_for_inference(model, compile=True, cpu_kernel=not args.no_kernel)
x = torch.randn(args.batch, 3, 224, 224)
for _ in range(3):
    fast(x)  # compile and warm up
times = []
for _ in range(6):
    t0 = time.perf_counter()
    fast(x)
    times.append(time.perf_counter() - t0)
print(f"ms per forward (batch {args.batch}): {', '.join(f'{t * 1e3:.1f}' for t in times)}; "
      f"best {args.batch / min(times):.1f} img/s")
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for _ in range(3):
        fast(x)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=8,
                                                          max_name_column_width=40, max_shapes_column_width=90))
