"""The run planner: a layered ``TrainConfig`` (sources.py: recipe + config file + flags) + budget + device -> the
final ``TrainConfig`` and a ``Plan``.

It is the one place where a run's settings are decided. For every ``auto``, the candidates are timed on the run's
own training step (probe.py: its augmentation, forward, backward and optimizer step of its model on a real batch;
runtime/calibrate.py). ``DECISIONS`` lists them in the order they are made, each a function of the plan so far:

- the weights fit (CPU), the run's step and what fits in memory (memory_plan.py);
- CPU threads (runtime/threads.py): measured every run, since load changes from run to run;
- on a GPU, the batch (gpu_batch.py), from the step's throughput and free memory: all that follows is timed there;
- precision (fp32 / bf16, TF32 on CUDA; fp16 where a GPU has no bf16), attention path, the conv weights' layout;
- with a ``--time-limit``: the recipe's tier by the epochs the budget buys (downward for budgets that buy few,
  upward for budgets that buy many);
- compile, where the budget could repay the compile time at the gain measured on this device (compile_plan.py);
- a longer schedule up to ``max_epochs``, from the step the run trains (compiled where compile is on);
- streaming data: the DataLoader workers and where the JPEGs are decoded, on the pipeline feeding the chosen step;
- the budget holds the plan.

The ``Plan`` records every candidate timed, what was chosen and why; it is printed at the start of the run and
saved as ``plan.json`` in the run folder.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..data.datasets import DataSplits
from ..data.stream import choose_workers, worker_candidates
from ..runtime.calibrate import Calibration, calibrate
from ..runtime.cpu import machine_name
from ..runtime.device import resolve_device
from ..runtime.distributed import local_rank, rank0_done, rank_and_world, wait_for_rank0
from ..runtime.memory import release_free_memory
from ..runtime.threads import choose_threads, threads_for_ranks
from ..model.vit import VisionTransformer
from .budget import budget_left, check_budget
from .compile_plan import (COMPILE_GAIN, compile_gain, compile_worth_timing, decide_compile,  # noqa: F401 - public
                           expected_compile_gain, trained_step_s)  # (COMPILE_GAIN, compile_*: public names)
from .build import build_data, for_run, model_config, resident_bytes
from .config import TIER_BOUNDS, TrainConfig, describe_changes
from .gpu_batch import BatchTrial, choose_batch, scale_lr  # noqa: F401 - BatchTrial: the plan's public names
from .memory_plan import check_weights_fit, decide_memory
from .probe import StepProbe, _describe_model, _probe, step_candidates, step_workload  # noqa: F401 - public names
from .sources import Sources, resolve  # noqa: F401 - the planner's entry points, as before

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
    memory: dict[str, Any] | None = None  # what fits the memory this process may use (memory_plan.py)

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
    data = for_run(cfg, data or build_data(cfg), log if rank == 0 else None)
    if len(data.classes) < 2 and cfg.objective == "classify":  # one class trains to "100%" and predicts it always
        raise ValueError(f"{data.name}: {len(data.classes)} class ({', '.join(map(str, data.classes))}); a "
                         "classifier needs at least 2 (one class folder per class under train/ and val/)")
    if rank == 0:
        cfg = _decide(cfg, data, device, p, start_time, refresh, threads_note == "", log)
    if world > 1:  # the others wait for rank 0's timings outside a collective (NCCL's watchdog ends those at 10 min)
        rank0_done("plan") if rank == 0 else wait_for_rank0("plan")
        cfg = _from_rank0(cfg, p, device)
    if cfg.blr is not None:  # the learning rate per 256 images, at the global batch the plan ends with (MAE's rule)
        lr = cfg.blr * cfg.batch_size * cfg.grad_accum * world / 256
        if lr != cfg.lr:
            p.notes.append(f"lr {lr:.3g}: blr {cfg.blr:g} x {cfg.batch_size * cfg.grad_accum * world} images a step "
                           "/ 256")
            cfg = TrainConfig.from_dict({**cfg.to_dict(), "lr": lr})
    if threads_note:
        p.notes.append(threads_note)
    p.chosen["threads"] = torch.get_num_threads()
    release_free_memory()  # what the planner's steps left in the heap, before the run's own
    p.seconds = time.time() - start
    if rank == 0:
        for line in p.lines():
            log(line)
    return cfg, p


def _decide(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan, start_time: float, refresh: bool,
            measure_threads: bool, log: Callable[[str], None] = print) -> TrainConfig:
    """Every decision of ``DECISIONS``, in order, on the plan so far: the config they leave."""
    run_data = data.with_train_fraction(cfg.train_fraction, holdout=cfg.holdout)
    so_far = Planning(cfg, run_data, device, p, start_time, refresh, measure_threads, log)
    for decide in DECISIONS:
        decide(so_far)
    return so_far.cfg


@dataclass
class Planning:
    """The plan so far, as each decision finds it and leaves it: the config, the run's step (``probe``) and its
    candidates, the calibration of the candidates, and the settings chosen."""

    cfg: TrainConfig
    data: DataSplits
    device: torch.device
    plan: Plan
    start_time: float
    refresh: bool
    measure_threads: bool
    log: Callable[[str], None]
    probe: StepProbe | None = None
    cands: list[dict[str, Any]] = field(default_factory=list)
    cal: Calibration | None = None
    unbatched: TrainConfig | None = None  # the recipe's batch and LR, for a tier's model to choose its own batch from
    chosen: dict[str, Any] = field(default_factory=dict)

    # what the run asked, as it stood before any decision (the decisions change cfg: its gpu_batch, its tiers)
    gpu_batch: bool = False  # the batch is chosen on the GPU
    tiered: bool = False  # the recipe's tiers are chosen by the budget
    grow: bool = False  # the schedule may grow to max_epochs

    def __post_init__(self) -> None:
        c = self.cfg
        self.gpu_batch = self.device.type == "cuda" and c.gpu_batch
        self.tiered = bool(c.tiers and c.time_limit and not c.resume)
        self.grow = bool(c.max_epochs and c.time_limit and not c.resume)

    def with_(self, **changes: Any) -> None:
        self.cfg = TrainConfig.from_dict({**self.cfg.to_dict(), **changes})

    def step_s(self) -> float:
        """Seconds of the chosen settings' eager step (0: nothing was timed)."""
        return (self.cal.seconds_of(**self.chosen) or self.cal.best.seconds or 0.0) if self.cal is not None else 0.0


