"""The run planner: recipe + config file + flags + budget + device -> the final ``TrainConfig`` and a ``Plan``.

It is the one place where a run's settings are decided. Layers, last wins: the shipped recipe
(``configs/<dataset>.yaml``, or ``finetune.yaml`` with ``--init``, or for a folder the recipe its images call for),
a ``--config`` file, the flags. Then, for every ``auto``, the candidates are timed on the run's own training step
(forward, backward and optimizer step of its model on a real batch; runtime/calibrate.py):

- precision (fp32 / bf16), attention path (fused SDPA / exact), the conv weights' memory layout;
- with a ``--time-limit``: the recipe's tier, by the epochs the budget buys of the fastest candidate;
- compile, where the budget could repay the compile time (measured here, or ~30 s before it has been);
- CPU threads, on the chosen step (runtime/threads.py): measured every run, since load changes from run to run.

The ``Plan`` records every candidate timed, what was chosen and why; it is printed at the start of the run and
saved as ``plan.json`` in the run folder.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..data.augment import BatchAugment, batches
from ..data.datasets import FILE_DATASETS, DataSplits, default_cache_dir, load_dataset
from ..data.stream import choose_workers
from ..interop.pretrained import init_image_size, init_preprocessing
from ..model.config import to_2tuple
from ..runtime.calibrate import Calibration, Timing, cached, calibrate, store, time_candidates
from ..runtime.compile import has_cxx_compiler
from ..runtime.cpu import machine_name, reports_bf16_unit
from ..runtime.device import resolve_device
from ..runtime.distributed import local_rank, rank_and_world
from ..runtime.precision import autocast_for, matmul_precision
from ..runtime.threads import choose_threads, threads_for_ranks
from .budget import check_budget, usable_seconds
from .build import apply_layout, build_data, build_model, init_crop, preprocessing_for
from .checkpoint import recover_run
from .config import TIER_BOUNDS, TrainConfig, describe_changes, lay_over, read_recipe, read_yaml, safe_yaml
from .gpu_batch import BatchTrial, choose_batch, scale_lr  # noqa: F401 - BatchTrial: the plan's public names
from .optim import build_optimizer, freeze_body
from .recipes import choose_recipe, flips_change_labels

# Compile is timed only where a run could repay twice its compile time at this gain over the eager step (what the
# Fashion-MNIST recipe's compiled fp32 step gained over the eager trainer on an AVX-512 Xeon, 1.17x; 1.12x in bf16
# on an AMD EPYC with AVX512-BF16; results/train-fp32-ab.csv, docs: Speed): 5-minute runs never pay for a cold one.
COMPILE_GAIN = 1.2
# a cold compile of a small ViT's step, until measured on this machine (then the measured one, cached): 30-40 s on 2
# CPU cores; 15-19 s on an H200 (results/gpu-train-step-h200.csv), where the CPU's figure kept compile off
COMPILE_PRIOR_S = {"cpu": 30.0, "cuda": 15.0}
COMPILE_MARGIN = 1.03  # compiled must be this much faster to be used: a tie is not worth the recompiles
RETIME = 1.15  # after a tier changes the model, the candidates within this of the best are timed again
# Of the images per second the calibrated step promises, what an epoch delivers: augmentation, evaluation, saving
# and Python between steps take the rest (Fashion-MNIST 5-minute runs, docs: Speed).
EPOCH_EFFICIENCY = 0.8


@dataclass
class Plan:
    """What the planner decided for a run and why: every candidate timed, the tier, compile, threads."""

    recipe: str | None
    device: str
    machine: str
    asked: dict[str, Any]  # precision, compile, attention, channels_last as configured ("auto" or a value)
    chosen: dict[str, Any] = field(default_factory=dict)  # ... as decided, and threads
    calibrations: list[Calibration] = field(default_factory=list)
    tier: dict[str, Any] | None = None  # the tier taken ({below: ..., ...}), if any
    epochs_affordable: float | None = None
    notes: list[str] = field(default_factory=list)  # one sentence per decision
    seconds: float = 0.0  # spent planning (calibration included), inside the run's budget

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calibrations"] = [c.to_dict() | {"cached": c.cached} for c in self.calibrations]
        return d

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(json.dumps(self.to_dict(), indent=1, default=str))

    def lines(self) -> list[str]:
        """The short table printed at the start of the run."""
        cached = bool(self.calibrations) and all(c.cached for c in self.calibrations)
        spent = f"{self.seconds:.1f} s" + (", every timing cached" if cached else "")
        out = [f"plan: {self.machine}, torch {torch.__version__}, {self.device} (planning {spent}; "
               "`vitkit calibrate` refreshes)"]
        for c in self.calibrations:
            out.append(c.heading)
            out.append(c.table())
        out += [f" {n}" for n in self.notes]
        chosen = ", ".join(f"{k} {v}" for k, v in self.chosen.items())
        return out + [f" chosen: {chosen}"]


# ------------------------------------------------------------------------------------------ layering the sources
@dataclass
class Sources:
    """What a run was asked: flags (``given``, TrainConfig keys), model overrides from flags, a config file."""

    given: dict[str, Any] = field(default_factory=dict)
    model_args: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None


def resolve(src: Sources, say: Callable[[str], None] = print,
            progress: Callable | None = None) -> tuple[TrainConfig, DataSplits | None, str | None]:
    """The layered TrainConfig (``auto`` still in it), the data if it had to be read to choose the recipe, and the
    recipe's name. Tiers keep none of the settings the user gave (the user's file and flags win there too)."""
    given = dict(src.given)
    file_cfg = read_yaml(src.config_file) if src.config_file else {}
    resume = given.get("resume") or file_cfg.get("resume")
    saved: dict[str, Any] = {}
    if resume:
        run_dir = Path(resume if resume != "auto" else (given.get("output") or file_cfg.get("output") or ""))
        recover_run(run_dir)  # a save killed between its two renames left .last.old: that is last/ again
        if not (run_dir / "last").exists():
            if resume != "auto" and not (run_dir / "plan.json").is_file():
                raise FileNotFoundError(f"--resume {resume}: no run there (no last/ checkpoint, no plan.json)")
            if resume != "auto":  # a run killed before its first checkpoint: it starts over in its folder
                given.setdefault("output", str(run_dir))
            given.pop("resume", None), file_cfg.pop("resume", None)  # nothing to resume: a fresh run
        elif (run_dir / "config.yaml").is_file():
            saved = safe_yaml(run_dir / "config.yaml")
            saved.pop("few_epochs", None)  # a run folder of vitkit before tiers: that key was decided already
            given["resume"] = str(run_dir)
            given.setdefault("output", str(run_dir))
        else:
            raise FileNotFoundError(f"--resume {resume}: {run_dir / 'config.yaml'} not found")
    if saved:
        _check_same_model(saved, {**file_cfg, **given}, {**file_cfg.get("model_args", {}), **src.model_args},
                          given["resume"])
    dataset = given.get("dataset") or file_cfg.get("dataset") or saved.get("dataset") or "digits"
    merged: dict[str, Any] = {"dataset": dataset}
    init = given.get("init") or file_cfg.get("init")
    data, name = None, None
    if not saved:
        if init:  # fine-tuning: held at the weights' resolution, so nothing is lost to a smaller copy
            size = src.model_args.get("img_size") or init_image_size(init)
            merged["folder_max_side"] = max(size) if isinstance(size, tuple) else size
        if dataset in FILE_DATASETS:
            probe = {**file_cfg, **given}
            wanted = src.model_args.get("img_size") or file_cfg.get("model_args", {}).get("img_size")
            if "folder_max_side" in probe:  # the user's own
                merged["folder_max_side"] = probe["folder_max_side"]
            elif wanted and not init and max(to_2tuple(wanted)) > 128:  # photos kept at the size the model reads
                merged["folder_max_side"] = max(to_2tuple(wanted))
                say(f"photos kept at up to {merged['folder_max_side']} px a side, the --img-size the model reads "
                    "(128 otherwise; --folder-max-side N to choose)")
            data = load_dataset(dataset, probe.get("data_dir"), False, probe.get("skip_bad_images", False),
                                probe.get("cache_dir") or default_cache_dir(), progress=progress,
                                max_side=merged.get("folder_max_side", 128), crop=init_crop(init, src.model_args),
                                mode=probe.get("data_mode", "auto"), say=say)
            name = "finetune" if init else choose_recipe(data)
            say(f"recipe for this folder: configs/{name}.yaml ({data.describe()})")
        else:
            name = "finetune" if init else dataset
        if init:
            say(f"--init {init}: the paper's fine-tuning recipe, configs/finetune.yaml (SGD momentum 0.9, no weight "
                "decay, warmup + cosine, gradient clipping at 1, new zero head, position embeddings resampled to the "
                "training size; a --config file or flags override it)")
            if not init_preprocessing(init).get("mean") and Path(init).is_file():
                say(f"--init {init}: the file carries no preprocessing, so images are standardised with the "
                    "dataset's own mean and std; for weights published with theirs (and a resize + crop), `vitkit "
                    f"import {init} --preprocessing NAME.TAG --out DIR`, then --init DIR")
            crop = init_crop(init, src.model_args) if dataset in FILE_DATASETS else None
            if crop:
                h, w = crop["img_size"]
                say(f"photos prepared as the weights' publisher prepares them, for training, eval, predict and serve "
                    f"alike: short side to {h / crop['crop_pct']:.0f} ({crop['interpolation']}), centre {h}x{w} crop")
        merged.update({k: v for k, v in read_recipe(name).items() if k != "dataset"})
        if data is not None and merged.get("hflip") and flips_change_labels(data):
            merged["hflip"] = False
            if "hflip" not in given and "hflip" not in file_cfg:
                say("no horizontal flips: small grayscale images are often digits or characters, which a flip "
                    "changes (--hflip to flip anyway)")
    for layer in (saved, file_cfg, given, {"model_args": src.model_args}):
        merged = lay_over(merged, layer)  # a --config or flag changing the depth keeps the recipe's width
    merged.setdefault("cache_dir", default_cache_dir())
    if merged.get("init") and "model" not in given and "model" not in file_cfg and not saved:
        merged["model"] = None  # the weights say the architecture: config.yaml named the default preset instead
    if (saved or "batch_size" in given or "batch_size" in file_cfg) and "gpu_batch" not in given:
        merged["gpu_batch"] = False  # the batch the user (or the run being resumed) chose stays
    if merged.get("tiers") and "tiers" not in given and "tiers" not in file_cfg:
        merged["tiers"] = _without_users_keys(merged["tiers"], {**file_cfg, **given},
                                              {**file_cfg.get("model_args", {}), **src.model_args})
    if init and not saved and data is not None:
        n_train = len(data.with_train_fraction(merged.get("train_fraction", 1.0)).train)  # what the run trains on
        _fit_accumulation(merged, n_train, "grad_accum" in given or "grad_accum" in file_cfg, say)
    return TrainConfig.from_dict(merged, source="train config"), data, name


def _check_same_model(saved: dict[str, Any], users: dict[str, Any], users_model: dict[str, Any], run: str) -> None:
    """A resume continues the run's own model on its own data: a --model, --init, model flag or --data-dir that
    differs would relabel the run without changing its weights (another folder's classes trained onto its head)."""
    def same(a: Any, b: Any) -> bool:
        return (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)

    def same_path(a: Any, b: Any) -> bool:  # data/ and ./data/ are one folder
        return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()

    changed = [f"{k} {saved.get(k)!r} -> {users[k]!r}" for k in ("model", "init", "dataset")
               if k in users and users[k] != saved.get(k)]
    if users.get("data_dir") is not None and not same_path(users["data_dir"], saved.get("data_dir")):
        changed.append(f"data_dir {saved.get('data_dir')!r} -> {users['data_dir']!r}")

    changed += [f"{k} {saved.get('model_args', {}).get(k)!r} -> {v!r}" for k, v in users_model.items()
                if not same(v, saved.get("model_args", {}).get(k))]
    if changed:
        raise ValueError(f"--resume {run} continues that run's model, but the flags or --config change it: "
                         f"{'; '.join(changed)}. Start a new run (another --output) to train another model")


def _without_users_keys(tiers: list[dict[str, Any]], users: dict[str, Any], users_model: dict[str, Any]
                        ) -> list[dict[str, Any]] | None:
    """The recipe's tiers without what the user's config file or flags set; None if no tier has anything left."""
    out = []
    for tier in tiers:
        t = {k: v for k, v in tier.items() if k not in users}
        if isinstance(t.get("model_args"), dict):
            t["model_args"] = {k: v for k, v in t["model_args"].items() if k not in users_model}
            if not t["model_args"]:
                del t["model_args"]
        out.append(t)
    return out if any(set(t) - set(TIER_BOUNDS) for t in out) else None


def _fit_accumulation(merged: dict[str, Any], n_train: int, user_set: bool, say: Callable[[str], None]) -> None:
    """The recipe's batch of 512 by accumulation, cut on a small dataset so an epoch keeps 8 optimiser steps."""
    batch, accum = merged.get("batch_size", 32), merged.get("grad_accum", 1)
    fitted = max(1, min(accum, n_train // (8 * batch)))
    if fitted != accum and not user_set:
        merged["grad_accum"] = fitted
        say(f"batch {batch} x {fitted} accumulated = {batch * fitted} (not {batch * accum}): {n_train} training "
            "images would give fewer than 8 optimiser steps an epoch")


# ------------------------------------------------------------------------------------------ timing the step
def step_candidates(cfg: TrainConfig, device: torch.device, hybrid: bool = True) -> list[dict[str, Any]]:
    """Every combination of the settings left ``auto``. CPU flags only order them: where the CPU reports no bf16
    unit, fp32 is timed first, so that an emulated bf16 is cut at its first call. The memory layout is a candidate
    only for a model with a CNN stem (``hybrid``): elsewhere it moves one small convolution."""
    if cfg.precision != "auto":
        precisions = [cfg.precision]
    elif device.type == "cuda" and not torch.cuda.is_bf16_supported():
        precisions = ["fp32"]
    elif device.type == "cuda":  # fp32 with TF32 matmuls where the GPU has TF32 tensor cores (Ampere on)
        precisions = ["bf16", "tf32", "fp32"] if torch.cuda.get_device_capability(device)[0] >= 8 else ["bf16", "fp32"]
    elif device.type == "cpu":
        precisions = ["bf16", "fp32"] if reports_bf16_unit() else ["fp32", "bf16"]
    else:
        precisions = ["fp32"]  # MPS: bf16 autocast is not complete there
    attentions = ["sdpa", "exact"] if cfg.attention == "auto" else [cfg.attention]
    layouts = ([True, False] if hybrid else [False]) if cfg.channels_last == "auto" else [cfg.channels_last]
    return [{"precision": p, "attention": a, "channels_last": c} for p in precisions for a in attentions
            for c in layouts]


def step_workload(cfg: TrainConfig, model: nn.Module, n: int, device: torch.device) -> dict[str, Any]:
    """What the step's time depends on, for the cache key."""
    return {"kind": "train step", "model": model.config.to_dict(), "batch": n, "opt": cfg.opt,
            "muon": [cfg.muon_stem, cfg.muon_embed], "freeze_body": cfg.freeze_body, "device": device.type,
            "threads": torch.get_num_threads()}


class StepProbe:
    """The run's training step on a real batch, for timing: each candidate trains a copy of the model, so the run's
    own model, optimizer and random state are untouched."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, data: DataSplits, device: torch.device,
                 augment: BatchAugment) -> None:
        self.cfg, self.model, self.device, self.augment = cfg, model, device, augment
        self.n, self.n_train = min(cfg.batch_size, len(data.train)), len(data.train)
        rng = torch.get_rng_state()
        x, y = next(batches(data.train, list(range(self.n)), self.n, False, device))
        self.x, self.target = augment(x, y, train=False)
        torch.set_rng_state(rng)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.smoothing)

    def make(self, s: dict[str, Any], compiled: bool = False) -> Callable[[], None]:
        step = self.make_fed(s, compiled, augment=False)
        return lambda: step(self.x, self.target)

    def make_fed(self, s: dict[str, Any], compiled: bool = False, augment: bool = True
                 ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The step on a batch it is given (uint8 images and labels, augmented as the run augments them, with
        ``augment``): for timing the data pipeline with the step it feeds."""
        m = copy.deepcopy(self.model).train()
        apply_layout(m, s["attention"], s["channels_last"])
        cfg = TrainConfig.from_dict({**self.cfg.to_dict(), "precision": s["precision"], "compile": False,
                                     "attention": "sdpa", "channels_last": False, "tiers": None})
        if cfg.freeze_body:
            freeze_body(m)
        opt = build_optimizer(m, cfg)
        fwd = torch.compile(m) if compiled else m
        criterion, device, precision, aug = self.criterion, self.device, s["precision"], self.augment

        def step(x: torch.Tensor, target: torch.Tensor) -> None:
            if augment:
                x, target = aug(x, target, train=True)
            with matmul_precision(precision):
                with autocast_for(device, precision):
                    loss = criterion(fwd(x), target)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return step


# ------------------------------------------------------------------------------------------ the planner
def make_plan(cfg: TrainConfig, data: DataSplits | None = None, recipe: str | None = None,
         log: Callable[[str], None] = print, start_time: float | None = None, refresh: bool = False,
         device: torch.device | None = None) -> tuple[TrainConfig, Plan]:
    """``cfg`` with every ``auto`` decided by timing, its tier taken (with a ``--time-limit``), and the Plan that
    says how. Threads are set for this process. Under torchrun rank 0 times and every rank takes its plan."""
    start = time.time()
    start_time = start_time or start
    rank, world = rank_and_world()
    device = device or resolve_device(cfg.device, local_rank())
    p = Plan(recipe, str(device), machine_name(device),
             {k: getattr(cfg, k) for k in ("precision", "compile", "attention", "channels_last")})
    if world > 1 and cfg.threads is None and not os.environ.get("OMP_NUM_THREADS"):
        n = threads_for_ranks(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        torch.set_num_threads(n)  # a probe per rank would disagree between ranks and with them all running
        threads_note = f"threads: {n} per process ({world} processes)"
    elif cfg.threads is not None or os.environ.get("OMP_NUM_THREADS"):
        threads_note = choose_threads(lambda: None, cfg.threads, device=device)[1]
    else:
        threads_note = ""  # measured on the chosen step, below
    data = data or build_data(cfg)
    if len(data.classes) < 2:  # one class trains to "100%" and predicts it for everything
        raise ValueError(f"{data.name}: {len(data.classes)} class ({', '.join(map(str, data.classes))}); a "
                         "classifier needs at least 2 (one class folder per class under train/ and val/)")
    if rank == 0:
        cfg = _decide(cfg, data, device, p, start_time, refresh, threads_note == "")
        if data.streamed:
            cfg = _decide_workers(cfg, data, device, p)
    if world > 1:
        cfg = _from_rank0(cfg, p, device)
    if threads_note:
        p.notes.append(threads_note)
    p.chosen["threads"] = torch.get_num_threads()
    p.seconds = time.time() - start
    if rank == 0:
        for line in p.lines():
            log(line)
    return cfg, p


def _decide(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan, start_time: float, refresh: bool,
            measure_threads: bool) -> TrainConfig:
    data = data.with_train_fraction(cfg.train_fraction)
    gpu_batch = device.type == "cuda" and cfg.gpu_batch
    grow = bool(cfg.max_epochs and cfg.time_limit and not cfg.resume)
    if not (cfg.needs_plan or (cfg.tiers and cfg.time_limit and not cfg.resume) or measure_threads or gpu_batch
            or grow):
        p.chosen.update(precision=cfg.precision, compile=cfg.compile, attention=cfg.attention,
                        channels_last=cfg.channels_last)
        if cfg.time_limit:
            check_budget(cfg.time_limit, time.time() - start_time, 0.0, cfg.batch_size, len(data.train),
                         len(data.val))
        return cfg  # nothing to time
    probe = _probe(cfg, data, device)
    cands = step_candidates(cfg, device, bool(getattr(probe.model.config, "hybrid", None)))
    if measure_threads:  # first: every candidate below is timed at the thread count the run trains with (timed at
        # two threads on a busy 2-core machine, then trained at one, a noisy step chose the precision)
        p.notes.append(choose_threads(probe.make(cands[0]), None, "training step", device)[1])
    unbatched = cfg  # the recipe's batch and LR, for a tier's model to choose its own batch from
    if gpu_batch:  # then the batch (on a GPU): every setting below is timed at the batch the run trains with
        cfg = _decide_batch(cfg, data, device, p, cands[0])
        probe = _probe(cfg, data, device) if cfg.batch_size != probe.n else probe
    cal = None
    if cfg.needs_plan or (cfg.tiers and cfg.time_limit and not cfg.resume):
        cal = calibrate(f"training step ({_describe_model(probe.model)}, batch {probe.n})", device,
                        step_workload(cfg, probe.model, probe.n, device), cands, probe.make, refresh=refresh)
        p.calibrations.append(cal)
    if cfg.tiers and cfg.time_limit and not cfg.resume and cal is not None:
        cfg, probe, cal = _take_tier(cfg, data, device, p, probe, cal, start_time, refresh,
                                     unbatched if gpu_batch else None)
    if cfg.tiers:
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "tiers": None})  # no budget to choose one by: the recipe
    if grow:
        if cal is None:  # nothing else was timed: the run's own step, for the epochs the budget buys
            cal = calibrate(f"training step ({_describe_model(probe.model)}, batch {probe.n})", device,
                            step_workload(cfg, probe.model, probe.n, device), cands[:1], probe.make, refresh=refresh)
            p.calibrations.append(cal)
        cfg = _grow_schedule(cfg, data, p, probe, cal, start_time)
    best = cal.best.settings if cal is not None else {}
    fixed = {"precision": cfg.precision, "attention": cfg.attention, "channels_last": cfg.channels_last}
    chosen = {k: (best[k] if v == "auto" else v) for k, v in fixed.items()}
    if cal is not None and "auto" in fixed.values():
        p.notes.append("fastest step: " + ", ".join(f"{k} {v}" for k, v in chosen.items() if fixed[k] == "auto"))
    cfg = TrainConfig.from_dict({**cfg.to_dict(), **chosen})
    compile_on = cfg.compile
    if cfg.compile == "auto":
        compile_on, why = _decide_compile(cfg, probe, chosen, device, p, start_time, refresh, cal)
        p.notes.append(why)
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "compile": compile_on})
    p.chosen.update(precision=cfg.precision, compile=cfg.compile, attention=cfg.attention,
                    channels_last=cfg.channels_last)
    if cfg.time_limit:  # (without a timed step: planning alone must fit)
        step_s = (cal.seconds_of(**chosen) or cal.best.seconds or 0.0) if cal is not None else 0.0
        check_budget(cfg.time_limit, time.time() - start_time, step_s * cfg.batch_size / probe.n * cfg.grad_accum,
                     cfg.batch_size, len(data.train), len(data.val))
    return cfg


