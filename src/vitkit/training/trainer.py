"""The training loop: data in memory -> batch augmentation -> model -> checkpoints, metrics and curves."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..data.augment import BatchAugment, batches
from ..data.datasets import DataSplits, load_dataset
from ..data.sampler import GlobalBatchSampler
from ..model.config import to_2tuple
from ..model.hub import load_state_dict_into
from ..model.registry import get_config
from ..model.vit import VisionTransformer
from ..speed import compile_for_training, configure_for_training, precision_note, resolve_precision
from .checkpoint import load_train_state, recover_checkpoint, save_checkpoint
from .config import TrainConfig
from .evaluate import autocast_for, evaluate
from .optim import build_optimizer, lr_at, set_lr


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; the state at that step was written to ``<output>/diverged``."""


@dataclass
class RunResult:
    val_top1: float
    best_top1: float
    epochs: int
    steps: int
    elapsed_s: float
    stopped_early: bool
    output: Path | None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def build_model(cfg: TrainConfig, data: DataSplits) -> VisionTransformer:
    """The preset with the data's classes and channels; ``--init`` loads weights (new head, resampled grid)."""
    overrides = {"num_classes": data.num_classes, "in_chans": data.in_chans, **cfg.model_args}
    if cfg.init:
        from ..interop import load_pretrained
        from ..model.hub import ADAPTABLE

        # the architecture comes from the weights; only what fine-tuning may change is taken from the config
        keep = {k: v for k, v in overrides.items() if k in ADAPTABLE}
        model = load_pretrained(cfg.init, **keep)
        if model.config.in_chans != data.in_chans:
            raise ValueError(f"--init {cfg.init} expects {model.config.in_chans}-channel images but {data.name} has "
                             f"{data.in_chans}")
        return model
    if "img_size" not in cfg.model_args:
        preset = get_config(cfg.model)
        p = to_2tuple(preset.patch_size)[0] * preset.input_stride
        if data.img_size[0] % p == 0 and data.img_size[1] % p == 0:
            overrides["img_size"] = data.img_size
    return VisionTransformer(get_config(cfg.model, **overrides))


