"""Eager bf16 inference with and without vitkit's AMX attention kernel (``optimize_for_inference(model)`` vs
``optimize_for_inference(model, cpu_kernel=True)``), round-robin, on the recipes' small models at evaluation batch
256 and on ViT-S/16 and ViT-B/16 at batch 16 (README, Speed). Numbers only.

    python benchmarks/cpu_kernel_eager.py [--repeats 6]
"""
import argparse

import torch

import vitkit
from vitkit.bench.timing import interleaved_throughput

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=6)
args = p.parse_args()

MODELS = {  # name: (create_model arguments, batch, input shape)
    "Fashion-MNIST 30-minute recipe": (dict(model="vit_micro_patch4_32", img_size=28, patch_size=7, embed_dim=128,
                                            depth=6, num_heads=4, hybrid="conv:32,32", in_chans=1), 256, (1, 28, 28)),
    "CIFAR-10 recipe": (dict(model="vit_micro_patch4_32", img_size=32, patch_size=1, embed_dim=256, depth=4,
                             num_heads=8, hybrid="conv:64,64,M,128,128,M"), 256, (3, 32, 32)),
    "ViT-S/16": (dict(model="vit_small_patch16_224"), 16, (3, 224, 224)),
    "ViT-B/16": (dict(model="vit_base_patch16_224"), 16, (3, 224, 224)),
}
torch.manual_seed(0)
print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, bf16 weights, eager")
for name, (kwargs, batch, shape) in MODELS.items():
    model = vitkit.create_model(kwargs.pop("model"), num_classes=10, **kwargs).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    x = torch.randn(batch, *shape)
    sdpa, kernel = vitkit.optimize_for_inference(model), vitkit.optimize_for_inference(model, cpu_kernel=True)
    diff = (sdpa(x) - kernel(x)).abs().max().item()
    s = interleaved_throughput([lambda: sdpa(x), lambda: kernel(x)], batch, repeats=args.repeats)
    print(f"{name:<32} batch {batch:>3}: SDPA {s[0]:7.1f}  kernel {s[1]:7.1f} img/s  ({s[1] / s[0]:.3f}x; "
          f"logits differ by {diff:.3g})")