def _decide_workers(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan) -> TrainConfig:
    """A streamed dataset: how many DataLoader workers decode while the run's step trains (stream.choose_workers:
    the pipeline timed with each count, on the chosen settings' eager step), unless ``--workers`` said."""
    if cfg.workers is not None:
        p.notes.append(f"data: {data.how}, {cfg.workers} workers (--workers)")
    else:
        probe = _probe(cfg, data, device)
        chosen = {"precision": cfg.precision, "attention": cfg.attention, "channels_last": cfg.channels_last}
        chosen = {k: ("fp32" if k == "precision" else "sdpa" if k == "attention" else False) if v == "auto" else v
                  for k, v in chosen.items()}
        w, rates = choose_workers(data.with_train_fraction(cfg.train_fraction).train, probe.n,
                                  probe.make_fed(chosen), device)
        p.notes.append(f"data: {data.how}; workers " + ", ".join(f"{k} {v:,.0f} img/s" for k, v in rates.items())
                       + f" (decoding while the step trains) -> {w}")
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "workers": w})
    p.chosen["workers"] = cfg.workers
    return cfg


# ------------------------------------------------------------------------------------------ the batch on a GPU
def _decide_batch(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan,
                  setting: dict[str, Any] | None = None) -> TrainConfig:
    """On a CUDA GPU with ``gpu_batch``: the batch from ``choose_batch`` on the run's own step (with ``setting``: the
    candidate the planner times first, before any other is timed at this batch), and the LR with it."""
    if device.type != "cuda" or not cfg.gpu_batch or cfg.grad_accum != 1:
        return cfg
    setting = setting or {"precision": cfg.precision, "attention": cfg.attention, "channels_last": cfg.channels_last}
    free, _ = torch.cuda.mem_get_info(device)
    batch, trials = choose_batch(_batch_measure(cfg, data, device, setting), cfg.batch_size, len(data.train), free)
    torch.cuda.empty_cache()
    p.notes.append("batch on this GPU: " + ", ".join(
        f"{t.batch} {t.img_per_s:,.0f} img/s {t.peak_bytes / 2**30:.1f} GiB" + ("" if t.fits else " (does not fit)")
        for t in trials) + f" -> {batch}")
    if batch == cfg.batch_size:
        return TrainConfig.from_dict({**cfg.to_dict(), "gpu_batch": False})
    new = scale_lr(cfg, batch)
    p.notes.append(f"batch {cfg.batch_size} -> {batch}: lr {cfg.lr:g} -> {new['lr']:g} "
                   f"({'linear' if cfg.opt == 'sgd' else 'square-root'} scaling), the schedule in epochs unchanged")
    return TrainConfig.from_dict({**cfg.to_dict(), **new, "gpu_batch": False})


