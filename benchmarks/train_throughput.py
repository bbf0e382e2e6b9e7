"""Training throughput of the Fashion-MNIST recipe in one run: vitkit's trainer against a plain fp32 loop
(the tutorial's DataLoader of PIL images + ToTensor) and plain loops over timm's same model (fp32, bf16 autocast).

    python benchmarks/train_throughput.py [--steps 40]

Prints img/s for each and the ratios. Not a test: numbers, no assertions.
"""
import argparse
import platform

import torch

from vitkit.bench.training import plain_loop_throughput, vitkit_train_throughput
from vitkit.data.datasets import load_dataset
from vitkit.interop.timm import timm_kwargs
from vitkit.model.vit import VisionTransformer
from vitkit.training.config import TrainConfig, recipe
from vitkit.training.trainer import build_model

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--dataset", default="fashion-mnist")
args = p.parse_args()

data = load_dataset(args.dataset)
cfg = TrainConfig(**{**recipe(args.dataset), "dataset": args.dataset})
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
print(f"model: {cfg.model} {cfg.model_args}, batch {cfg.batch_size}")
ours = vitkit_train_throughput(cfg, data, args.steps)
print(f"vitkit trainer ({cfg.precision}, batch augmentation on tensors):  {ours:8.1f} img/s")
results = {}
for name, precision, pil in (("plain loop, PIL DataLoader, fp32 (tutorial)", "fp32", True),
                             ("plain loop, tensors in memory, fp32", "fp32", False),
                             ("plain loop, tensors in memory, bf16 autocast", "bf16", False)):
    for impl in ("vitkit model", "timm model"):
        torch.manual_seed(0)
        model = build_model(cfg, data)
        if impl == "timm model" and model.config.hybrid:
            continue  # timm has no such stem (vitkit bench compares with timm on the recipe's ViT without it)
        if impl == "timm model":
            from timm.models.vision_transformer import VisionTransformer as TimmViT

            model = TimmViT(**timm_kwargs(model.config))
        r = plain_loop_throughput(model, data, cfg.batch_size, args.steps, precision, pil=pil)
        results[(name, impl)] = r
        print(f"{name:<46} [{impl}]: {r:8.1f} img/s   vitkit trainer is {ours / r:.2f}x")
