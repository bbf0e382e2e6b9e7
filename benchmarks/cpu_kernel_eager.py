"""Eager bf16 inference with and without vitkit's AMX attention kernel (``optimize_for_inference(model)`` vs
``optimize_for_inference(model, cpu_kernel=True)``), round-robin, on the recipes' small models at evaluation batch
256 and on ViT-S/16 and ViT-B/16 at batch 16 (docs/speed.md). Numbers only.

    python benchmarks/cpu_kernel_eager.py [--repeats 6]
"""
import argparse

import torch

import vitkit
from _helpers import exit_unless_native_bf16
from vitkit.bench.timing import interleaved_throughput
from _helpers import recipe_vit_config
from vitkit.model.registry import get_config

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=6)
args = p.parse_args()

MODELS = {  # name: (config, batch); the recipes' models read from their configs/*.yaml
    "Fashion-MNIST 30-minute recipe": (recipe_vit_config("fashion-mnist", in_chans=1, num_classes=10), 256),
    "CIFAR-10 recipe": (recipe_vit_config("cifar10", num_classes=10), 256),
    "ViT-S/16": (get_config("vit_small_patch16_224", num_classes=10), 16),
    "ViT-B/16": (get_config("vit_base_patch16_224", num_classes=10), 16),
}
exit_unless_native_bf16()
torch.manual_seed(0)
print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, bf16 weights, eager")
for name, (cfg, batch) in MODELS.items():
    model = vitkit.VisionTransformer(cfg).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    x = torch.randn(batch, cfg.in_chans, *vitkit.model.config.to_2tuple(cfg.img_size))
    sdpa, kernel = vitkit.optimize_for_inference(model), vitkit.optimize_for_inference(model, cpu_kernel=True)
    diff = (sdpa(x) - kernel(x)).abs().max().item()
    s = interleaved_throughput([lambda: sdpa(x), lambda: kernel(x)], batch, repeats=args.repeats)
    print(f"{name:<32} batch {batch:>3}: SDPA {s[0]:7.1f}  kernel {s[1]:7.1f} img/s  ({s[1] / s[0]:.3f}x; "
          f"logits differ by {diff:.3g})")