def _batch_measure(cfg: TrainConfig, data: DataSplits, device: torch.device, setting: dict[str, Any]
                   ) -> Callable[[int], tuple[float, int]]:
    """``measure(batch)`` for ``choose_batch``: the run's step at that batch on the GPU, (images per second, peak
    bytes), after a warm-up step."""
    def measure(batch: int) -> tuple[float, int]:
        probe = _probe(TrainConfig.from_dict({**cfg.to_dict(), "batch_size": batch}), data, device)
        step = probe.make(setting)
        step()  # warm-up: kernels chosen, memory pools grown
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(3):
            step()
        seconds = (time.perf_counter() - start) / 3
        return probe.n / seconds, torch.cuda.max_memory_allocated(device)

    return measure


def _probe(cfg: TrainConfig, data: DataSplits, device: torch.device) -> StepProbe:
    rng = torch.get_rng_state()
    model = build_model(cfg, data).to(device)
    torch.set_rng_state(rng)  # the run's model is built from the same seed after planning
    pre = preprocessing_for(cfg, model, data)
    mc = model.config
    augment = BatchAugment(pre["mean"], pre["std"], to_2tuple(mc.img_size), mc.num_classes)
    return StepProbe(cfg, model, data, device, augment)


def _describe_model(model: nn.Module) -> str:
    c = model.config
    hybrid = f", {c.hybrid}" if getattr(c, "hybrid", None) else ""
    return f"depth {c.depth}, width {c.embed_dim}, patch {c.patch_size}{hybrid}"