def _weights_fit(s: Planning) -> None:
    """On a CPU, the model's weights fit the memory this process may use (--init's are counted as they are read)."""
    if s.device.type == "cpu" and not s.cfg.init:
        check_weights_fit(s.cfg, model_config(s.cfg, s.data))


def _the_step(s: Planning) -> None:
    """The run's own step on a real batch, and the candidates for every ``auto`` setting; then, before any
    full-size step is run (the threads' and the candidates' timings run them), what fits in memory."""
    s.probe = _probe(s.cfg, s.data, s.device)
    s.cands = step_candidates(s.cfg, s.device, bool(getattr(s.probe.model.config, "hybrid", None)))
    s.cfg, s.probe, s.cands = _fit_memory(s.cfg, s.data, s.device, s.plan, s.probe, s.cands, s.log)


def _threads(s: Planning) -> None:
    """The thread count, timed on the step first: every candidate below is timed at the count the run trains with
    (timed at two threads on a busy 2-core machine, then trained at one, a noisy step chose the precision)."""
    if s.measure_threads:
        s.plan.notes.append(choose_threads(s.probe.make(s.cands[0]), None, "training step", s.device,
                                           optional_seconds(s.cfg, s.start_time))[1])
        release_free_memory()  # each phase's steps are freed before the next one's: see runtime/memory.py


