"""What a batch is turned into and what the loss compares: one trainer, many objectives.

``classify`` is the paper's supervised training (cross-entropy on the labels). ``mpp`` (the paper's masked patch
prediction, §4.6) and ``mae`` (He et al.'s masked autoencoder) learn from the images alone: their module wraps the
encoder with the objective's parts (model/ssl.py), the labels are not read, and the validation split is scored by
the objective's own loss (and, for MPP's colour classes, the share of masked patches whose colour is right). The
loop, the planner, checkpoints, resume and torchrun are the same code for all three.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..data.augment import BatchAugment
from ..model.ssl import (SSL_CONFIG, SSL_WEIGHTS, MaskedAutoencoder, MaskedPatchPrediction, SSLOutput, build_ssl,
                         draw_noise, load_ssl, ssl_config)
from ..interop.mae import from_hf_mae, is_hf_mae
from ..model.draws import draw
from ..model.vit import VisionTransformer
from ..runtime.precision import autocast_for
from .config import OBJECTIVES, SEMI_WEIGHT, TrainConfig  # noqa: F401 - OBJECTIVES: the objectives' names, here too
from .evaluate import evaluate, rank_batches

SSL_SEED = 1234  # the masks an evaluation draws: the same every epoch, so its losses compare


def ssl_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The objective's parts as model/ssl.py builds them (``build_ssl``), from the run's config."""
    if cfg.objective == "mae" or cfg.semi == "joint":
        return {"method": "mae", "mask_ratio": cfg.mask_ratio if cfg.mask_ratio is not None else 0.75,
                "norm_pix_loss": cfg.norm_pix_loss is not False, "decoder_width": cfg.decoder_width,
                "decoder_depth": cfg.decoder_depth, "decoder_heads": cfg.decoder_heads}
    return {"method": "mpp", "target": cfg.mpp_target,
            "mask_ratio": cfg.mask_ratio if cfg.mask_ratio is not None else 0.5}