def _budget_left(cfg: TrainConfig, start_time: float) -> float:
    return usable_seconds(cfg.time_limit) - (time.time() - start_time)


def affordable_epochs(seconds_left: float, step_s: float, batch: int, world: int, n_train: int) -> float:
    """Epochs ``seconds_left`` buy at ``step_s`` per step of ``batch`` images on each of ``world`` processes."""
    return seconds_left * EPOCH_EFFICIENCY * batch * world / max(step_s, 1e-9) / max(n_train, 1)


def pick_tier(tiers: list[dict[str, Any]], epochs: float) -> dict[str, Any] | None:
    """The tier with the smallest ``below`` above ``epochs``; else (upward) the one with the largest ``above`` that
    ``epochs`` reach; None: the recipe as it is."""
    fits = sorted((t for t in tiers if "below" in t and epochs < t["below"]), key=lambda t: t["below"])
    if fits:
        return fits[0]
    up = sorted((t for t in tiers if "above" in t and epochs >= t["above"]), key=lambda t: t["above"])
    return up[-1] if up else None


def tier_name(tier: dict[str, Any]) -> str:
    return f"tier below {tier['below']:g}" if "below" in tier else f"tier above {tier['above']:g}"


def _take_tier(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan, probe: StepProbe,
               cal: Calibration, start_time: float, refresh: bool, unbatched: TrainConfig | None = None
               ) -> tuple[TrainConfig, StepProbe, Calibration]:
    """The tier the budget buys; a tier that changes the step re-times the candidates close to the best on it, and
    on a GPU (``unbatched``: the config before its batch was chosen) first chooses the tier's model its own batch."""
    _, world = rank_and_world()
    epochs = affordable_epochs(_budget_left(cfg, start_time), cal.best.seconds or 0.0, probe.n, world,
                               len(data.train))
    p.epochs_affordable = round(epochs, 2)
    tier = pick_tier(cfg.tiers or [], epochs)
    bought = f"a {cfg.time_limit:g}-minute budget buys ~{epochs:.1f} epochs of this model at the fastest step"
    if tier is None:
        p.notes.append(f"{bought}: the recipe as it is (no tier for {epochs:.1f} epochs)")
        return TrainConfig.from_dict({**cfg.to_dict(), "tiers": None}), probe, cal
    new = cfg.with_tier(tier)
    changed = describe_changes(cfg.to_dict(), {k: v for k, v in tier.items() if k not in TIER_BOUNDS},
                               probe.model.config.to_dict())
    p.tier = dict(tier)
    p.notes.append(f"{bought}: {tier_name(tier)}: {', '.join(changed) or 'no change'}")
    if not _changes_step(cfg, new):
        return new, probe, cal
    if unbatched is not None and new.model_args != cfg.model_args:  # another model: its own batch on this GPU
        new = _decide_batch(unbatched.with_tier(tier), data, device, p, cal.best.settings)
    try:  # the tier's model is first checked here, where it is built
        new_probe = _probe(new, data, device)
    except ValueError as e:
        raise type(e)(f"{tier_name(tier)}: {e}") from None
    close = [t.settings for t in cal.timings if t.seconds is not None and t.seconds <= RETIME * cal.best.seconds]
    new_cal = calibrate(f"training step ({_describe_model(new_probe.model)}, batch {new_probe.n}; the tier's model)",
                        device, step_workload(new, new_probe.model, new_probe.n, device), close, new_probe.make,
                        refresh=refresh)
    p.calibrations.append(new_cal)
    if "above" in tier:  # a larger model must still get the recipe's epochs in the budget, or it is not worth it
        now = affordable_epochs(_budget_left(cfg, start_time), new_cal.best.seconds or 0.0, new_probe.n, world,
                                len(data.train))
        if now < new.epochs:
            p.tier = None
            p.notes.append(f"... but its step buys only ~{now:.1f} epochs of its {new.epochs}: the recipe as it is")
            return TrainConfig.from_dict({**cfg.to_dict(), "tiers": None}), probe, cal
    return new, new_probe, new_cal