def _batch_on_a_gpu(s: Planning) -> None:
    """On a GPU, the batch: every setting below is timed at the batch the run trains with."""
    s.unbatched = s.cfg
    if s.gpu_batch:
        s.cfg = _decide_batch(s.cfg, s.data, s.device, s.plan, s.cands[0])
        s.probe = _probe(s.cfg, s.data, s.device) if s.cfg.batch_size != s.probe.n else s.probe


def _step_settings(s: Planning) -> None:
    """Precision, attention path and memory layout: every candidate timed on the run's step (calibrate: cached per
    machine); for a tier, the step timed as it is."""
    if s.cfg.needs_plan or s.tiered:
        s.cal = calibrate(f"training step ({_describe_model(s.probe.model)}, batch {s.probe.n})", s.device,
                          step_workload(s.cfg, s.probe.model, s.probe.n, s.device), s.cands, s.probe.make,
                          refresh=s.refresh)
        s.plan.calibrations.append(s.cal)
        release_free_memory()


def _tier(s: Planning) -> None:
    """The recipe's tier for the epochs the budget buys (and no tiers left in the config either way)."""
    if s.tiered and s.cal is not None:
        s.cfg, s.probe, s.cal = _take_tier(s.cfg, s.data, s.device, s.plan, s.probe, s.cal, s.start_time, s.refresh,
                                           s.unbatched if s.gpu_batch else None, s.log)
    if s.cfg.tiers:
        s.with_(tiers=None)  # no budget to choose one by: the recipe


def _fastest_settings(s: Planning) -> None:
    """The fastest candidate's settings for those left ``auto`` (the growth of the schedule needs a timed step:
    the run's own, where nothing else was timed)."""
    if s.grow and s.cal is None:
        s.cal = calibrate(f"training step ({_describe_model(s.probe.model)}, batch {s.probe.n})", s.device,
                          step_workload(s.cfg, s.probe.model, s.probe.n, s.device), s.cands[:1], s.probe.make,
                          refresh=s.refresh)
        s.plan.calibrations.append(s.cal)
    best = s.cal.best.settings if s.cal is not None else {}
    fixed = {"precision": s.cfg.precision, "attention": s.cfg.attention, "channels_last": s.cfg.channels_last}
    s.chosen = {k: (best[k] if v == "auto" else v) for k, v in fixed.items()}
    if s.cal is not None and "auto" in fixed.values():
        s.plan.notes.append("fastest step: " + ", ".join(f"{k} {v}" for k, v in s.chosen.items()
                                                          if fixed[k] == "auto"))
    s.with_(**s.chosen)


def _compile(s: Planning) -> None:
    """Compile, where the budget can repay its compile at the gain measured on this device."""
    compile_on = s.cfg.compile
    if s.cfg.compile == "auto" and s.cfg.naflex:
        compile_on = False
        s.plan.notes.append("compile: off (--naflex: every batch has its own grids, each a recompile)")
    elif s.cfg.compile == "auto":
        compile_on, why = decide_compile(s.cfg, s.probe, s.chosen, s.device, s.plan, s.start_time, s.refresh, s.cal)
        s.plan.notes.append(why)
    s.with_(compile=compile_on)
    s.plan.chosen.update(precision=s.cfg.precision, compile=s.cfg.compile, attention=s.cfg.attention,
                         channels_last=s.cfg.channels_last)


def _schedule(s: Planning) -> None:
    """A longer schedule where the budget buys more epochs than the recipe's, from the step the run trains: compiled
    where compile is on (an eager step's epochs are too few)."""
    if s.grow:
        s.cfg = _grow_schedule(s.cfg, s.data, s.plan, s.probe,
                               trained_step_s(s.plan, s.cal, s.chosen, s.cfg.compile), s.start_time)


def _data_pipeline(s: Planning) -> None:
    """Streamed data: the DataLoader workers, and where the JPEGs are decoded, on the pipeline feeding the step."""
    s.cfg = _decide_workers(s.cfg, s.data, s.device, s.plan, s.probe, s.step_s(),
                            optional_seconds(s.cfg, s.start_time))


