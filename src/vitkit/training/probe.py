"""The run's own training step, for timing: the candidates for every ``auto`` setting and a probe that trains a
copy of the run's model on a real batch (the run's model, optimizer and random state untouched)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

from ..data.augment import BatchAugment, batches
from ..data.datasets import DataSplits
from ..runtime.cpu import cpu_precisions
from ..runtime.precision import autocast_for, matmul_precision
from .build import apply_layout, augment_for, build_model, preprocessing_for
from .config import TrainConfig
from .objectives import objective_for, ssl_settings
from .optim import build_optimizer, freeze_body


def step_candidates(cfg: TrainConfig, device: torch.device, hybrid: bool = True) -> list[dict[str, Any]]:
    """Every combination of the settings left ``auto``. On a CPU, bf16 only where its matmuls are not much slower
    than fp32's (runtime/cpu.cpu_precisions, timed; CPU flags only order them). The memory layout is a candidate
    only for a model with a CNN stem (``hybrid``): elsewhere it moves one small convolution."""
    if cfg.precision != "auto":
        precisions = [cfg.precision]
    elif device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        precisions = ["fp16", "fp32"]  # (T4, V100: bf16 would be emulated; fp16 has their tensor cores)
    elif device.type == "cuda":  # fp32 with TF32 matmuls where the GPU has TF32 tensor cores (Ampere on)
        precisions = ["bf16", "tf32", "fp32"] if torch.cuda.get_device_capability(device)[0] >= 8 else ["bf16", "fp32"]
    elif device.type == "cpu":
        precisions = cpu_precisions()[0]
    else:
        precisions = ["fp32"]  # MPS: bf16 autocast is not complete there
    layouts = ([True, False] if hybrid else [False]) if cfg.channels_last == "auto" else [cfg.channels_last]
    return [{"precision": p, "attention": a, "channels_last": c} for p in precisions
            for a in _attentions(cfg, device, p) for c in layouts]


def _attentions(cfg: TrainConfig, device: torch.device, precision: str) -> list[str]:
    """The attention paths to time, the likelier winner first (the run starts on it; timing decides all the same).
    In bf16 on a CPU the explicit softmax(QK^T)V won the first steps of 19 of 20 runs on the two bf16 CPU kinds
    measured (AMX Xeon, AVX512-BF16 EPYC; results/budget-use.csv): CIFAR-10's hybrid 438 against 598 ms a step on the
    EPYC. A run that started on SDPA paid that gap on every step before the attention phase (~1.6 s of a 1-minute
    run's 5.1 s tuning excess). Elsewhere (fp32: each won about half; a GPU: the fused kernels) SDPA first."""
    if cfg.attention != "auto":
        return [cfg.attention]
    return ["exact", "sdpa"] if device.type == "cpu" and precision == "bf16" else ["sdpa", "exact"]


def step_workload(cfg: TrainConfig, model: nn.Module, n: int, device: torch.device) -> dict[str, Any]:
    """What the step's time depends on, for the cache key."""
    return {"kind": "train step", "model": model.config.to_dict(), "batch": n, "opt": cfg.opt,
            "augment": [cfg.crop_padding, cfg.hflip, cfg.aa, cfg.aa_magnitude, cfg.mixup, cfg.cutmix],
            "muon": [cfg.muon_stem, cfg.muon_embed], "freeze_body": cfg.freeze_body, "device": device.type,
            "threads": torch.get_num_threads(),
            **({} if cfg.objective == "classify" else {"objective": ssl_settings(cfg)}),
            # --semi's MAE on unlabelled images beside the step (its cached time was the plain step's: a joint run
            # at 10% of CIFAR-10 planned 6.2 epochs and trained 4.5)
            **({"semi": [cfg.semi, cfg.unlabeled_ratio, ssl_settings(cfg)]} if cfg.semi else {})}


class StepProbe:
    """The run's training step on a real batch, for timing: each candidate trains a copy of the model, so the run's
    own model, optimizer and random state are untouched."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, data: DataSplits, device: torch.device,
                 augment: BatchAugment) -> None:
        self.cfg, self.model, self.device, self.augment = cfg, model, device, augment
        self.n, self.n_train = min(cfg.batch_size, len(data.train)), len(data.train)
        rng = torch.get_rng_state()
        x, y = next(batches(data.train, list(range(self.n)), self.n, False, device))
        self.raw = (x, y)  # as the loop gets it: uint8 on the device, augmented inside the timed step
        self.x, self.target = augment(x, y, train=False)
        torch.set_rng_state(rng)
        self.objective = objective_for(cfg, augment)  # what the run's loss compares (objectives.py)

    def make(self, s: dict[str, Any], compiled: bool | str = False) -> Callable[[], None]:
        """The run's step as it trains: the batch's augmentation (on the device, from its generator), forward,
        backward, optimizer step. Its time is what an epoch's steps take, and what ``--estimate`` reports."""
        step = self.make_fed(s, compiled, augment=True)
        return lambda: step(*self.raw)

    def make_fed(self, s: dict[str, Any], compiled: bool | str = False, augment: bool = True
                 ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The step on a batch it is given (uint8 images and labels, augmented as the run augments them, with
        ``augment``): for timing the data pipeline with the step it feeds."""
        # the model and the objective's parts (new ones are built on the CPU: moved to where the model is)
        m = self.objective.wrap(copy.deepcopy(self.model)).to(self.device).train()
        apply_layout(m, s["attention"], s["channels_last"])
        cfg = TrainConfig.from_dict({**self.cfg.to_dict(), "precision": s["precision"], "compile": False,
                                     "attention": "sdpa", "channels_last": False, "tiers": None})
        if cfg.freeze_body:
            freeze_body(m)
        opt = build_optimizer(m, cfg)
        fwd = torch.compile(m, mode=compiled if isinstance(compiled, str) else None) if compiled else m
        objective, device, precision, aug = self.objective, self.device, s["precision"], self.augment
        gen = torch.Generator(device=device).manual_seed(0)  # the crops, flips and masks, drawn there as the run's

        def step(x: torch.Tensor, target: torch.Tensor) -> None:
            if augment:
                x, target = aug(x, target, train=True, generator=gen)
            with matmul_precision(precision):
                with autocast_for(device, precision):
                    loss = objective.loss(fwd, x, target, gen)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return step


def _probe(cfg: TrainConfig, data: DataSplits, device: torch.device) -> StepProbe:
    rng = torch.get_rng_state()
    model = build_model(cfg, data).to(device)
    torch.set_rng_state(rng)  # the run's model is built from the same seed after planning
    augment = augment_for(cfg, preprocessing_for(cfg, model, data), model.config).to(device)
    return StepProbe(cfg, model, data, device, augment)


def _describe_model(model: nn.Module) -> str:
    c = model.config
    hybrid = f", {c.hybrid}" if getattr(c, "hybrid", None) else ""
    return f"depth {c.depth}, width {c.embed_dim}, patch {c.patch_size}{hybrid}"