GROW_SLACK = 1.25  # a grown schedule asks this much more than the budget is estimated to buy: the run's own re-plans
# (training/budget.py: from steps 5-30, then every epoch) end its cosine at the budget, never past it


def _grow_schedule(cfg: TrainConfig, data: DataSplits, p: Plan, probe: StepProbe, cal: Calibration,
                   start_time: float) -> TrainConfig:
    """Upward: a budget that buys more epochs than the recipe's gets a longer schedule, up to ``max_epochs`` (with
    the warmup in proportion), so that a ``--time-limit`` run uses its budget rather than ending early."""
    _, world = rank_and_world()
    epochs = affordable_epochs(_budget_left(cfg, start_time), cal.best.seconds or 0.0, probe.n, world,
                               len(data.train))
    p.epochs_affordable = round(epochs, 2)
    if epochs <= cfg.epochs:
        return cfg
    grown = min(cfg.max_epochs, math.ceil(epochs * GROW_SLACK))
    if grown <= cfg.epochs:
        return cfg
    p.notes.append(f"a longer schedule: the {cfg.time_limit:g}-minute budget buys ~{epochs:.0f} epochs, more than the "
                   f"recipe's {cfg.epochs}: planned for {grown} (at most max_epochs {cfg.max_epochs}), its cosine "
                   "fitted to the budget as the run goes")
    return TrainConfig.from_dict({**cfg.to_dict(), "epochs": grown,
                                  "warmup_epochs": cfg.warmup_epochs * grown / cfg.epochs})