class Trainer:
    """``Trainer(cfg).fit()`` runs a whole training; ``request_stop()`` (e.g. from a signal) ends it cleanly."""

    def __init__(self, cfg: TrainConfig, data: DataSplits | None = None, log: Callable[[str], None] = print,
                 start_time: float | None = None, progress: bool = True) -> None:
        self.cfg, self.log = cfg, log
        self.start_time = start_time or time.time()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.is_main = self.rank == 0
        local_rank = self.rank % max(torch.cuda.device_count(), 1)
        self.device = resolve_device(cfg.device, local_rank)
        self.stop_requested = False
        self.progress = progress and self.is_main
        torch.manual_seed(cfg.seed + self.rank)

        self.data = data or load_dataset(cfg.dataset, cfg.data_dir, cfg.download, cfg.skip_bad_images,
                                         cfg.cache_dir)
        self.model = build_model(cfg, self.data).to(self.device)
        mc = self.model.config
        pre = getattr(self.model, "preprocessing", None) or {}
        if cfg.init and len(pre.get("mean") or []) == mc.in_chans:  # fine-tuning keeps the weights' statistics
            mean, std = pre["mean"], pre["std"]
        else:
            mean, std = self.data.mean_std()
        self.preprocessing = {"mean": mean, "std": std, "class_names": self.data.classes}
        self.augment = BatchAugment(mean, std, to_2tuple(mc.img_size), mc.num_classes, cfg.crop_padding,
                                    cfg.hflip, cfg.aa, mixup=cfg.mixup, cutmix=cfg.cutmix)
        self.optimizer = build_optimizer(self.model, cfg)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.smoothing)
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(cfg.model_ema_decay)) \
            if cfg.model_ema else None
        self.precision = resolve_precision(cfg.precision, self.device)  # "auto" -> bf16 or fp32 for this device
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        configure_for_training(self.model, self.device, self.precision)
        self.train_model: nn.Module = self.model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if cfg.compile:
            self.train_model = compile_for_training(self.train_model, self.device, log)
        self.sampler = GlobalBatchSampler(len(self.data.train), cfg.batch_size, self.rank, self.world, cfg.seed)
        micro = len(self.sampler) // cfg.batch_size
        self.steps_per_epoch = max(1, micro // cfg.grad_accum)
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.warmup_steps = int(cfg.warmup_epochs * self.steps_per_epoch)
        self._probe: list[tuple[int, float]] = []  # (step, time) at steps 5 and 30: see _probe_speed
        self._eval_guess = math.inf  # seconds an evaluation should take, from the probed training speed
        self._eval_s: float | None = None  # seconds the last evaluation took
        self.gen = torch.Generator().manual_seed(cfg.seed * 1000 + self.rank)
        self.epoch, self.step, self.batch_in_epoch, self.best_top1, self.last_top1 = 0, 0, 0, -1.0, 0.0
        self.prior_elapsed = 0.0
        self.out = Path(cfg.output) if cfg.output else None
        self.writer = None
        if cfg.resume:
            self._resume(Path(cfg.resume))

    # ------------------------------------------------------------------------------------------ state
    def _train_state(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "gen": self.gen.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"model": self.model.state_dict(), "ema": self.ema.state_dict() if self.ema else None,
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "rng": rng,
                "epoch": self.epoch, "step": self.step, "batch_in_epoch": self.batch_in_epoch,
                "total_steps": self.total_steps, "best_top1": self.best_top1, "last_top1": self.last_top1,
                "elapsed_s": self.elapsed(), "world": self.world}

    def _resume(self, run_dir: Path) -> None:
        ckpt = recover_checkpoint(run_dir, "last")
        if ckpt is None:
            raise FileNotFoundError(f"--resume {run_dir}: no last/ checkpoint in it")
        s = load_train_state(ckpt)
        load_state_dict_into(self.model, s["model"], str(ckpt / "train_state.pt"))
        if self.ema is not None and s["ema"] is not None:
            self.ema.load_state_dict(s["ema"])
        self.optimizer.load_state_dict(s["optimizer"])
        self.scaler.load_state_dict(s["scaler"])
        torch.set_rng_state(s["rng"]["torch"])
        self.gen.set_state(s["rng"]["gen"])
        if "cuda" in s["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(s["rng"]["cuda"])
        self.epoch, self.step, self.batch_in_epoch = s["epoch"], s["step"], s["batch_in_epoch"]
        self.best_top1, self.last_top1 = s["best_top1"], s["last_top1"]
        if self.cfg.time_limit:  # keep the plan that fitted the schedule into the budget
            self.total_steps = s["total_steps"]
        self.prior_elapsed = s["elapsed_s"]
        if s.get("world", 1) != self.world and self.batch_in_epoch:
            self.log(f"resuming with {self.world} processes instead of {s['world']}: restarting epoch {self.epoch}")
            self.batch_in_epoch = 0
        if self.out is None:
            self.out = run_dir
        self.log(f"resumed from {ckpt}: epoch {self.epoch}, step {self.step}/{self.total_steps}")

    def elapsed(self) -> float:
        return self.prior_elapsed + time.time() - self.start_time

    def request_stop(self) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------------------------------ outputs
    def _open_outputs(self) -> None:
        if not (self.is_main and self.out):
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tb"))
        except ImportError:  # tensorboard is a dependency, but a broken install should not stop training
            self.log("tensorboard not importable: no TensorBoard events")

    def _log_epoch(self, row: dict[str, Any]) -> None:
        if not (self.is_main and self.out):
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k not in ("epoch", "step") and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def _save(self, name: str, with_state: bool = True) -> None:
        if not (self.is_main and self.out):
            return
        to_save = self.ema.module if self.ema is not None else self.model
        save_checkpoint(self.out, name, to_save, self.preprocessing, self._train_state() if with_state else None)

    # ------------------------------------------------------------------------------------------ loop
    def _plan_time_limit(self, sec_per_step: float, eval_s: float) -> None:
        """Fit the remaining schedule into the ``--time-limit`` budget: the cosine ends at the budget."""
        # The clock starts with the `vitkit train` process. The margin holds the last epoch running slower than
        # planned, the final save and curves.png (≈1.5 s): 5-minute F-MNIST runs took 294.1-297.3 s of wall time
        # (`bash benchmarks/time_to_accuracy.sh fmnist5`, sessions 6-7).
        budget = self.cfg.time_limit * 60 * 0.99 - 3
        remaining = budget - self.elapsed()
        # n more steps cost n * sec_per_step plus one evaluation per eval_every epochs they span, and the final one:
        # n * (sec_per_step + eval_s / (steps_per_epoch * eval_every)) + eval_s <= remaining
        per_eval = self.steps_per_epoch * self.cfg.eval_every
        affordable = int((remaining - eval_s) / (max(sec_per_step, 1e-6) + eval_s / per_eval))
        planned = self.cfg.epochs * self.steps_per_epoch
        self.total_steps = max(self.step, min(planned, self.step + affordable))
        # keep the recipe's shape: warmup shrinks with the schedule
        self.warmup_steps = min(self.warmup_steps, int(self.cfg.warmup_epochs * self.steps_per_epoch
                                                       * self.total_steps / planned))
        if self.world > 1:  # ranks time themselves differently; rank 0's plan is everyone's
            t = torch.tensor([self.total_steps, self.warmup_steps], device=self.device)
            dist.broadcast(t, src=0)
            self.total_steps, self.warmup_steps = int(t[0]), int(t[1])

    def _replan_after_epoch(self, step0: int, t0: float, train_s: float) -> None:
        """Re-plan from the epoch that just ended (steps step0.. started at t0). The first epoch also compiled the
        training model (~30 s cold for the Fashion-MNIST recipe) and ran the first, warming-up evaluation: its plan
        uses the steps after the probe's mark (step 5) and an evaluation at most as long as the probe's guess.
        (Planning with the compiling in it shrank the schedule, and the LR rose again at the next re-plan.)"""
        first = bool(self._probe) and self._probe[0][0] > step0
        mark_step, mark_t = self._probe[0] if first else (step0, t0)
        if self._eval_s is None:  # no evaluation yet (--eval-every skipped it): the probe's guess
            eval_s = self._eval_guess if math.isfinite(self._eval_guess) else 0.0
        else:
            eval_s = min(self._eval_s, self._eval_guess) if first else self._eval_s
        self._plan_time_limit((t0 + train_s - mark_t) / max(self.step - mark_step, 1), eval_s)

    def _agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (stop requests and NaN must stop all ranks together)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _diverged(self, loss: float) -> None:
        if self.is_main and self.out:
            to = self.out / "diverged"
            save_checkpoint(self.out, "diverged", self.model, self.preprocessing, self._train_state())
            self.log(f"diverged state written to {to}")
        raise TrainingDiverged(f"loss is {loss} at epoch {self.epoch} step {self.step}; last/ and best/ are kept "
                               "as they were. Lower --lr, add --clip-grad, or use --precision fp32.")

    def train_epoch(self) -> tuple[float, float]:
        cfg, model = self.cfg, self.train_model
        model.train()
        self.sampler.set_epoch(self.epoch)
        indices = list(iter(self.sampler))[: self.steps_per_epoch * cfg.grad_accum * cfg.batch_size]
        start_batch = self.batch_in_epoch
        it = batches(self.data.train, indices[start_batch * cfg.batch_size:], cfg.batch_size, True, self.device)
        n_batches = self.steps_per_epoch * cfg.grad_accum - start_batch
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n_batches, desc=f"epoch {self.epoch + 1}", leave=False, mininterval=1.0,
                       dynamic_ncols=True)
        loss_sum, seen, t0 = 0.0, 0, time.time()
        for x, y in it:
            if self.step >= self.total_steps:
                break
            x, target = self.augment(x, y, train=True, generator=self.gen)
            with autocast_for(self.device, self.precision):
                loss = self.criterion(model(x), target)
            lv = float(loss.detach())
            if self._agree(not math.isfinite(lv)):
                self._diverged(lv)
            self.scaler.scale(loss / cfg.grad_accum).backward()
            self.batch_in_epoch += 1
            if self.batch_in_epoch % cfg.grad_accum == 0:
                lr = lr_at(self.step, self.total_steps, self.warmup_steps, cfg.lr, cfg.min_lr)
                set_lr(self.optimizer, lr)
                if cfg.clip_grad:
                    self.scaler.unscale_(self.optimizer)
                    nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                if self.ema is not None:
                    self.ema.update_parameters(self.model)
                self.step += 1
                self._probe_speed()
            loss_sum += lv * len(y)
            seen += len(y)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{lv:.3f}", lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                                img_s=f"{seen * self.world / max(time.time() - t0, 1e-6):.0f}", refresh=False)
            if self._agree(self.stop_requested):
                self.stop_requested = True
                break
        if bar is not None:
            bar.close()
        return loss_sum / max(seen, 1), seen * self.world / max(time.time() - t0, 1e-6)

    def _probe_speed(self) -> None:
        """A first time-limit plan before the first epoch ends: the training speed between steps 5 and 30 of the run
        (after the compile and warm-up), and an evaluation guessed at a third of the time per image."""
        probe, cfg = self._probe, self.cfg
        if not cfg.time_limit or self.epoch > 0 or len(probe) == 2 or \
                self.step not in (5, min(30, self.steps_per_epoch - 1)):
            return
        probe.append((self.step, time.time()))  # step 5 on: compile and warm-up are behind us
        if len(probe) == 2:
            sps = (probe[1][1] - probe[0][1]) / (probe[1][0] - probe[0][0])
            img_per_s = cfg.batch_size * cfg.grad_accum * self.world / sps
            self._eval_guess = len(self.data.val) / (3 * img_per_s)
            self._plan_time_limit(sps, self._eval_guess)

    def _eval_due(self) -> bool:
        """Evaluate every ``eval_every`` epochs, and always after the last one (or when stopping)."""
        return self.epoch % self.cfg.eval_every == 0 or self.step >= self.total_steps or self.stop_requested

    def _evaluate_and_keep_best(self) -> dict[str, Any]:
        """Evaluate (timed, for the time-limit plan) and save ``best/`` when top-1 improved."""
        t = time.time()
        metrics = self.evaluate()
        self._eval_s = time.time() - t
        self.last_top1 = metrics["top1"]
        if metrics["top1"] > self.best_top1:
            self.best_top1 = metrics["top1"]
            self._save("best", with_state=False)
        return metrics

    def evaluate(self) -> dict[str, Any]:
        return self.evaluate_model(self.ema.module if self.ema is not None else self.model)

    def evaluate_model(self, model: nn.Module) -> dict[str, Any]:
        """``model`` on the validation split, as the run evaluates its own (batch, precision, ranks)."""
        return evaluate(model, self.data.val, self.augment, self.model.config.num_classes, self.device,
                        self.cfg.eval_batch_size, self.precision if self.precision == "bf16" else "fp32",
                        self.rank, self.world)

    def fit(self) -> RunResult:
        cfg = self.cfg
        self._open_outputs()
        if self.is_main:
            self.log(self.data.describe())
            self.log(f"model {cfg.model}: {self.model.num_params:,} parameters on {self.device} in {self.precision}"
                     f"{' (auto)' if cfg.precision == 'auto' else ''}; {self.steps_per_epoch} steps/epoch, "
                     f"global batch {cfg.batch_size * self.world * cfg.grad_accum}")
            note = precision_note(self.precision, self.device)
            if note:
                self.log(note)
        while self.step < self.total_steps and not self.stop_requested:
            t0, step0 = time.time(), self.step
            train_loss, img_s = self.train_epoch()
            train_s = time.time() - t0
            if self.stop_requested and self.batch_in_epoch % (self.steps_per_epoch * cfg.grad_accum):
                break  # mid-epoch stop: save and leave; --resume continues from this batch
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            metrics = self._evaluate_and_keep_best() if self._eval_due() else None
            self._save("last")
            # re-plan after the saves, so the plan sees what they cost; a schedule that has ended stays ended (its
            # LR is at the end of the cosine: a few more steps there are not worth another evaluation)
            if cfg.time_limit and step0 < self.step < self.total_steps:
                self._replan_after_epoch(step0, t0, train_s)
                if metrics is None and self._eval_due():  # the re-plan left no time for another epoch
                    metrics = self._evaluate_and_keep_best()
                    self._save("last")  # with the final top-1 in its training state
            row = {"epoch": self.epoch, "step": self.step, "train_loss": round(train_loss, 5),
                   "lr": self.optimizer.param_groups[0]["lr"], "img_per_s": round(img_s, 1),
                   "precision": self.precision}  # what "auto" became on this machine
            said = f"epoch {self.epoch}: train_loss {train_loss:.4f}"
            if metrics is not None:
                row.update(val_loss=round(metrics["loss"], 5), val_top1=round(metrics["top1"], 3),
                           val_top5=round(metrics["top5"], 3))
                said += f" val_loss {metrics['loss']:.4f} val_top1 {metrics['top1']:.2f}%"
            row["elapsed_s"] = round(self.elapsed(), 2)
            self._log_epoch(row)
            if self.is_main:
                self.log(f"{said} ({img_s:.0f} img/s, {self.elapsed():.0f}s)")
        if self.stop_requested:
            self._save("last")
            if self.is_main:
                self.log(f"stopped at epoch {self.epoch} batch {self.batch_in_epoch}; last/ saved "
                         f"(resume with --resume {self.out})" if self.out else "stopped")
        if self.is_main and self.out:
            if self.writer is not None:
                self.writer.close()
            from ..inspect.plots import plot_curves

            plot_curves(self.out / "metrics.jsonl", self.out / "curves.png")
        return RunResult(self.last_top1, self.best_top1, self.epoch, self.step, self.elapsed(),
                         self.stop_requested, self.out)
