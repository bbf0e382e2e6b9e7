"""The training loop: data in memory -> batch augmentation -> model -> checkpoints and metrics.

The settings are decided by ``plan.py`` (every ``auto`` timed there), the parts are built by ``build.py``, the
``--time-limit`` schedule is ``budget.py``'s and the run folder's record ``runlog.py``'s: what is left here is the
loop itself, its checkpoints and its resumption.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from tqdm import tqdm

from ..data.augment import batches
from ..data.datasets import DataSplits
from ..data.folder import load_folder_splits
from ..data.shards import load_shard_splits
from ..data.sampler import GlobalBatchSampler, check_batches
from ..model.config import to_2tuple
from ..model.hub import load_state_dict_into
from ..model.serialization import CONFIG_NAME
from ..model.ssl import MASKS_DRAWN
from ..runtime.device import resolve_device
from ..runtime.distributed import (any_rank, barrier, broadcast_ints, gather_objects, gradients_reduced, local_rank,
                                   rank_and_world)
from ..runtime.memory import release_free_memory
from ..runtime.calibrate import Calibration, store_unless_loaded
from ..runtime.compile import CompileTrial
from ..runtime.precision import autocast_for, matmul_precision
from ..runtime.threads import OtherLoad, usable_cores
from .budget import EVAL_SHARE, WARM_STEPS, TimeBudget
from .build import (apply_layout, augment_for, build_data, build_model, for_run, model_for_training,
                    preprocessing_for, resident)
from .checkpoint import load_train_state, prepare_new, recover_run, save_checkpoint, write_new
from .config import TrainConfig
from .ema import ModelEma
from .objectives import objective_for
from .optim import build_optimizer, freeze_body, lr_at, set_lr
from .plan import Plan, make_plan
from .tune import SETTINGS as TUNED, STEP_SETTINGS, StepTuner
from .runlog import RunLog
from .semi_choice import choose_semi
from .shard import SHARDS, load_shards, load_whole, save_shards, shard_module, whole_copy
from .ssl_figure import FIGURE_IMAGES, draw, how_filled, ssl_pictures


READ_LOSS_EVERY = 16  # batches between two reads of the loss on an accelerator (each read waits for the device)
TUNE_BUDGET_SHARE = 0.3  # the run's first steps decide its settings for at most this share of a time budget (they
# train all the same; a candidate twice the best pace is dropped)
RETIME_PACE = 1.4  # a pace this many times slower (or faster) than the chosen one times the thread count again ...
RETIME_EVERY = 0.1  # ... at most once in this share of the budget
EARLY_END = 0.9  # a budgeted run whose schedule ends before this share of the budget says so
EVAL_PROBE = 64  # validation images the budget's first plan evaluates (twice) to time an evaluation
PROGRESS_EVERY_S = 30.0  # where no progress bar is drawn (a log that is not a terminal), a line this often
# last/ is written at an epoch's end once the training since the last write took at least 1/SAVE_SHARE times what a
# write takes (and at the run's end, and on a stop): an H200's Fashion-MNIST epoch trains in 0.27 s and its write of
# last/ (weights and AdamW state, 46 MB) took ~0.16 s, written every epoch it was 37% of the training time
# (results/gpu/h200-2026-12-04b); on a CPU, whose epochs take tens of seconds, it is still every epoch. A kill -9
# loses at most ~50 writes' worth of training.
SAVE_SHARE = 0.02


# A classifier whose training loss is still a uniform guess's (ln C: whatever the labels' smoothing or mixing, a guess
# of 1/C for every class scores exactly that) a tenth of the way into its schedule is not learning. An H200's CIFAR-10
# run at batch 4096 and lr 0.0113 stayed at 2.17-2.32 (ln 10 = 2.30) for 60 epochs and ended at 36% without a word.
# Checked at a tenth of the schedule, or three warmups if later (digits' 3 epochs, 1 of warmup: 2.29, 2.15, 1.84).
STALL_SHARE, STALL_WARMUPS, STALL_LOSS = 0.1, 3, 0.95


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
    epochs_trained: float | None = None  # epochs as a fraction (a budget that ended mid-epoch: 0.14)


def unlabelled_pool(cfg: TrainConfig, full: DataSplits, labelled: DataSplits,
                    say: Callable[[str], None] = lambda s: None) -> torch.Tensor | None:
    """``--semi``'s images beside the labels (uint8, on the host): the training split's images ``--train-fraction``
    leaves out, the labelled ones (the ones ``--holdout`` validates on are in neither), and ``--unlabeled``'s, read
    at the labelled images' size (its train/ alone where it has splits: never its val/ or test/ images)."""
    if not cfg.semi:
        return None
    if full.streamed:
        raise ValueError(f"--semi {cfg.semi}: the unlabelled images are held in memory, and {full.name} is streamed "
                         "from its files (--data-mode memory, where it fits)")
    parts = [full.left_out(cfg.train_fraction).images, labelled.train.images]
    if cfg.unlabeled:
        if Path(cfg.unlabeled).is_dir() and any(Path(cfg.unlabeled).glob("*.tar")):  # WebDataset shards
            more = load_shard_splits(cfg.unlabeled, cfg.skip_bad_images, cfg.cache_dir, mode="memory", say=say,
                                     unlabeled=True, size=labelled.img_size)
        else:
            more = load_folder_splits(cfg.unlabeled, cfg.skip_bad_images, labelled.img_size, cfg.cache_dir,
                                      mode="memory", say=say, unlabeled=True)
        images = more.train.images  # (its train/ or train shards; of a folder without splits, all but 1 in 50)
        if images.shape[1] != labelled.in_chans:
            raise ValueError(f"--unlabeled {cfg.unlabeled}: images of {images.shape[1]} channel"
                             f"{'s' if images.shape[1] > 1 else ''}, and {labelled.name}'s have {labelled.in_chans}")
        say(f"--unlabeled {cfg.unlabeled}: {len(images):,} images at {labelled.img_size[0]}x{labelled.img_size[1]}")
        parts.append(images)
    return torch.cat(parts)