def _changes_step(a: TrainConfig, b: TrainConfig) -> bool:
    keys = ("model_args", "batch_size", "opt", "muon_stem", "muon_embed")
    return any(getattr(a, k) != getattr(b, k) for k in keys)


def compile_worth_timing(run_s: float, compile_s: float) -> bool:
    """Whether a run of ``run_s`` seconds could repay twice ``compile_s`` at the best gain compiling has given."""
    return run_s * (1 - 1 / COMPILE_GAIN) > 2 * compile_s


def _decide_compile(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device, p: Plan,
                    start_time: float, refresh: bool, cal: Calibration | None) -> tuple[bool, str]:
    if device.type == "cpu" and not has_cxx_compiler():
        return False, "compile: off (no C++ compiler for Inductor's CPU kernels)"
    workload = {**step_workload(cfg, probe.model, probe.n, device), "kind": "compile", "settings": chosen}
    known = None if refresh else cached(device, workload)
    eager_s = (cal.seconds_of(**chosen) if cal is not None else None)
    if cfg.time_limit:
        run_s = _budget_left(cfg, start_time)
    elif eager_s:
        run_s = cfg.epochs * _steps_per_epoch(cfg, probe) * eager_s
    else:
        run_s = 0.0
    prior = COMPILE_PRIOR_S.get(device.type, COMPILE_PRIOR_S["cpu"])
    compile_s = known.extra.get("compile_s", prior) if known else prior
    if not compile_worth_timing(run_s, compile_s):
        return False, (f"compile: off (a run of ~{run_s:.0f} s cannot repay a ~{compile_s:.0f} s compile at the best "
                       f"gain seen, {COMPILE_GAIN}x; --compile to compile anyway)")
    if known is None:
        known = _time_compile(probe, chosen, device)
        store(device, workload, known)
        p.calibrations.append(known)
    else:
        p.calibrations.append(known)
    eager, compiled = (known.seconds_of(compiled=c) for c in (False, True))
    compile_s = known.extra["compile_s"]
    if compiled is None or eager is None:
        return False, "compile: off (the compiled step could not be timed here)"
    gain_s = (eager - compiled) * (run_s / eager)
    if eager < compiled * COMPILE_MARGIN or gain_s < compile_s:
        return False, (f"compile: off (compiled step {compiled * 1e3:.1f} ms vs eager {eager * 1e3:.1f} ms; saves "
                       f"~{max(gain_s, 0):.0f} s of the run against a {compile_s:.0f} s compile)")
    return True, (f"compile: on (compiled step {compiled * 1e3:.1f} ms vs eager {eager * 1e3:.1f} ms: saves "
                  f"~{gain_s:.0f} s of the run for a {compile_s:.0f} s compile, a few seconds once Inductor's cache "
                  "is warm)")