def _budget_holds(s: Planning) -> None:
    """A --time-limit that holds the plan: planning, the steps the schedule is fitted from and an evaluation."""
    if s.cfg.time_limit:  # (without a timed step: planning alone must fit)
        check_budget(s.cfg.time_limit, time.time() - s.start_time,
                     s.step_s() * s.cfg.batch_size / s.probe.n * s.cfg.grad_accum,
                     s.cfg.batch_size * s.cfg.grad_accum, len(s.data.train), len(s.data.val))


# The planner's decisions, in the order they are made: each a function of the plan so far. A new decision (a GPU's,
# say) is a new entry here, placed where what it needs has been decided.
DECISIONS: list[Callable[[Planning], None]] = [
    _weights_fit, _the_step, _threads, _batch_on_a_gpu, _step_settings, _tier, _fastest_settings, _compile,
    _schedule, _data_pipeline, _budget_holds]


def _decide_workers(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan,
                    probe: StepProbe | None = None, step_s: float = 0.0,
                    max_seconds: float = math.inf) -> TrainConfig:
    """A streamed dataset: how many DataLoader workers decode while the run's step trains (stream.choose_workers:
    the pipeline timed with each count, on the chosen settings' eager step), unless ``--workers`` said. Timing a
    count costs a few steps; where the counts would cost more than ``max_seconds`` (``step_s`` a step), two
    workers (or what memory allows) are used untimed."""
    if not data.streamed:
        return cfg
    most = max_workers(p)
    if cfg.workers is not None and cfg.workers > most:
        p.notes.append(f"data: {data.how}, --workers {cfg.workers} -> {most} ({worker_cap_reason(p)})")
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "workers": most})
    elif cfg.workers is not None:
        p.notes.append(f"data: {data.how}, {cfg.workers} workers (--workers)")
    elif sum(w + 4 for w in worker_candidates() if w <= most) * step_s > max_seconds:
        w = min(2, most)
        p.notes.append(f"data: {data.how}, {w} workers, not timed (timing the counts would take ~"
                       f"{sum(k + 4 for k in worker_candidates() if k <= most) * step_s:.0f} s of a short budget)")
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "workers": w})
    else:
        probe = probe or _probe(cfg, data, device)
        settings = {k: getattr(cfg, k) for k in ("precision", "attention", "channels_last")}  # decided by now
        w, rates = choose_workers(data.train, probe.n, probe.make_fed(settings), device,
                                  [w for w in worker_candidates() if w <= most] or [0])
        p.notes.append(f"data: {data.how}; decoding while the step trains, " + ", ".join(
            f"{k} worker{'s' if k != 1 else ''} {v:,.0f} img/s" for k, v in rates.items()) + f" -> {w}")
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "workers": w})
        if cfg.decode == "auto" and device.type == "cuda":  # the same pipeline with the batch decoded on the GPU
            data.train.device_decode = True
            try:
                _, on_device = choose_workers(data.train, probe.n, probe.make_fed(settings), device, [w])
            finally:
                data.train.device_decode = False
            faster = on_device[w] > rates[w]
            p.notes.append(f"decode: JPEGs decoded on {device} {on_device[w]:,.0f} img/s, by {w} worker"
                           f"{'s' if w != 1 else ''} {rates[w]:,.0f} img/s -> {'the device' if faster else 'workers'}")
            cfg = TrainConfig.from_dict({**cfg.to_dict(), "decode": "device" if faster else "workers"})
    p.chosen["workers"] = cfg.workers
    return _decide_decode(cfg, device, p)


