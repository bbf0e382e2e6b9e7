"""How good an encoder's features are without fine-tuning it, the two measures self-supervised work is judged by:
a linear probe (a frozen encoder, a BatchNorm without affine parameters and a linear layer trained on its
features, as MAE's linear probing) and k-nearest-neighbour classification (DINO's weighted k-NN: the k most
cosine-similar training images vote, each with exp(similarity / T)).

The features are computed once (no augmentation: the probe is of the features, not of the augmentation), so a
probe of 100 epochs costs a few seconds beyond one pass of the encoder over the data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.augment import BatchAugment, batches
from ..runtime.precision import autocast_for

POOLS = ("cls", "mean")


@torch.no_grad()
def extract_features(model: nn.Module, split: Any, augment: BatchAugment, device: torch.device, batch_size: int = 256,
                     pool: str = "cls", precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, D) in float32, labels (N,)) of a frozen encoder over ``split``: the class token's final state
    (``cls``) or the mean of the patch tokens (``mean``), after the encoder's final norm."""
    if pool not in POOLS:
        raise ValueError(f"pool {pool!r}: expected one of {', '.join(POOLS)}")
    was = model.training
    model.eval()
    feats, labels = [], []
    k = model.num_prefix_tokens
    for x, y in batches(split, list(range(len(split))), batch_size, drop_last=False, device=device):
        x, _ = augment(x, y, train=False)
        with autocast_for(device, precision):
            z = model.forward_features(x)
        if pool == "cls" and k == 0:
            raise ValueError("--pool cls: this encoder has no class token (it pools the patches: --pool mean)")
        feats.append((z[:, 0] if pool == "cls" else z[:, k:].mean(1)).float().cpu())
        labels.append(y.cpu())
    model.train(was)
    return torch.cat(feats), torch.cat(labels)


@dataclass
class ProbeResult:
    method: str
    top1: float
    train_top1: float | None = None
    epochs: int | None = None

    def row(self) -> dict[str, Any]:
        return {"method": self.method, "val_top1": round(self.top1, 3),
                **({"train_top1": round(self.train_top1, 3)} if self.train_top1 is not None else {}),
                **({"epochs": self.epochs} if self.epochs is not None else {})}


def linear_probe(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor], num_classes: int,
                 epochs: int = 100, lr: float = 0.1, batch_size: int = 256, seed: int = 0,
                 device: torch.device | str = "cpu") -> ProbeResult:
    """MAE's linear probe on fixed features: BatchNorm1d(affine=False) then a linear layer, trained by SGD with
    momentum 0.9 and a cosine schedule, no weight decay (their LARS at a batch of 16,384 is for ImageNet's size).
    Top-1 on ``val`` after the last epoch; trained on ``device`` (the features are moved there)."""
    g = torch.Generator().manual_seed(seed)
    (x, y), (xv, yv) = ((a.to(device), b.to(device)) for a, b in (train, val))
    head = nn.Sequential(nn.BatchNorm1d(x.shape[1], affine=False, eps=1e-6), nn.Linear(x.shape[1], num_classes))
    nn.init.trunc_normal_(head[1].weight, std=0.01)
    nn.init.zeros_(head[1].bias)
    head.to(device)
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    steps = epochs * max(1, -(-len(x) // batch_size))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        head.train()
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            if len(idx) < 2:  # a BatchNorm needs two
                continue
            loss = F.cross_entropy(head(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    head.eval()
    with torch.no_grad():
        top1 = 100.0 * float((head(xv).argmax(1) == yv).float().mean())
        train_top1 = 100.0 * float((head(x).argmax(1) == y).float().mean())
    return ProbeResult("linear", top1, train_top1, epochs)


def knn(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor], num_classes: int,
        k: int = 20, temperature: float = 0.07, chunk: int = 1024, device: torch.device | str = "cpu") -> ProbeResult:
    """DINO's weighted k-NN on L2-normalised features: each validation image's ``k`` most cosine-similar training
    images vote for their class with weight exp(similarity / ``temperature``); computed on ``device``."""
    (x, y), (xv, yv) = ((a.to(device), b.to(device)) for a, b in (train, val))
    x, xv = F.normalize(x, dim=1), F.normalize(xv, dim=1)
    k = min(k, len(x))
    hits = 0
    for i in range(0, len(xv), chunk):
        sim, idx = (xv[i:i + chunk] @ x.T).topk(k, dim=1)  # (b, k)
        votes = torch.zeros(len(sim), num_classes, device=sim.device).scatter_add_(1, y[idx], (sim / temperature).exp())
        hits += int((votes.argmax(1) == yv[i:i + chunk]).sum())
    return ProbeResult(f"knn (k={k})", 100.0 * hits / max(len(xv), 1))