class Classify:
    """The paper's supervised objective: cross-entropy (with label smoothing) of the head's logits."""

    name, metric = "classify", "val_top1"

    def __init__(self, cfg: TrainConfig, augment: BatchAugment) -> None:
        self.cfg, self.augment = cfg, augment
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.smoothing)

    def wrap(self, model: VisionTransformer) -> nn.Module:
        """The module the optimizer trains: the model itself here; the model and the objective's parts else."""
        return model

    def loss(self, fwd: Callable[..., Any], x: torch.Tensor, target: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        return self.criterion(fwd(x), target)

    def evaluate(self, module: nn.Module, split: Any, num_classes: int, device: torch.device, batch_size: int,
                 precision: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
        return evaluate(module, split, self.augment, num_classes, device, batch_size, precision, rank, world)

    def score(self, metrics: dict[str, Any]) -> float:
        """What the run keeps its best/ by (higher is better)."""
        return metrics["top1"]

    def row(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"val_loss": round(metrics["loss"], 5), "val_top1": round(metrics["top1"], 3),
                "val_top5": round(metrics["top5"], 3)}

    def said(self, metrics: dict[str, Any]) -> str:
        return f" val_loss {metrics['loss']:.4f} val_top1 {metrics['top1']:.2f}%"

    def final(self, metrics_top: float) -> str:
        return f"val_top1={metrics_top:.2f}"


class SelfSupervised(Classify):
    """MPP or MAE: the labels are not read; the module is the encoder with the objective's parts."""

    def __init__(self, cfg: TrainConfig, augment: BatchAugment) -> None:
        super().__init__(cfg, augment)
        self.name = cfg.objective
        self.metric = "val_top1" if cfg.objective == "mpp" and cfg.mpp_target != "l2" else "val_loss"
        self.note = ""  # what wrap() did with --init's objective parts, for the run to say
        self.mean = augment.mean.reshape(1, -1, 1, 1) / 255  # (the augmentation's are in 0-255 units)
        self.std = augment.std.reshape(1, -1, 1, 1) / 255

    def wrap(self, model: VisionTransformer) -> nn.Module:
        """The encoder with the objective's parts: those of ``--init``'s checkpoint where it holds them for this
        method (pre-training continued, on these images or new ones), else new ones; ``self.note`` says which."""
        init = Path(self.cfg.init) if self.cfg.init else None
        what = {"mae": "MAE decoder", "mpp": "MPP [mask] embedding and head"}[self.cfg.objective]
        if init is not None and (init / SSL_CONFIG).is_file():
            try:
                saved = json.loads((init / SSL_CONFIG).read_text())
            except ValueError as e:
                raise ValueError(f"{init / SSL_CONFIG}: not JSON ({e})") from None
            method = saved.get("method") if isinstance(saved, dict) else None
            if method == self.cfg.objective:
                module, said = self._continued(load_ssl(init, model), init)
                self.note = f"the {what}: read from {init} ({SSL_CONFIG}, {SSL_WEIGHTS})" + said
                return module
            self.note = (f"the {what}: new ({init} holds {method or 'no'} parts, not {self.cfg.objective}'s; its "
                         "encoder is read)")
        if init is not None and self.cfg.objective == "mae" and is_hf_mae(init):  # ViTMAEForPreTraining's decoder
            mae = from_hf_mae(init)
            if any(k.startswith("decoder_") for k in mae.state_dict()):
                mae.load_state_dict({**mae.state_dict(), **{f"encoder.{k}": v for k, v in model.state_dict().items()}})
                module, said = self._continued(mae, init)
                self.note = f"the {what}: read from {init} (Hugging Face's ViTMAEForPreTraining)" + said
                return module
        if init is not None and not self.note:
            self.note = f"the {what}: new ({init} holds the encoder alone: no {SSL_CONFIG} and {SSL_WEIGHTS})"
            if (init / SSL_WEIGHTS).is_file():  # weights without the settings that say how to build them
                self.note = (f"the {what}: new ({init} has {SSL_WEIGHTS} but not {SSL_CONFIG}, which says what they "
                             f"are and how to build them, so they are not read; its encoder is)")
        return build_ssl(model, ssl_settings(self.cfg))

    def _continued(self, module: nn.Module, init: Path) -> tuple[nn.Module, str]:
        """Pre-training continued from ``init``'s parts: its decoder's shape is the saved one (a flag that asks
        another is refused by name); the mask ratio and MAE's pixel standardisation are the checkpoint's, or the
        flags' where given.
        Returns the module and what the flags changed and what was kept, for the note."""
        cfg, said, kept = self.cfg, [], []
        if isinstance(module, MaskedAutoencoder):
            d = module.decoder_cfg
            for key, have in (("decoder_width", d.embed_dim), ("decoder_depth", d.depth),
                              ("decoder_heads", d.num_heads)):
                if getattr(cfg, key) is not None and getattr(cfg, key) != have:
                    raise ValueError(f"--{key.replace('_', '-')} {getattr(cfg, key)}: {init}'s decoder, which this "
                                     f"run continues, has {have}; leave the flag out, or pre-train a new decoder "
                                     f"on its encoder (--init a copy of {init} without {SSL_CONFIG})")
            if cfg.norm_pix_loss is not None and cfg.norm_pix_loss != module.norm_pix_loss:
                said.append(f"norm_pix_loss {module.norm_pix_loss} -> {cfg.norm_pix_loss}")
                module.norm_pix_loss = cfg.norm_pix_loss
            elif cfg.norm_pix_loss is None:
                kept.append(f"norm_pix_loss {module.norm_pix_loss}")
        ratio = module.mask_ratio if isinstance(module, MaskedAutoencoder) else module.corrupt
        if cfg.mask_ratio is None:
            kept.append(f"mask ratio {ratio:g}")
        elif cfg.mask_ratio != ratio:
            said.append(f"mask ratio {ratio:g} -> {cfg.mask_ratio:g}")
            rebuilt = build_ssl(module.encoder, {**ssl_config(module), "mask_ratio": cfg.mask_ratio})  # checks it
            rebuilt.load_state_dict(module.state_dict())
            module = rebuilt
        return module, "".join([f"; as the flags ask: {', '.join(said)}" if said else "",
                                f"; its own {' and '.join(kept)} (no flag changes them)" if kept else ""])

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """The standardised batch back in [0, 1]: MPP's colours are of the pixels, not of the standardised values."""
        return (x.float() * self.std.to(x.device) + self.mean.to(x.device)).clamp(0, 1)

    def out(self, fwd: Callable[..., Any], x: torch.Tensor, generator: torch.Generator | None) -> SSLOutput:
        noise = draw_noise(fwd, x, generator)  # outside the (maybe compiled) step: one graph, the same draws
        if self.cfg.objective == "mpp":
            return fwd(x, self.raw(x), noise=noise)
        return fwd(x, noise=noise)

    def loss(self, fwd: Callable[..., Any], x: torch.Tensor, target: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        return self.out(fwd, x, generator).loss

    @torch.no_grad()
    def evaluate(self, module: nn.Module, split: Any, num_classes: int, device: torch.device, batch_size: int,
                 precision: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
        """The objective's loss over the validation split (and MPP's colour accuracy), with the same masks every
        time (a generator seeded alike); under DDP each rank takes every ``world``-th image and the sums are
        all-reduced."""
        was_training = module.training
        module.eval()
        gen = torch.Generator(device=device).manual_seed(SSL_SEED + rank)  # (the masks drawn where they are used)
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss x images, images, hits, masked patches
        for x, y, counted in rank_batches(split, rank, world, batch_size, device):
            x, _ = self.augment(x, y, train=False)
            with autocast_for(device, precision):
                out = self.out(module, x, gen)
            if not counted:
                continue
            sums[0] += out.loss.double() * len(y)  # (summed on the device: read once, at the end)
            sums[1] += len(y)
            if out.correct is not None:
                sums[2] += out.correct.double()
                sums[3] += out.count.double()
        if world > 1:
            dist.all_reduce(sums)
        module.train(was_training)
        n = max(float(sums[1]), 1.0)
        top1 = 100.0 * float(sums[2]) / float(sums[3]) if float(sums[3]) else float("nan")
        return {"loss": float(sums[0]) / n, "top1": top1, "n": int(sums[1])}

    def score(self, metrics: dict[str, Any]) -> float:
        return metrics["top1"] if self.metric == "val_top1" else -metrics["loss"]

    def row(self, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"val_loss": round(metrics["loss"], 5)}
        if self.metric == "val_top1":
            row["val_top1"] = round(metrics["top1"], 3)  # the masked patches whose colour is right
        return row

    def said(self, metrics: dict[str, Any]) -> str:
        said = f" val_loss {metrics['loss']:.4f}"
        if self.metric == "val_top1":
            said += f" colours right {metrics['top1']:.2f}%"
        return said

    def final(self, best: float) -> str:
        return f"val_colour_top1={best:.2f}" if self.metric == "val_top1" else f"val_loss={-best:.4f}"


class WithPool(Classify):
    """An objective that learns from unlabelled images beside the labelled batch: ``unlabeled_ratio`` times as many
    drawn each step from ``pool`` (the unlabelled images and the labelled ones, uint8). Without a pool (the planner's
    probe of a streamed split), the labelled batch stands in for it: the same shapes and work."""

    def __init__(self, cfg: TrainConfig, augment: BatchAugment, pool: torch.Tensor | None = None) -> None:
        super().__init__(cfg, augment)
        self.pool = pool
        self.weight = cfg.semi_weight if cfg.semi_weight is not None else SEMI_WEIGHT[cfg.semi]  # type: ignore

    def draw_pool(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
        """``unlabeled_ratio`` x len(x) uint8 images of the pool on ``x``'s device (None without a pool)."""
        if self.pool is None:
            return None
        idx = draw(torch.randint, len(self.pool), (len(x) * self.cfg.unlabeled_ratio,), generator=generator,
                   on=x.device)
        return self.pool[idx.to(self.pool.device)].to(x.device, non_blocking=True)

    def stand_in(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(self.cfg.unlabeled_ratio, *[1] * (x.dim() - 1))


class Joint(WithPool):
    """``--semi joint``: the classifier's cross-entropy on the labelled batch plus ``semi_weight`` times MAE's loss on
    the unlabelled images, cropped and flipped as the labelled are (MAE's own augmentation: no RandAugment, no MixUp),
    in one step through one module (model/ssl.JointMAE). Das et al. (WACV 2024) train MAE as such an auxiliary task on
    the labelled images alone; the unlabelled ones are what this run has beyond theirs."""

    def wrap(self, model: VisionTransformer) -> nn.Module:
        return build_ssl(model, ssl_settings(self.cfg), joint=True)

    def unlabelled(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The pool's images, augmented and standardised, on ``x``'s device."""
        u = self.draw_pool(x, generator)
        return self.stand_in(x) if u is None else self.augment.weak(u, generator)

    def loss(self, fwd: Callable[..., Any], x: torch.Tensor, target: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        u = self.unlabelled(x, generator)
        noise = draw_noise(fwd, u, generator)  # (outside the maybe compiled step, as MAE's)
        logits, out = fwd(x, u, noise=noise)
        return self.criterion(logits, target) + self.weight * out.loss


class FixMatch(WithPool):
    """``--semi fixmatch`` (Sohn et al., NeurIPS 2020): the model's prediction on a weakly augmented unlabelled image
    (the training crop and flip), where its softmax reaches ``semi_threshold``, is the hard target of the same image
    strongly augmented (RandAugment and Cutout); the loss is the labelled cross-entropy plus ``semi_weight`` times that
    cross-entropy averaged over all the unlabelled images (the unconfident ones count as zero, as in the paper). The
    pseudo-labels come from a forward without gradients; the labelled and the strong views go through one forward.

    ``confident_share()``: the share of the unlabelled images since it was last asked whose pseudo-label was
    confident enough (kept on the device as the steps go: read once an epoch, one sync)."""

    confident: list[torch.Tensor] | None = None

    def confident_share(self) -> float | None:
        if not self.confident:
            return None
        share, self.confident = float(torch.stack(self.confident).mean()), []
        return share

    def loss(self, fwd: Callable[..., Any], x: torch.Tensor, target: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        u = self.draw_pool(x, generator)
        weak, strong = (self.stand_in(x), self.stand_in(x)) if u is None else \
            (self.augment.weak(u, generator), self.augment.strong(u, generator))
        with torch.no_grad():
            confidence, pseudo = fwd(weak).float().softmax(-1).max(-1)
            confident = (confidence >= self.cfg.semi_threshold).float()
        logits = fwd(torch.cat([x, strong]))
        unlabelled = F.cross_entropy(logits[len(x):].float(), pseudo, reduction="none")
        self.confident = (self.confident or []) + [confident.mean()]
        return self.criterion(logits[:len(x)], target) + self.weight * (unlabelled * confident).mean()


def objective_for(cfg: TrainConfig, augment: BatchAugment, pool: torch.Tensor | None = None) -> Classify:
    if cfg.objective != "classify":
        return SelfSupervised(cfg, augment)
    return {"joint": Joint, "fixmatch": FixMatch}[cfg.semi](cfg, augment, pool) if cfg.semi else \
        Classify(cfg, augment)


def is_ssl(module: nn.Module) -> bool:
    return isinstance(module, (MaskedPatchPrediction, MaskedAutoencoder))