def _decide_decode(cfg: TrainConfig, device: torch.device, p: Plan) -> TrainConfig:
    """Where a streamed run's JPEGs are decoded, where the timing above did not decide it: a CPU's workers (its own
    cores train the step: decoding in the training process would take them); on a GPU, the GPU (nvJPEG's batched
    decode runs at thousands of photos a second by NVIDIA's and torchvision's published figures, beyond a host's
    cores; not timed here, where the budget left no time for it)."""
    if cfg.decode == "auto":
        on_gpu = device.type == "cuda" and not cfg.naflex
        p.notes.append("decode: " + ("on the GPU (nvJPEG; by the published figures, not timed in this budget)"
                                     if on_gpu else "by the workers (the training process's cores train)"))
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "decode": "device" if on_gpu else "workers"})
    p.chosen["decode"] = cfg.decode
    return cfg


WORKERS_PER_CORE = 2  # DataLoader workers beyond this many a core decode no faster: they take memory and start-up
# (999 workers on 2 cores took no step in 150 s)


def max_workers(p: Plan) -> int:
    """The most DataLoader workers a run may start: twice the cores, and what the memory plan left room for."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    most = WORKERS_PER_CORE * cores
    if p.memory and p.memory.get("max_workers") is not None:
        most = min(most, p.memory["max_workers"])
    return most


def worker_cap_reason(p: Plan) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if p.memory and p.memory.get("max_workers") is not None and p.memory["max_workers"] < WORKERS_PER_CORE * cores:
        return "what fits in memory beside the step"
    return f"{WORKERS_PER_CORE} a core on the {cores} cores this process may use: more decode no faster"


# ------------------------------------------------------------------------------------------ memory
def _fit_memory(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan, probe: StepProbe,
                cands: list[dict[str, Any]], log: Callable[[str], None] = print
                ) -> tuple[TrainConfig, StepProbe, list[dict[str, Any]]]:
    """The batch (with accumulation), evaluation batch, workers and candidates that fit the memory this process may
    use (memory_plan.py), measured on ``probe``'s step; the probe again at a smaller batch. Said at once (a run the
    kernel kills later has said what it planned), and kept in ``plan.memory``."""
    decision = decide_memory(cfg, probe, cands, data.streamed) if device.type == "cpu" else None
    if decision is None:
        return cfg, probe, cands
    log(" " + decision.note)
    p.memory = {"note": decision.note, "batch": decision.batch, "grad_accum": decision.grad_accum, "eval_batch": decision.eval_batch,
                "max_workers": decision.max_workers, "asked": [cfg.batch_size, cfg.grad_accum],
                "measured": [{**m.settings, "peak_bytes": dict(zip(m.batches, m.peak))} for m in decision.measured]}
    new = {"batch_size": decision.batch, "grad_accum": decision.grad_accum, "eval_batch_size": decision.eval_batch}
    if all(getattr(cfg, k) == v for k, v in new.items()):
        return cfg, probe, decision.fits
    cfg = TrainConfig.from_dict({**cfg.to_dict(), **new})
    if decision.batch != probe.n:
        probe = _probe(cfg, data, device)
    return cfg, probe, decision.fits


# ------------------------------------------------------------------------------------------ the batch on a GPU
def _decide_batch(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan,
                  setting: dict[str, Any] | None = None) -> TrainConfig:
    """On a CUDA GPU with ``gpu_batch``: the batch from ``choose_batch`` on the run's own step (with ``setting``: the
    candidate the planner times first, before any other is timed at this batch), and the LR with it."""
    if device.type != "cuda" or not cfg.gpu_batch or cfg.grad_accum != 1:
        return cfg
    setting = setting or {"precision": cfg.precision, "attention": cfg.attention, "channels_last": cfg.channels_last}
    free, _ = torch.cuda.mem_get_info(device)
    held = _held_beside_the_step(cfg, data, device)
    batch, trials = choose_batch(_batch_measure(cfg, data, device, setting), cfg.batch_size, len(data.train),
                                 max(free - held, 0))
    torch.cuda.empty_cache()
    if held:
        p.notes.append(f"GPU memory held beside the step: {held / 2**30:.2f} GiB (the dataset, resident there, and the "
                       "EMA copy of the weights), out of the free memory the batch is sized to")
    p.notes.append("batch on this GPU: " + ", ".join(
        f"{t.batch} {t.img_per_s:,.0f} img/s {t.peak_bytes / 2**30:.1f} GiB" + ("" if t.fits else " (does not fit)")
        for t in trials) + f" -> {batch}")
    if batch == cfg.batch_size:
        return TrainConfig.from_dict({**cfg.to_dict(), "gpu_batch": False})
    new = scale_lr(cfg, batch)
    p.notes.append(f"batch {cfg.batch_size} -> {batch}: lr {cfg.lr:g} -> {new['lr']:g} "
                   f"({'linear' if cfg.opt == 'sgd' else 'square-root'} scaling), the schedule in epochs unchanged")
    return TrainConfig.from_dict({**cfg.to_dict(), **new, "gpu_batch": False})


def _held_beside_the_step(cfg: TrainConfig, data: DataSplits, device: torch.device) -> int:
    """Bytes the run will hold on the GPU besides what its step peaks at, once the batch is chosen: the dataset when
    it will live there (build.resident) and the EMA's copy of the parameters."""
    held = resident_bytes(data, device)
    if cfg.model_ema:
        held += 4 * sum(p.numel() for p in VisionTransformer(model_config(cfg, data)).parameters())
    return held


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


