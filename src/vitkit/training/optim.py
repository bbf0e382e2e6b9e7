"""Optimiser with the usual ViT parameter groups, and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """No weight decay on norms, biases, position embedding and class token; ``body_lr_scale`` for all but the head."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups: dict[tuple[bool, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip
        head = name.startswith("head.")
        g = groups.setdefault((no_decay, head), {
            "params": [], "weight_decay": 0.0 if no_decay else cfg.weight_decay,
            "lr_scale": 1.0 if head else cfg.body_lr_scale})
        g["params"].append(p)
    return list(groups.values())


def freeze_body(model: torch.nn.Module) -> int:
    """Train the head alone (the paper's linear evaluation of pretrained features): every other parameter is frozen.
    Returns how many parameters still train."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD with momentum), fused into one kernel per step on CPU and CUDA: for the 5-minute
    Fashion-MNIST model AdamW's step takes 0.6 ms fused vs 2.0 ms with the default for-each path, and the whole
    compiled training step runs at 2,214 vs 2,042 img/s (benchmarks/train_step_ab.py, batch 128)."""
    groups = param_groups(model, cfg)
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    if cfg.opt == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=False, fused=fused)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), fused=fused)


def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay from ``lr`` to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