def _steps_per_epoch(cfg: TrainConfig, probe: StepProbe) -> int:
    """Timed steps (forward and backward of one batch) an epoch takes: micro-batches, with accumulation."""
    return max(1, probe.n_train // cfg.batch_size)


def _time_compile(probe: StepProbe, chosen: dict[str, Any], device: torch.device) -> Calibration:
    """The compiled step against the eager one, round-robin; the first compiled call's time is the compile."""
    t0 = time.perf_counter()
    compiled = probe.make(chosen, compiled=True)
    try:
        compiled()
        compiled()  # Inductor may recompile once for the second call's guards
    except Exception as e:  # noqa: BLE001 - a backend failure means: do not compile
        return Calibration("compile", [Timing({**chosen, "compiled": True}, note=f"failed: {e}"[:100])],
                           extra={"compile_s": time.perf_counter() - t0})
    compile_s = time.perf_counter() - t0
    cal = time_candidates("compile (the chosen step)", [{"compiled": False}, {"compiled": True}],
                          lambda s: compiled if s["compiled"] else probe.make(chosen), cut=10.0)
    cal.extra["compile_s"] = round(compile_s, 2)
    cal.seconds_spent += compile_s
    return cal


def _from_rank0(cfg: TrainConfig, p: Plan, device: torch.device) -> TrainConfig:
    """Every rank takes rank 0's decisions (ranks time themselves differently)."""
    import torch.distributed as dist  # only under torchrun

    obj = [{"cfg": cfg.to_dict(), "chosen": p.chosen, "notes": p.notes, "tier": p.tier}]
    dist.broadcast_object_list(obj, src=0)
    p.chosen, p.notes, p.tier = obj[0]["chosen"], obj[0]["notes"], obj[0]["tier"]
    return TrainConfig.from_dict(obj[0]["cfg"])


def plan_run(src: Sources, data: DataSplits | None = None, log: Callable[[str], None] = print,
             start_time: float | None = None, refresh: bool = False,
             progress: Callable | None = None) -> tuple[TrainConfig, Plan, DataSplits]:
    """From what a run was asked to what it trains: ``resolve`` the sources, read the data, ``plan`` the rest."""
    cfg, folder_data, name = resolve(src, log, progress)
    data = data or folder_data or build_data(cfg)
    cfg, p = make_plan(cfg, data, name, log, start_time, refresh)
    return cfg, p, data