OPTIONAL_SHARE = 0.1  # of what is left of a --time-limit, what the measurements a run can do without may take


def optional_seconds(cfg: TrainConfig, start_time: float) -> float:
    """Seconds the planner may spend on the measurements a run can do without (the thread count, the workers):
    a tenth of what is left of a time budget (they took 12 s of a 30-second one), unbounded without one."""
    return OPTIONAL_SHARE * budget_left(cfg.time_limit, start_time) if cfg.time_limit else math.inf


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
               cal: Calibration, start_time: float, refresh: bool, unbatched: TrainConfig | None = None,
               log: Callable[[str], None] = print) -> tuple[TrainConfig, StepProbe, Calibration]:
    """The tier the budget buys; a tier that changes the step re-times the candidates close to the best on it, and
    on a GPU (``unbatched``: the config before its batch was chosen) first chooses the tier's model its own batch.
    An upward tier whose own step buys too few epochs gives way to the tiers under it."""
    _, world = rank_and_world()
    gain, whose = expected_compile_gain(cfg, device, budget_left(cfg.time_limit, start_time))
    epochs = affordable_epochs(budget_left(cfg.time_limit, start_time), (cal.best.seconds or 0.0) / gain, probe.n, world,
                               len(data.train))
    p.epochs_affordable = round(epochs, 2)
    tiers = list(cfg.tiers or [])
    said = (f"a {cfg.time_limit:g}-minute budget buys ~{epochs:.1f} epochs of this model at the fastest step"
            + (f" compiled ({gain:.2f}x the eager step, {whose})" if gain > 1 else "") + ": ")
    while (tier := pick_tier(tiers, epochs)) is not None:
        taken = _try_tier(cfg, tier, data, device, p, probe, cal, start_time, refresh, unbatched, log, gain, said)
        if taken is not None:
            return taken
        tiers = _under(tiers, tier)
        said = ""  # the budget's line is said once; the line above said where the fallback ends
    if said:
        p.notes.append(f"{said}the recipe as it is (no tier for {epochs:.1f} epochs)")
    return TrainConfig.from_dict({**cfg.to_dict(), "tiers": None}), probe, cal