class Trainer:
    """``Trainer(cfg).fit()`` runs a whole training; ``request_stop()`` (e.g. from a signal) ends it cleanly."""

    def __init__(self, cfg: TrainConfig, data: DataSplits | None = None, log: Callable[[str], None] = print,
                 start_time: float | None = None, progress: bool = True, plan_: Plan | None = None,
                 pool: torch.Tensor | None = None,
                 on_epoch: Callable[["Trainer", dict[str, Any]], None] | None = None) -> None:
        self.on_epoch = on_epoch  # called with each epoch's metrics row (`vitkit tune` reports and prunes there)
        self.start_time, self.prior_elapsed = start_time or time.time(), 0.0
        self.data = for_run(cfg, data or build_data(cfg))
        cfg, semi_note = choose_semi(cfg, resolve_device(cfg.device, local_rank()).type)  # (--semi auto)
        if semi_note and rank_and_world()[0] == 0:
            log(semi_note)
        # --semi: the images MAE learns from beside the labels (``pool``: read already), read or refused before
        # anything is planned
        if pool is None:
            pool = unlabelled_pool(cfg, self.data, self.data.with_train_fraction(cfg.train_fraction,
                                                                                 holdout=cfg.holdout),
                                   log if rank_and_world()[0] == 0 else lambda s: None)
        if plan_ is None:  # every "auto", the tier and the threads: decided by the planner (training/plan.py), or
            # on the run's own first steps where it leaves them to the run (training/tune.py)
            cfg, plan_ = make_plan(cfg, self.data, log=log, start_time=self.start_time, in_run=True)
        if semi_note:
            plan_.notes.append(semi_note)  # (plan.json)
        self.cfg, self.log, self.plan = cfg, log, plan_
        self.rank, self.world = rank_and_world()
        self.is_main, self.progress, self.stop_requested = self.rank == 0, progress and self.rank == 0, False
        self.device = resolve_device(cfg.device, local_rank())
        if self.world > 1 and self.device.type == "cuda":  # the rank's own GPU, the one NCCL bound it to
            self.device = torch.device("cuda", local_rank())
        self.precision = cfg.precision
        if self.precision == "tf32" and self.device.type != "cuda":  # TF32 tensor cores: fit() runs under them
            raise ValueError(f"--precision tf32 is for CUDA GPUs (TF32 tensor cores); on {self.device} use fp32 or "
                             "bf16")
        torch.manual_seed(cfg.seed + self.rank)
        self.data = resident(self.data.with_train_fraction(cfg.train_fraction, holdout=cfg.holdout), self.device,
                             log if self.is_main else lambda s: None)
        self.pool = None if pool is None else pool.to(self.data.train.images.device)
        if self.data.streamed:  # read from the files by the workers the planner chose
            self.data.train.workers = self.data.val.workers = cfg.workers if cfg.workers is not None else 2
            # on an accelerator the training split's workers live from epoch to epoch: a GPU epoch is short, and
            # starting a pool each time leaves it idle (on a CPU the pool's memory goes back between epochs, for
            # the evaluation's workers, as the memory plan counts them)
            self.data.train.keep_workers = self.device.type != "cpu"
            # JPEGs decoded by the workers, or by the batch on the training device (the plan's decode)
            self.data.train.device_decode = self.data.val.device_decode = cfg.decode == "device" and not cfg.naflex
        self._build()
        self.train_model = model_for_training(self.module, cfg, self.device, self.world, log,
                                              sharded=self.twin is not None)
        self.tuner = self._tuner()
        self._tune_t0: float | None = None  # when the optimizer step being timed for the tuner began
        self._chosen_at: tuple[float, float] | None = None  # (the budget's pace at the chosen settings, when)
        self._retiming = False  # the tuner is timing the thread count again, mid-run (_check_pace)
        check_batches(self.data.name, len(self.data.train), cfg.batch_size, cfg.grad_accum, self.world)
        self.sampler = GlobalBatchSampler(len(self.data.train), cfg.batch_size, self.rank, self.world, cfg.seed)
        batches = len(self.sampler) // cfg.batch_size  # whole batches an epoch, per process
        self.steps_per_epoch = batches // cfg.grad_accum
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.warmup_steps = self.planned_warmup = int(cfg.warmup_epochs * self.steps_per_epoch)
        self._warmup_planned = False  # whether a time-limit plan of this process has set the warmup (_set_plan)
        self.budget = TimeBudget(cfg.time_limit, self.steps_per_epoch, cfg.eval_every, self.total_steps,
                                 cfg.warmup_epochs * self.steps_per_epoch,
                                 cfg.batch_size * cfg.grad_accum * self.world, len(self.data.val),
                                 max_steps=cfg.max_epochs * self.steps_per_epoch if cfg.max_epochs else None) \
            if cfg.time_limit else None
        # the augmentation's and the masks' draws, made on the training device (no copy from the host a step)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 1000 + self.rank)
        # a CPU computes each loss before the next line runs: reading it every batch costs nothing there; a GPU
        # would wait for the queued work at each read
        self.read_every = 1 if self.device.type == "cpu" else READ_LOSS_EVERY
        self.epoch, self.step, self.batch_in_epoch, self.best_top1, self.last_top1 = 0, 0, 0, -math.inf, 0.0
        # epochs as a fraction of the batches trained (the epoch counter counts one a budget ended early: 56 steps of
        # a 390-step epoch said "epochs=1")
        self.epochs_trained = 0.0
        self.evaluated_at = 0  # the epoch of the last evaluation
        self.stall_checked = False  # whether the loss was compared with a uniform guess's (_check_learning)
        self.epoch_loss = [0.0, 0]  # this epoch's summed loss and images so far (kept across a stop and resume)
        self.batch_seconds: float | None = None  # the last batch's time (a stop waits about that long for it)
        self.saved = (0, 0.0, 0.0)  # last/'s latest write here: (step, when, seconds it took); step 0: none yet
        self.save_spent = [0.0, 0]  # seconds spent writing last/ at epoch ends, and the epoch ends they spread over
        self._said_at = time.time()  # the last progress line (for a log that is not a terminal)
        self.out = Path(cfg.output) if cfg.output else None
        self._check_ranks_agree(cfg)
        if cfg.resume:
            self._resume(Path(cfg.resume))
        self.runlog = RunLog(self.out, self.is_main, log)

    def _build(self) -> None:
        """The model, its preprocessing and augmentation, the optimiser and the loss, as ``self.cfg`` says."""
        cfg = self.cfg
        self.model = build_model(cfg, self.data).to(self.device)
        self.preprocessing = preprocessing_for(cfg, self.model, self.data)
        self.augment = augment_for(cfg, self.preprocessing, self.model.config).to(self.device)
        if cfg.freeze_body:
            self.log(f"--freeze-body: only the head trains ({freeze_body(self.model):,} parameters)")
        # what the loss compares: the labels, or the images alone (the module: the model and the objective's parts)
        self.objective = objective_for(cfg, self.augment, self.pool)
        self.module = self.objective.wrap(self.model).to(self.device)
        if getattr(self.objective, "note", "") and self.rank == 0:
            self.log(self.objective.note)
        # --shard: the layout set while the weights are whole, then each process keeps its share of them (the
        # optimizer is built on the shards); ``twin``: the model unsharded and empty, filled to save a checkpoint
        self.twin = None
        if cfg.shard is True and self.world > 1:  # ("auto": decided by make_plan, or left unsharded)
            apply_layout(self.module, cfg.attention, cfg.channels_last)
            self.twin = shard_module(self.module, self.device)
        self.optimizer = build_optimizer(self.module, cfg)
        self.ema = ModelEma(self.module, cfg.model_ema_decay) if cfg.model_ema else None
        tuning = self.plan.tuning if self.plan is not None else None
        fp16 = self.precision == "fp16" or "fp16" in ((tuning or {}).get("options") or {}).get("precision", [])
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)

    # ------------------------------------------------------------------------------------------ state
    def _rng_state(self) -> dict[str, Any]:
        """This process's random state: the CPU's, the augmentation generator's, and its own GPU's alone (not every
        visible GPU's: a resume may see fewer, and each rank draws from its own)."""
        rng = {"torch": torch.get_rng_state(), "gen": self.gen.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def _train_state(self, rng_ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What ``--resume`` needs; ``rng_ranks``: every rank's random state (``gather_objects``), rank 0's first."""
        rng_ranks = rng_ranks or [self._rng_state()]
        # a sharded run's weights and optimizer state: in shards/ beside it, each process's own (_save_sharded)
        weights = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()} \
            if self.twin is None else {"model": {}, "optimizer": {}, "shards": SHARDS,
                                       "joint": self.cfg.semi == "joint"}
        return {**weights, "ema": self.ema.state_dict() if self.ema else None, "scaler": self.scaler.state_dict(),
                "rng": rng_ranks[0], "rng_ranks": rng_ranks, "epoch": self.epoch, "step": self.step,
                "batch_in_epoch": self.batch_in_epoch, "epoch_loss": self.epoch_loss,
                "epochs_trained": self.epochs_trained, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "steps_per_epoch": self.steps_per_epoch,
                "best_top1": self.best_top1, "last_top1": self.last_top1, "elapsed_s": self.elapsed(),
                "world": self.world, "train_images": self.data.train.identity(), "masks": MASKS_DRAWN}

    def _resume(self, run_dir: Path) -> None:
        recover_run(run_dir)
        ckpt = run_dir / "last"
        if not ckpt.is_dir():
            raise FileNotFoundError(f"--resume {run_dir}: no last/ checkpoint in it")
        _check_same_classes(ckpt, list(self.data.classes), run_dir)
        s = load_train_state(ckpt)
        # (a classifier with MAE's decoder; a sharded state says so, its weights being in the shards)
        joint = s["joint"] if "shards" in s else any(str(k).startswith("decoder_") for k in s["model"])
        if self.cfg.objective == "classify" and joint != (self.cfg.semi == "joint"):
            raise ValueError(f"--resume {run_dir}: it was trained {'with' if joint else 'without'} --semi joint, and a "
                             f"resumed run goes on as it was: {'give' if joint else 'leave out'} --semi joint, or "
                             f"start a new run from its weights (--init {ckpt})")
        if "shards" in s:  # written by a sharded run: read into this run's layout, sharded or whole
            load_shards(self.module, self.optimizer, ckpt / s["shards"])
        elif self.twin is not None:  # a whole state into a sharded run
            load_whole(self.module, self.optimizer, s["model"], s["optimizer"])
        else:
            load_state_dict_into(self.module, s["model"], str(ckpt / "train_state.pt"))
            self.optimizer.load_state_dict(s["optimizer"])
        if self.ema is not None and s["ema"] is not None:
            self.ema.load_state_dict(s["ema"])
        if self.scaler.is_enabled() and s.get("scaler"):
            self.scaler.load_state_dict(s["scaler"])
        elif self.scaler.is_enabled():  # saved by a bf16/fp32 run: fp16's loss scale starts at its default
            self.log(f"--precision fp16: the run was saved without a loss scale (not in fp16); it starts at "
                     f"{self.scaler.get_scale():g}")
        self.epoch, self.step, self.batch_in_epoch = s["epoch"], s["step"], s["batch_in_epoch"]
        trained = s.get("epochs_trained")  # (none in a run saved by an older vitkit: its whole epochs and batches)
        self.epochs_trained = float(trained) if isinstance(trained, (int, float)) and not isinstance(trained, bool) \
            else self.epoch + self.batch_in_epoch / (self.steps_per_epoch * self.cfg.grad_accum)
        self.evaluated_at = self.epoch - self.epoch % self.cfg.eval_every
        self._set_rng_state(s)
        self.epoch_loss = s.get("epoch_loss", [0.0, 0])  # checked by load_train_state
        self.best_top1, self.last_top1, self.prior_elapsed = s["best_top1"], s["last_top1"], s["elapsed_s"]
        # with another number of processes, a step is another global batch: the steps saved are counted again at
        # this run's steps an epoch (a 2-process run stopped after its 22-step epoch 1 of 66 went on, on one
        # process, at step 22 of 132: an epoch more than its schedule, on an LR schedule half an epoch behind)
        other_world = s.get("world", 1) != self.world
        scale = self.steps_per_epoch / self._saved_steps_per_epoch(s) if other_world else 1.0
        if self.budget:  # keep the plan that fitted the schedule into the budget, its warmup too: back at the
            self.total_steps = round(s["total_steps"] * scale)  # recipe's, a resumed run past a shortened warmup
            warmup = s.get("warmup_steps")  # warmed up again (none in a run saved by an older vitkit)
            if type(warmup) is int and 0 <= round(warmup * scale) <= self.planned_warmup:
                self.warmup_steps, self._warmup_planned = round(warmup * scale), True
        if other_world:
            if self.batch_in_epoch:
                self.log(f"resuming with {self.world} processes instead of {s['world']}: restarting epoch "
                         f"{self.epoch}")
                self.batch_in_epoch, self.epoch_loss = 0, [0.0, 0]
            self.step = self.epoch * self.steps_per_epoch
        self._check_same_images(s.get("train_images"))
        if self.cfg.objective == "mpp" and "masks" not in s:  # saved before the masks were drawn by noise()
            self.log("resuming a masked patch prediction saved by an older vitkit, which drew each batch's corruption "
                     "otherwise: it continues from its weights, optimizer and random state, on other masks than it "
                     "would have drawn (not bit for bit as an uninterrupted run)")
        self.out = self.out or run_dir
        self.log(f"resumed from {ckpt}: epoch {self.epoch}, step {self.step}/{self.total_steps}")

    def _saved_steps_per_epoch(self, s: dict[str, Any]) -> int:
        """The steps an epoch of the saved run took (older states: counted as its sampler counts them)."""
        saved = s.get("steps_per_epoch")
        if type(saved) is int and saved > 0:
            return saved
        world = s.get("world", 1) if type(s.get("world", 1)) is int and s.get("world", 1) > 0 else 1
        sampler = GlobalBatchSampler(len(self.data.train), self.cfg.batch_size, 0, world, self.cfg.seed)
        return max(1, len(sampler) // self.cfg.batch_size // self.cfg.grad_accum)

    def _check_ranks_agree(self, cfg: TrainConfig) -> None:
        """Every process starts where rank 0 does. Each reads last/ from its own disk (after torchrun restarts the
        group too): nodes that do not share the --output folder would resume on one and start afresh on another,
        training one model from two states."""
        if self.world == 1:
            return
        found = None
        if cfg.resume:
            run = Path(cfg.resume)
            found = str(run.resolve()) if any((run / n).is_dir() for n in ("last", ".last.old")) else None
        where = gather_objects((bool(cfg.resume), found))
        if len({(asked, bool(d)) for asked, d in where}) > 1:  # (not the paths: nodes may mount one folder at two)
            said = "; ".join(f"rank {r} " + (f"resumes {d}/last" if d else "finds no last/ checkpoint" if asked
                                             else "starts afresh") for r, (asked, d) in enumerate(where))
            raise ValueError(f"the processes do not agree where the run stands ({said}): every process reads the "
                             "run folder, so --output (and a --resume folder) must be one that every node sees, on "
                             "a shared filesystem, at the same path")

    def _set_rng_state(self, s: dict[str, Any]) -> None:
        """Each rank continues from its own random state; with another number of processes than saved, each draws
        from a seed of (seed, rank, step), so that no two ranks draw the same crops (rank 0's state on every rank
        would)."""
        ranks = s.get("rng_ranks") or [s["rng"]]
        same_kind = len(ranks[0]["gen"]) == len(self.gen.get_state())  # (a CPU's generator state is not a GPU's)
        if len(ranks) == self.world and same_kind:
            rng = ranks[self.rank]
            torch.set_rng_state(rng["torch"])
            self.gen.set_state(rng["gen"])
            cuda = rng.get("cuda")
            if isinstance(cuda, (list, tuple)):  # written by an older vitkit: every visible GPU's state
                cuda = cuda[min(self.device.index or 0, len(cuda) - 1)] if cuda else None
            if cuda is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(cuda, self.device)
            return
        seed = (self.cfg.seed * 1000 + self.rank) * 1_000_003 + self.step
        torch.manual_seed(seed)
        self.gen.manual_seed(seed)
        if self.is_main:
            why = (f"with {self.world} process{'es' if self.world > 1 else ''} where {len(ranks)} saved their random "
                   "states" if same_kind else "on another kind of device than the run saved its random state on")
            self.log(f"resuming {why}: each process draws from a new seed of (--seed, rank, step)")

    def _check_same_images(self, saved: str | None) -> None:
        """Training images added or deleted since the run stopped (a streamed folder is read again, not cached):
        the sampler's order and the epoch's length are another, so a stop mid-epoch is not continued at its batch
        (it went on at "step 30/120" of an order that was never the run's). The epoch is counted as ended and the run
        goes on from the next one on the new images, its schedule kept in epochs."""
        now = self.data.train.identity()
        if saved is None or saved == now:
            return
        self.log(f"the training images changed since the run stopped ({saved} -> {now}): "
                 + (f"epoch {self.epoch + 1} is counted as ended at batch {self.batch_in_epoch}; " if self.batch_in_epoch
                    else "") + "the run goes on from the next epoch's start on the new images")
        if self.batch_in_epoch:
            self.epoch, self.batch_in_epoch, self.epoch_loss = self.epoch + 1, 0, [0.0, 0]
        if not self.budget:  # the epochs left, at the new epoch's length (a budget re-plans by itself)
            self.total_steps = self.step + max(0, self.cfg.epochs - self.epoch) * self.steps_per_epoch

    def elapsed(self) -> float:
        return self.prior_elapsed + time.time() - self.start_time

    def request_stop(self) -> None:
        self.stop_requested = True

    def _save(self, name: str, with_state: bool = True) -> None:
        """Rank 0 writes ``name``/; with the training state, every rank's random state goes into it (a collective:
        every rank calls this)."""
        rng_ranks = gather_objects(self._rng_state()) if with_state and self.out else None
        if not self.out:
            return
        if self.twin is not None:
            self._save_sharded(name, rng_ranks if with_state else None)
        elif self.is_main:
            to_save = self.ema.module if self.ema is not None else self.module
            save_checkpoint(self.out, name, to_save, self.preprocessing,
                            self._train_state(rng_ranks) if with_state else None)

    def _save_sharded(self, name: str, rng_ranks: list[dict[str, Any]] | None) -> None:
        """``name``/ of a sharded run (a collective): its weights whole, gathered to rank 0, and with the training
        state each process's shards of the weights and the optimizer state in ``shards/``, written into the
        checkpoint's new folder before rank 0 renames it into place."""
        whole = whole_copy(self.module, self.twin)
        new = self.out / f".{name}.new"
        if self.is_main:
            prepare_new(new)
        barrier()
        if rng_ranks is not None:
            write_new(new, name, self.out, lambda: save_shards(self.module, self.optimizer, new / SHARDS))
        if self.is_main:
            save_checkpoint(self.out, name, whole, self.preprocessing,
                            self._train_state(rng_ranks) if rng_ranks is not None else None, started=True)
            self.twin = whole.to("meta")  # (the whole weights go again: rank 0 holds them only to write them)
        barrier()

    def _last_due(self) -> bool:
        """Whether this epoch's end writes last/ (rank 0's choice on every rank: the write is a collective): the
        first epoch's end here, the schedule's last, and any once the training since the last write took
        1/``SAVE_SHARE`` times what that write took."""
        step, when, took = self.saved
        due = step == 0 or self.step >= self.total_steps or time.time() - when >= took / SAVE_SHARE
        return bool(broadcast_ints([int(due)], self.device)[0])

    def _save_last(self) -> None:
        t = time.time()
        self._save("last")
        took = time.time() - t
        self.saved = (self.step, time.time(), took)
        self.save_spent[0] += took

    def _set_plan(self, plan: tuple[int, int, int] | None) -> None:
        """Adopt a time-limit plan (rank 0's on every rank: ranks time themselves differently): total steps, warmup
        steps, and the step of the next re-plan."""
        if plan is not None:
            # a warmup still under way is set by this process's first plan and lengthened by the later ones (never
            # past the recipe's, never back to a step taken): the first plan, from steps 5-13 of a compiled GPU run
            # at twice the steady pace, cut an H200's Fashion-MNIST warmup from 52 steps to 24 for good, and at lr
            # 0.0057 and batch 4096 its loss sat at a uniform guess's for 6 epochs (80.30% in 2 minutes; 93.18% with
            # 71 steps of warmup). Only lengthened: following every plan both ways made the LR zigzag through a
            # warmup of 10 epochs. Once it is over it stays (it places the cosine)
            warmup = self.warmup_steps
            if self.step < self.warmup_steps:
                follow = plan[1] if not self._warmup_planned else max(plan[1], self.warmup_steps)
                warmup = max(min(follow, self.planned_warmup), self.step + 1)
                self._warmup_planned = True
            total, warmup, next_check = broadcast_ints([plan[0], warmup, plan[2]], self.device)
            self.total_steps, self.warmup_steps = max(total, self.step), warmup
            self.budget.next_check = next_check

    def _space_evaluations(self) -> None:
        """Under a time limit, evaluate less often where evaluating every ``eval_every`` epochs would take more than
        ``EVAL_SHARE`` of the training time (rank 0's choice on every rank: they evaluate together); a line says
        when the gap grows."""
        every = broadcast_ints([self.budget.spaced_eval_every(self.cfg.eval_every)], self.device)[0]
        if every > self.budget.eval_every and self.is_main:
            n, epoch_s = len(self.data.val), self.budget.sec_per_step * self.steps_per_epoch
            share = self.budget.eval_guess / (epoch_s * self.cfg.eval_every)
            self.log(f"evaluating every {every} epochs from here: an evaluation of {n:,} images takes "
                     f"~{self.budget.eval_guess:.1f} s, {self.budget.eval_guess / epoch_s:.2f} of an epoch's "
                     f"training, and every {self.cfg.eval_every} would add {share:.0%} to the training time (at most "
                     f"{EVAL_SHARE:.0%}; the last epoch is always evaluated)")
        self.budget.eval_every = every

    def _diverged(self, loss: float) -> None:
        rng_ranks = gather_objects(self._rng_state()) if self.out else None
        if self.twin is not None and self.out:
            self._save_sharded("diverged", rng_ranks)
        elif self.is_main and self.out:
            save_checkpoint(self.out, "diverged", self.module, self.preprocessing, self._train_state(rng_ranks))
        if self.is_main and self.out:
            self.log(f"diverged state written to {self.out / 'diverged'}")
        raise TrainingDiverged(f"loss is {loss} at epoch {self.epoch} step {self.step}; last/ and best/ are kept "
                               f"as they were. Lower {'--blr' if self.cfg.blr is not None else '--lr'}, add "
                               "--clip-grad, or use --precision fp32.")

    # ------------------------------------------------------------------------------------------ deciding while training
    def _tuner(self) -> StepTuner | None:
        """The tuner of the settings the planner left to the run's first steps (``Plan.tuning``): one process, an
        eager step (a compiled or DDP-wrapped model keeps the settings it was built with)."""
        tuning = self.plan.tuning if self.plan is not None else None
        self._matmul_before = torch.get_float32_matmul_precision()  # (restored when the run ends)
        self._layout = (self.cfg.attention, self.cfg.channels_last)
        self._trial: CompileTrial | None = None  # the compiled step, where the tuning tries one
        if not tuning or self.world > 1 or self.cfg.compile:
            return None
        self._load = OtherLoad().__enter__()  # whether others held the cores while the settings were timed
        return StepTuner(tuning["start"], tuning["options"], tuning["threads"])

    def _apply_settings(self, s: dict[str, Any]) -> None:
        """The step's settings for the steps that follow: threads, precision, attention path and layout."""
        if s.get("threads") and s["threads"] != torch.get_num_threads():
            torch.set_num_threads(s["threads"])
        self.precision = s["precision"]
        torch.set_float32_matmul_precision("high" if self.precision == "tf32" else self._matmul_before)
        if (s["attention"], s["channels_last"]) != self._layout:
            apply_layout(self.module, s["attention"], s["channels_last"])
            self._layout = (s["attention"], s["channels_last"])
        compiled = bool(s.get("compile"))
        if compiled != (self.train_model is not self.module):  # (a model compiled from the start stays so)
            if compiled and self._trial is None:  # built on the step the settings before it chose
                self._trial = CompileTrial(self.module, self._compile_failed)
            self.train_model = self._trial if compiled else self.module

    def _mark_load(self, cal: Calibration) -> None:
        """A timing taken while others held the cores says so (``store_unless_loaded`` then keeps it out of the
        cache)."""
        if self._load.contended(torch.get_num_threads()):
            cal.extra["other_load_cores"] = round(self._load.cores, 2)

    def _compile_failed(self, e: BaseException) -> None:
        why = f"failed: {' '.join(str(e).split())}"[:160]
        if self.tuner is not None:
            self.tuner.fail(why)
        if self.is_main:
            self.log(f"compile: {why}; the run trains on eagerly")

    def _say_progress(self, loss: float, img_s: float) -> None:
        """One line of how the run is going, for a log that is not a terminal (no progress bar there)."""
        self._said_at = time.time()
        elapsed = self.elapsed()
        if self.budget:
            left = max(0.0, self.budget.seconds - elapsed)
            share = f", {elapsed / (self.cfg.time_limit * 60):.0%} of the {self.cfg.time_limit:g}-minute budget"
        else:
            pace = self.batch_seconds or 0.0
            left = (self.total_steps - self.step) * self.cfg.grad_accum * pace
            share = ""
        of = "" if self.budget and self.budget.sec_per_step is None else f"/{self.total_steps}"  # (none fitted yet)
        self.log(f"step {self.step}{of} (epoch {self.epoch + 1}): loss {loss:.4f}, {img_s:.0f} img/s"
                 f"{share}, ~{left:.0f} s left")

    def _check_pace(self) -> None:
        """Where the pace has moved ``RETIME_PACE`` times from the one the threads were chosen at (another process
        started or stopped beside the run), the thread count is timed again on the next steps: two OpenMP threads
        sharing a core with a busy process ran the default digits run 2.7x slower than one (115-124 s against
        43-44 s, results/threads-contention.csv). At most once every ``RETIME_EVERY`` of the budget."""
        counts = (self.plan.tuning or {}).get("threads") if self.plan is not None else None
        pace, at = self.budget.sec_per_step, self._chosen_at
        # (a step compiled on its run's steps keeps the thread count it was compiled at: Inductor's CPU kernels
        # carry it in their OpenMP pragmas)
        if not counts or not pace or self.world > 1 or self.train_model is not self.module:
            return
        if at is None:  # the first pace measured at the chosen settings: what later paces are compared with
            self._chosen_at = (pace, self.elapsed())
            return
        ratio = pace / at[0]
        if (1 / RETIME_PACE < ratio < RETIME_PACE) or self.elapsed() - at[1] < RETIME_EVERY * self.budget.seconds:
            return
        if self.is_main:
            self.log(f"the step's pace moved from {at[0] * 1e3:.0f} to {pace * 1e3:.0f} ms (another process started "
                     "or stopped beside the run?): timing the thread count again on the next steps")
        self.tuner = StepTuner({**{k: getattr(self.cfg, k) for k in TUNED}, "threads": torch.get_num_threads()}, {},
                               counts)
        self._retiming = True
        self._load = OtherLoad().__enter__()

    def _tune_before_step(self) -> None:
        """Before an optimizer step while the tuner decides: its settings, and the clock. The tuning ends early
        where it has taken ``TUNE_BUDGET_SHARE`` of a time budget."""
        assert self.tuner is not None
        if self.budget and self.tuner.seconds > TUNE_BUDGET_SHARE * self.budget.seconds:
            self.tuner.stop()
        s = self.tuner.next()
        if s is None:
            self._tuned()
            return
        self._apply_settings(s)
        self._tune_t0 = time.perf_counter()

    def _tune_after_step(self) -> None:
        assert self.tuner is not None and self._tune_t0 is not None
        if self.device.type == "cuda":  # the step's kernels are queued: its time is when they end
            torch.cuda.synchronize(self.device)
        self.tuner.record(time.perf_counter() - self._tune_t0)
        self._tune_t0 = None
        if self.tuner.done:
            self._tuned()

    def _tuned(self) -> None:
        """The tuning is over: the run trains on with the chosen settings, and its plan (plan.json, config.yaml,
        the cache) says what they are and how they were timed."""
        tuner, self.tuner, self._tune_t0 = self.tuner, None, None
        assert tuner is not None
        tuner.stop()
        chosen = tuner.chosen
        self._apply_settings(chosen)
        self._chosen_at = None  # (the budget's next pace, at these settings)
        if self._retiming:  # the thread count again, mid-run: a line, and the budget's pace measured anew
            self._retiming = False
            self._load.__exit__(None, None, None)
            line = tuner.threads_line(usable_cores())
            self.plan.notes.append(f"at step {self.step}: {line}")
            self.plan.chosen["threads"] = torch.get_num_threads()
            if self.is_main:
                self.log(f" {line}")
            if self.budget:
                self.budget.mark, self.budget.next_check = (self.step, self.elapsed()), self.step + WARM_STEPS
            return
        if not chosen.get("compile"):
            self._trial = None  # (the compiled code is freed with it)
        self.cfg = TrainConfig.from_dict({**self.cfg.to_dict(), **{k: chosen[k] for k in TUNED}})
        self.first_step = self.step  # the budget's pace is measured from here, at the chosen settings
        if self.scaler.is_enabled() and self.precision != "fp16":  # (enabled for an fp16 candidate)
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=False)
        self._load.__exit__(None, None, None)
        tuning, p = self.plan.tuning, self.plan
        cal = tuner.calibration(f"{tuning['what']}; timed on the run's first steps, each of which trained")
        if cal is not None:
            self._mark_load(cal)
            p.calibrations.append(cal)
            if tuning.get("workload") and tuner.step_phases:
                store_unless_loaded(self.device, {**tuning["workload"], "candidates": tuning["candidates"]}, cal)
        timed = tuner.compile_calibration("compile (the chosen step); timed on the run's own steps")
        if timed is not None:
            self._mark_load(timed)
            p.calibrations.append(timed)
            if tuning.get("compile_workload"):  # (the next run's compile decision reads it: nothing timed there)
                store_unless_loaded(self.device, {**tuning["compile_workload"],
                                                  "settings": {k: chosen[k] for k in STEP_SETTINGS}}, timed)
        if (line := tuner.threads_line(usable_cores())) is not None:
            p.notes.append(line)
        p.notes += tuner.lines()
        p.chosen.update({k: chosen[k] for k in TUNED}, threads=torch.get_num_threads())
        p.tuned = {"steps": tuner.steps, "seconds": round(tuner.seconds, 2), "excess_s": round(tuner.excess_s, 2)}
        if self.is_main:
            for line in tuner.lines():
                self.log(line)
            self.log(" chosen: " + ", ".join(f"{k} {v}" for k, v in p.chosen.items()))
        self.runlog.replan(self.cfg.to_dict(), p)
        if (self.budget and self.budget.sec_per_step is None and self.step < self.total_steps
                and not self.stop_requested and (pace := tuner.pace())):
            self._adopt_plan(self.budget.paced(self.step, self.elapsed(), pace))

    # ------------------------------------------------------------------------------------------ loop
    def train_epoch(self) -> tuple[float, float]:
        """One epoch (or what is left of it after a resume); returns (the epoch's mean loss, images per second)."""
        cfg = self.cfg
        if self.batch_in_epoch == 0:
            self.epoch_loss = [0.0, 0]
        first_batch = self.batch_in_epoch
        self.train_model.train()
        self.sampler.set_epoch(self.epoch)
        indices = list(iter(self.sampler))[: self.steps_per_epoch * cfg.grad_accum * cfg.batch_size]
        it = batches(self.data.train, indices[self.batch_in_epoch * cfg.batch_size:], cfg.batch_size, True,
                     self.device)
        bar = tqdm(total=self.steps_per_epoch * cfg.grad_accum - self.batch_in_epoch, desc=f"epoch {self.epoch + 1}",
                   leave=False, mininterval=1.0, dynamic_ncols=True, disable=not self.progress)
        release_free_memory()  # (after an evaluation: its freed heap goes back before the steps allocate theirs)
        seen, t0 = 0, time.time()
        t_batch = t0
        # the losses summed where they are computed, read (one wait for the device) every `read_every` batches: the
        # divergence check, the epoch's loss, the progress bar and the ranks' stop vote happen at those reads
        acc = torch.float32 if self.device.type == "mps" else torch.float64  # (MPS has no float64)
        pending, pending_n = torch.zeros((), dtype=acc, device=self.device), 0
        for x, y in it:
            if self.step >= self.total_steps:
                break
            if self.plan is not None and self.plan.first_step_s is None:
                self.plan.first_step_s = round(self.elapsed() - self.prior_elapsed, 2)
            if self.tuner is not None and self.batch_in_epoch % cfg.grad_accum == 0:
                self._tune_before_step()
            x, target = self.augment(x, y, train=True, generator=self.gen)
            with gradients_reduced(self.train_model, now=(self.batch_in_epoch + 1) % cfg.grad_accum == 0):
                with autocast_for(self.device, self.precision):
                    loss = self.objective.loss(self.train_model, x, target, self.gen)
                pending += loss.detach().to(acc) * len(y)
                pending_n += len(y)
                read = (self.batch_in_epoch + 1) % self.read_every == 0
                if read:  # (before the backward: a NaN loss is never stepped on when it is read at once)
                    lv = self._read_loss(pending, pending_n)
                    pending_n = 0
                self.scaler.scale(loss / cfg.grad_accum).backward()
            self.batch_in_epoch += 1
            if self.batch_in_epoch % cfg.grad_accum == 0:
                self._optimizer_step()
            seen += len(y)
            self.batch_seconds, t_batch = time.time() - t_batch, time.time()
            bar.update(1)
            if read and not self.progress and self.is_main and time.time() - self._said_at >= PROGRESS_EVERY_S:
                self._say_progress(lv, seen * self.world / max(time.time() - t0, 1e-6))
            if read:
                bar.set_postfix(loss=f"{lv:.3f}", lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                                img_s=f"{seen * self.world / max(time.time() - t0, 1e-6):.0f}", refresh=False)
                if any_rank(self.stop_requested, self.device):
                    self.stop_requested = True
                    break
        if pending_n:
            self._read_loss(pending, pending_n)
            if any_rank(self.stop_requested, self.device):
                self.stop_requested = True
        bar.close()
        self.epochs_trained += (self.batch_in_epoch - first_batch) / (self.steps_per_epoch * cfg.grad_accum)
        return self.epoch_loss[0] / max(self.epoch_loss[1], 1), seen * self.world / max(time.time() - t0, 1e-6)

    def _read_loss(self, pending: torch.Tensor, n: int) -> float:
        """The mean loss of the ``n`` images summed in ``pending`` since the last read (the one wait for the device
        in ``read_every`` batches), added to the epoch's; a NaN or Inf on any rank stops the run. ``pending`` is
        zeroed for the next stretch."""
        total = float(pending)
        pending.zero_()
        lv = total / n
        if any_rank(not math.isfinite(lv), self.device):
            self._diverged(lv)
        self.epoch_loss = [self.epoch_loss[0] + total, self.epoch_loss[1] + n]
        return lv

    def _optimizer_step(self) -> None:
        cfg = self.cfg
        set_lr(self.optimizer, lr_at(self.step, self.total_steps, self.warmup_steps, cfg.lr, cfg.min_lr))
        if cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.module.parameters(), cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.module)
        self.step += 1
        if self._tune_t0 is not None:
            self._tune_after_step()
        if self.budget and self.tuner is None:  # (the pace is measured from the settings the run trains with)
            if self.device.type == "cuda" and self.budget.measures_at(self.step, self.first_step):
                torch.cuda.synchronize(self.device)  # the device's pace, not how fast the host queued the steps
            self._adopt_plan(self.budget.after_step(self.step, self.elapsed(), self.first_step))

    def _adopt_plan(self, replan: tuple[int, int, int] | None) -> None:
        """A plan of the budget's, from the pace just measured: set, checked against an evaluation's time (the
        first) and against the pace the threads were chosen at."""
        self._set_plan(replan)
        if replan is not None and self.budget.eval_s is None:
            self._time_an_evaluation()
        if replan is not None:
            self._check_pace()

    def _time_an_evaluation(self) -> None:
        """At the budget's first plan: a slice of the validation split evaluated twice, the second timed, scaled to
        the whole split. Until an evaluation was timed, the plan reserved one at a guess (a third of a training
        image's time an image), and a run that ends inside its first epoch evaluates only at its end: a 5-minute
        CIFAR-10 run beside a busy process reserved ~73 s for it, ended at 279 s of 300 (93%), and never knew."""
        n = min(len(self.data.val), EVAL_PROBE)
        if n == 0:
            return
        part = self.data.val.subset(torch.arange(n))
        for _ in range(2):  # (the first call builds the evaluation's kernels at its batch; the second is timed)
            t = time.time()
            self.evaluate(part, n)
        self.budget.eval_s = (time.time() - t) * len(self.data.val) / n
        self.budget.eval_pace = self.budget.sec_per_step
        self._set_plan((*self.budget.plan(self.step, self.elapsed(), self.budget.sec_per_step, self.budget.eval_guess),
                        self.budget.next_check))

    def _eval_due(self) -> bool:
        """Evaluate every ``eval_every`` epochs (under a time limit the budget's, which may grow), and always after
        the last one (or when stopping)."""
        every = self.budget.eval_every if self.budget else self.cfg.eval_every
        return self.epoch - self.evaluated_at >= every or self.step >= self.total_steps or self.stop_requested

    def _evaluate_and_keep_best(self) -> dict[str, Any]:
        """Evaluate (timed, for the time-limit plan) and save ``best/`` when top-1 improved. While the step's
        settings are still being decided, the evaluation runs at the ones the run would keep if the tuning ended now
        (at its end: they are kept), so that the checkpoint's top-1 is what ``vitkit eval`` of it reproduces: a
        5-step NaFlex run evaluated at a bf16 candidate (22.50%) and recorded fp32 (25.00% under eval)."""
        if self.tuner is not None and self.step >= self.total_steps:
            self._tuned()
        elif self.tuner is not None:
            self._apply_settings(self.tuner.chosen)  # (the next step takes the tuner's next settings again)
        t = time.time()
        release_free_memory()  # the training step's freed heap goes back first: see runtime/memory.py
        metrics = self.evaluate()
        self.evaluated_at = self.epoch
        if self.budget:
            self.budget.evaluated(time.time() - t)
            self._space_evaluations()
        self.last_top1 = self.objective.score(metrics)  # top-1 for classify; the objective's own score else
        if self.last_top1 > self.best_top1:
            self.best_top1 = self.last_top1
            self._save("best", with_state=False)
        return metrics

    def _draw_reconstruction(self) -> None:
        """A self-supervised run's figure of a few validation images at this epoch: as they are, as the model saw
        them, as it predicted them (training/ssl_figure.py), ``recon/epoch-NNN.png`` in the run folder."""
        module = self.ema.module if self.ema is not None else self.module
        n = min(FIGURE_IMAGES, len(self.data.val))
        x, y = next(batches(self.data.val, list(range(n)), n, False, self.device))
        x, _ = self.augment(x, y, train=False)
        raw, seen, filled, loss = ssl_pictures(module, x, self.augment.mean.flatten() / 255,
                                               self.augment.std.flatten() / 255)
        if not self.is_main:
            return
        draw(raw, seen, filled, self.out / "recon" / f"epoch-{self.epoch:03d}.png",
             f"{self.cfg.objective}, epoch {self.epoch}: loss {loss:.4f} on these images\n{how_filled(module)}")

    def evaluate(self, split: Any = None, batch_size: int | None = None) -> dict[str, Any]:
        return self.evaluate_model(self.ema.module if self.ema is not None else self.module, split, batch_size)

    def evaluate_model(self, model: nn.Module, split: Any = None, batch_size: int | None = None) -> dict[str, Any]:
        """``model`` on the validation split (or ``split``), as the run evaluates its own (batch, precision,
        ranks)."""
        return self.objective.evaluate(model, self.data.val if split is None else split,
                                       self.model.config.num_classes, self.device,
                                       batch_size or self.cfg.eval_batch_size,
                                       self.precision if self.precision == "bf16" else "fp32", self.rank, self.world)

    def _announce(self) -> None:
        cfg = self.cfg
        self.log(self.data.describe() + (f" (--train-fraction {cfg.train_fraction:g}: a class-balanced share, the same "
                                         "images for every model and seed)" if cfg.train_fraction < 1 else ""))
        what = f"--init {cfg.init}" if cfg.init else cfg.model
        self.log(f"model {what}: {self.model.num_params:,} parameters on {self.device} in {self.precision}; "
                 f"{self.steps_per_epoch} steps/epoch, global batch {cfg.batch_size * self.world * cfg.grad_accum}")
        if cfg.objective != "classify":
            parts = sum(p.numel() for n, p in self.module.named_parameters() if not n.startswith("encoder."))
            self.log(f"pre-training by {cfg.objective} ({parts:,} parameters in its own parts beside the encoder; the "
                     "labels are not read)")
            if cfg.objective == "mpp" and self.model.config.in_chans == 1 and cfg.mpp_target != "l2":
                self.log("mpp on one channel: 8 gray levels (3 bits) are the colour classes, not the paper's 512 "
                         "colours of 3 channels")
        if cfg.semi and self.pool is not None:
            rest = len(self.pool) - len(self.data.train)
            weight = self.objective.weight  # type: ignore[attr-defined]
            if cfg.semi == "joint":
                parts = sum(p.numel() for n, p in self.module.named_parameters() if not n.startswith("encoder."))
                how = (f"MAE's loss (weight {weight:g}, mask ratio {self.module.mask_ratio:g}, a decoder of "
                       f"{parts:,} parameters) beside the cross-entropy")
            else:
                how = (f"pseudo-labels of weakly augmented images where the model's softmax reaches "
                       f"{cfg.semi_threshold:g} train their strongly augmented views (weight {weight:g})")
                classes = self.model.config.num_classes
                cap = 1 - cfg.smoothing * (classes - 1) / classes  # what label smoothing trains the softmax towards
                if cfg.smoothing and cfg.semi_threshold >= cap:
                    self.log(f"warning: label smoothing {cfg.smoothing:g} trains the softmax towards {cap:.3g} at "
                             f"most, under --semi-threshold {cfg.semi_threshold:g}: few pseudo-labels will be "
                             "confident enough (FixMatch trains without smoothing: --smoothing 0, or a lower "
                             "--semi-threshold)")
            self.log(f"--semi {cfg.semi}: {how}, on {cfg.unlabeled_ratio} image{'s' if cfg.unlabeled_ratio > 1 else ''}"
                     f" a labelled one drawn from {len(self.pool):,}: {rest:,} unlabelled and the "
                     f"{len(self.data.train):,} labelled")
        for key, what in (("muon_stem", "the stem's filters"), ("muon_embed", "the patch embedding")):
            if getattr(cfg, key) and cfg.opt != "muon":  # the recipes set them with opt muon; a user's --opt wins
                self.log(f"{key} has no effect with --opt {cfg.opt}: it puts {what} under Muon")
        if cfg.adam_beta2 != 0.999 and cfg.opt == "sgd":  # (Muon's AdamW part takes it)
            self.log(f"adam_beta2 {cfg.adam_beta2:g} has no effect with --opt sgd: it is AdamW's second-moment decay")
        if cfg.layer_decay is not None and not cfg.init:
            self.log(f"layer_decay {cfg.layer_decay:g} on weights trained from scratch: the early blocks learn at "
                     f"{cfg.layer_decay:g}^depth of the learning rate (it is meant for fine-tuning pretrained weights, "
                     "whose early blocks hold what is to be kept)")

    def fit(self) -> RunResult:
        self.runlog.open(self.cfg.to_dict(), self.plan)
        self._said_at = time.time()  # the last progress line (for a log that is not a terminal)
        if self.is_main:
            self._announce()
        try:
            with matmul_precision(self.precision):  # tf32: the whole run's matmuls, backward too; restored after
                self._epochs()
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            self.runlog.close()
            raise ValueError(self._what_did_not_fit()) from None
        finally:
            torch.set_float32_matmul_precision(self._matmul_before)  # (a tuned run sets it as its settings change)
        if self.plan is not None:
            self.runlog.replan(self.cfg.to_dict(), self.plan)  # with what the run measured of itself
        self.runlog.close()
        return RunResult(self.last_top1, self.best_top1, self.epoch, self.step, self.elapsed(),
                         self.stop_requested, self.out, round(self.epochs_trained, 4))

    def _what_did_not_fit(self) -> str:
        """One line for an out-of-memory error in training or evaluation: what did not fit and what to lower."""
        cfg, c = self.cfg, self.model.config
        h, w = to_2tuple(c.img_size)
        free = ""
        if self.device.type == "cuda":
            free_b, total_b = torch.cuda.mem_get_info(self.device)
            free = f"; {free_b / 2**30:.1f} of {total_b / 2**30:.1f} GiB free on {self.device}"
        smaller = max(1, cfg.batch_size // 2)
        return (f"out of memory training {cfg.init or cfg.model} ({self.model.num_params:,} parameters) at batch "
                f"{cfg.batch_size} of {h}x{w} images in {self.precision} on {self.device} (evaluation batch "
                f"{cfg.eval_batch_size}){free}. Lower --batch-size (to {smaller}; --grad-accum "
                f"{2 * cfg.grad_accum} keeps the global batch) or --eval-batch-size, or train a smaller --img-size "
                "or model" + ("; --precision bf16 halves the activations" if self.precision == "fp32" else "")
                + ("; --grad-checkpointing keeps a fraction of them (each block's recomputed in the backward pass)"
                   if not cfg.grad_checkpointing else ""))

    def _epochs(self) -> None:
        cfg = self.cfg
        self.first_step = self.step  # this process's first step (after a resume too): the budget's pace is measured
        # from a few steps after it, past compiling and warm-up
        while self.step < self.total_steps and not self.stop_requested:
            step0 = self.step
            train_loss, img_s = self.train_epoch()
            if self.stop_requested and self.batch_in_epoch % (self.steps_per_epoch * cfg.grad_accum):
                break  # mid-epoch stop: save and leave; --resume continues from this batch
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0  # (or the schedule ended mid-epoch: the time budget)
            metrics = self._evaluate_and_keep_best() if self._eval_due() else None
            if metrics is not None and self.cfg.objective != "classify" and self.out and \
                    (self.is_main or self.twin is not None):  # (a sharded model's forward is a collective)
                self._draw_reconstruction()
            if self._last_due():
                self._save_last()
            self.save_spent[1] += 1
            # re-plan after the evaluation and the save, so the plan sees what they cost (the writes of last/ spread
            # over the epochs they cover); a schedule that has ended stays ended (its LR is at the end of the cosine:
            # a few more steps there are not worth another evaluation)
            if self.budget and step0 < self.step < self.total_steps:
                self._set_plan(self.budget.after_epoch_end(self.step, self.elapsed(),
                                                           self.save_spent[0] / self.save_spent[1]))
                if metrics is None and self._eval_due():  # the re-plan left no time for another epoch
                    metrics = self._evaluate_and_keep_best()
                    self._save_last()  # with the final top-1 in its training state
            self._log_epoch(train_loss, img_s, metrics)
            self._check_learning(train_loss)
        if self.tuner is not None:  # the run ended (or stopped) before its settings were all decided
            self._tuned()
        self._say_if_ended_early()
        if self.stop_requested or self.saved[0] != self.step:  # a stop, or epochs trained since the last write
            self._save("last")
        if self.stop_requested and self.is_main:
            self.log(f"stopped at epoch {self.epoch} batch {self.batch_in_epoch}; last/ saved "
                     f"(resume with --resume {self.out})" if self.out else "stopped")

    def _say_if_ended_early(self) -> None:
        """Under a time limit, a recipe whose schedule ended well inside the budget (digits' 40 epochs in 37 s of a
        1-minute one) says so, and how to use the rest: --max-epochs lets the schedule grow to the budget."""
        if not self.budget or self.stop_requested or not self.is_main or self.step < self.total_steps:
            return
        used = self.elapsed() / (self.cfg.time_limit * 60)
        if used >= EARLY_END:
            return
        grown = self.cfg.max_epochs is not None and self.total_steps >= (self.budget.max_steps or 0)
        self.log(f"the schedule's {self.epochs_trained:g} epochs ended at {self.elapsed():.0f} s, {used:.0%} of the "
                 f"{self.cfg.time_limit:g}-minute budget: " + (
                     f"--max-epochs {self.cfg.max_epochs} was reached; a larger one lets it grow further" if grown
                     else "--max-epochs N lets the schedule grow to fill the budget (to N epochs at most)"))

    def _check_learning(self, train_loss: float) -> None:
        """Says once, a tenth of the way into the schedule (or three warmups), where a classifier's training loss is
        still within 5% of a uniform guess's (the run goes on: the user decides)."""
        classes = self.model.config.num_classes
        due = max(STALL_SHARE * self.total_steps, STALL_WARMUPS * self.warmup_steps)
        if self.stall_checked or self.cfg.objective != "classify" or classes < 2 or self.step < due:
            return
        self.stall_checked = True
        chance = math.log(classes)
        if self.is_main and train_loss >= STALL_LOSS * chance:
            cfg = self.cfg
            self.log(f"warning: after {self.step} of {self.total_steps} steps the training loss {train_loss:.3f} is "
                     f"still a uniform guess's over {classes} classes (ln {classes} = {chance:.2f}): the model is not "
                     f"learning. A learning rate too high for this model and batch does this (lr {cfg.lr:g} at batch "
                     f"{cfg.batch_size * cfg.grad_accum * self.world}): try a lower --lr, a longer --warmup-epochs "
                     "or --clip-grad 1")

    def _log_epoch(self, train_loss: float, img_s: float, metrics: dict[str, Any] | None) -> None:
        row = {"epoch": self.epoch, "step": self.step, "train_loss": round(train_loss, 5),
               "lr": self.optimizer.param_groups[0]["lr"], "img_per_s": round(img_s, 1),
               "precision": self.precision}  # what "auto" became on this machine
        said = f"epoch {self.epoch}: train_loss {train_loss:.4f}"
        if metrics is not None:
            row.update(self.objective.row(metrics))
            said += self.objective.said(metrics)
        if (share := getattr(self.objective, "confident_share", lambda: None)()) is not None:  # --semi fixmatch
            row["confident_share"] = round(share, 4)
            said += f", {share:.0%} pseudo-labels confident"
        skipped = getattr(self.data.train, "skipped_in_training", 0) + getattr(self.data.val, "skipped_in_training", 0)
        if skipped:  # listed, then did not decode in a worker (--skip-bad-images): counted, as the run goes
            row["skipped_images"] = skipped
            said += f", {skipped} image{'s' if skipped != 1 else ''} that did not decode skipped"
        row["elapsed_s"] = round(self.elapsed(), 2)
        self.runlog.epoch(row)
        if self.is_main:
            self.log(f"{said} ({img_s:.0f} img/s, {self.elapsed():.0f}s)")
        if self.on_epoch is not None:
            self.on_epoch(self, row)


def _check_same_classes(ckpt: Path, classes: list[str], run_dir: Path) -> None:
    """A resumed run trains on the classes its head was trained for: other class folders (another --data-dir)
    would train on and rewrite the checkpoint's class names, with every label meaning another class."""
    saved = _class_names(ckpt)
    if isinstance(saved, list) and saved and saved != classes:
        if _class_names(run_dir / "best") == classes:  # the run's other checkpoint agrees with the data: the file
            raise ValueError(f"--resume {run_dir}: {ckpt / CONFIG_NAME} lists the classes {_short(saved)}, but the "
                             f"run's best/ and this data have {_short(classes)}: {ckpt / CONFIG_NAME} was changed "
                             "after the run wrote it; restore it, or start a new run (another --output)")
        diff = sorted(set(saved) ^ set(classes))
        raise ValueError(f"--resume {run_dir}: the run trained on the classes {_short(saved)}, but this data has "
                         f"{_short(classes)}" + (f" (differ: {_short(diff)})" if diff else " (in another order)")
                         + ": resume with the run's own --data-dir, or start a new run (another --output)")


def _class_names(ckpt: Path) -> Any:
    """A checkpoint's class names as its config.json lists them; None where it cannot be read (load_train_state and
    the weights' own checks name what is wrong then)."""
    try:
        return json.loads((ckpt / CONFIG_NAME).read_text()).get("preprocessing", {}).get("class_names")
    except (OSError, ValueError, AttributeError):
        return None


def _short(names: list[str], n: int = 6) -> str:
    return "[" + ", ".join(names[:n]) + (f", ... {len(names)} in all" if len(names) > n else "") + "]"


def _out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)