def _try_tier(cfg: TrainConfig, tier: dict[str, Any], data: DataSplits, device: torch.device, p: Plan,
              probe: StepProbe, cal: Calibration, start_time: float, refresh: bool, unbatched: TrainConfig | None,
              log: Callable[[str], None], gain: float, said: str
              ) -> tuple[TrainConfig, StepProbe, Calibration] | None:
    """``tier`` laid over ``cfg``, its step timed where it changes; None where an upward tier's own step buys too few
    epochs (below)."""
    _, world = rank_and_world()
    new = cfg.with_tier(tier)
    if p.memory and "batch_size" in tier:  # the tier's own batch, accumulated as the run was asked (not as the
        # memory plan split the recipe's batch); the memory plan splits it again below where it does not fit
        new = TrainConfig.from_dict({**new.to_dict(), "grad_accum": p.memory["asked"][1]})
    changed = describe_changes(cfg.to_dict(), {k: v for k, v in tier.items() if k not in TIER_BOUNDS},
                               probe.model.config.to_dict())
    p.tier = dict(tier)
    p.notes.append(f"{said}{tier_name(tier)}: {', '.join(changed) or 'no change'}")
    if not _changes_step(cfg, new):
        return new, probe, cal
    if unbatched is not None and new.model_args != cfg.model_args:  # another model: its own batch on this GPU
        new = _decide_batch(unbatched.with_tier(tier), data, device, p, cal.best.settings)
    try:  # the tier's model is first checked here, where it is built
        new_probe = _probe(new, data, device)
    except ValueError as e:
        raise type(e)(f"{tier_name(tier)}: {e}") from None
    close = [t.settings for t in cal.timings if t.seconds is not None and t.seconds <= RETIME * cal.best.seconds]
    if p.memory is not None:  # the tier's model and batch: what fits again, before any of its steps is timed
        new, new_probe, close = _fit_memory(new, data, device, p, new_probe, close, log)
    new_cal = calibrate(f"training step ({_describe_model(new_probe.model)}, batch {new_probe.n}; the tier's model)",
                        device, step_workload(new, new_probe.model, new_probe.n, device), close, new_probe.make,
                        refresh=refresh)
    p.calibrations.append(new_cal)
    if "above" in tier:
        # On its own step an upward tier must still buy the epochs it is for: its own bound (the tier above 50's
        # regularisation is for a model seeing 50 or more epochs; its drop path makes the step a little slower, and
        # at ~98 epochs of the recipe's 100 it was dropped for the unregularised recipe, 3 points lower at 10% of
        # CIFAR-10's labels), and no more than the recipe's schedule (a larger model, the tier above 250's CCT, must
        # still get the recipe's 100 epochs, or it is not worth it).
        need = min(tier["above"], new.epochs)
        now = affordable_epochs(budget_left(cfg.time_limit, start_time), (new_cal.best.seconds or 0.0) / gain,
                                new_probe.n, world, len(data.train))
        if now < need:
            p.tier = None
            p.notes.append(f"... but its step buys only ~{now:.1f} epochs of the {need:g} it needs: "
                           + ("the tiers under it" if _under(cfg.tiers or [], tier) else "the recipe as it is"))
            return None
    return new, new_probe, new_cal


def _under(tiers: list[dict[str, Any]], tier: dict[str, Any]) -> list[dict[str, Any]]:
    """The upward tiers under ``tier`` (configs/cifar10.yaml: the tier above 50's regularisation under CCT's model)."""
    return [t for t in tiers if "above" in t and t["above"] < tier["above"]]


GROW_SLACK = 1.25  # a grown schedule asks this much more than the budget is estimated to buy: the run's own re-plans
# (training/budget.py: from steps 5-15, then every few seconds) end its cosine at the budget, never past it


def _grow_schedule(cfg: TrainConfig, data: DataSplits, p: Plan, probe: StepProbe, step_s: float,
                   start_time: float) -> TrainConfig:
    """Upward: a budget that buys more epochs than the recipe's gets a longer schedule, up to ``max_epochs`` (with
    the warmup in proportion), so that a ``--time-limit`` run uses its budget rather than ending early (the run's
    re-plans grow it further, to max_epochs, where it trains faster than ``step_s``)."""
    _, world = rank_and_world()
    epochs = affordable_epochs(budget_left(cfg.time_limit, start_time), step_s, probe.n, world, len(data.train))
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
    data = for_run(cfg, data or folder_data or build_data(cfg))
    cfg, p = make_plan(cfg, data, name, log, start_time, refresh)
    return cfg, p, data
