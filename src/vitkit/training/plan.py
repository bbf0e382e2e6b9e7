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
from ..data.device_decode import DECODE_BYTES
from ..data.sampler import check_batches
from ..data.stream import choose_workers, worker_candidates
from ..runtime.calibrate import Calibration, NothingRuns, Timing, cached, cached_of_kind, calibrate
from ..runtime.cpu import cpu_precisions, fp32_matmul_flops, machine_name
from ..runtime.device import resolve_device
from ..runtime.distributed import local_rank, rank0_done, rank_and_world, wait_for_rank0
from ..runtime.memory import release_free_memory
from ..runtime.threads import (OtherLoad, candidates as thread_candidates, choose_threads, threads_for_ranks,
                               timed, usable_cores)
from ..model.vit import VisionTransformer, flops_per_image
from .budget import budget_left, check_budget
from .compile_plan import (COMPILE_GAIN, compile_cached, compile_gain, compile_left_to_the_run,  # noqa: F401
                           compile_worth_timing, decide_compile, expected_compile_gain,  # (COMPILE_GAIN, compile_*:
                           trained_step_s)  # public names)
from .build import build_data, for_run, model_config, resident_bytes, search_convolutions
from .config import COMPILE_MODES, TIER_BOUNDS, TrainConfig, describe_changes
from .gpu_batch import (MEMORY_SHARE, MIN_STEPS_PER_EPOCH, BatchTrial, checkpointing_fits, choose_batch,  # noqa: F401
                        scale_lr)  # (BatchTrial: one of the plan's public names)
from .memory_plan import check_weights_fit, count_params, decide_memory, gpu_host_workers, optimizer_moments
from .semi_choice import choose_semi
from .shard import decide_shard
from .probe import StepProbe, _describe_model, _probe, step_candidates, step_workload  # noqa: F401 - public names
from .sources import Sources, resolve  # noqa: F401 - the planner's entry points, as before
from .tune import STEP_SETTINGS as TUNED, WORST_STEPS

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
    # the settings left to the run's first steps (training/tune.py): {"start", "options", "threads", "what",
    # "workload"}; None where everything was decided here
    tuning: dict[str, Any] | None = None
    tuned: dict[str, Any] | None = None  # what deciding them took: steps, seconds, seconds beyond the chosen pace
    first_step_s: float | None = None  # seconds from the run's start to its first training step (the trainer's)
    # seconds from the run's start to the plan's end (with ``seconds``: what came before it, the data's loading; with
    # ``first_step_s``: what came after, the model's build and the evaluation's timing; an H200's CIFAR-10 run took
    # ~13 s there that its log did not explain)
    ended_s: float | None = None

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
         device: torch.device | None = None, in_run: bool = False) -> tuple[TrainConfig, Plan]:
    """``cfg`` with every ``auto`` decided by timing, its tier taken (with a ``--time-limit``), and the Plan that
    says how. Threads are set for this process. Under torchrun rank 0 times and every rank takes its plan.

    ``in_run``: the thread count and the step's settings are decided on the run's own first steps, each of which
    trains (``Plan.tuning``, training/tune.py), where nothing else needs them timed first (one process, no compile
    to time): here only one step is timed, for what needs another model or the budget (the tier, the schedule, the
    budget's check)."""
    start = time.time()
    start_time = start_time or start
    rank, world = rank_and_world()
    device = device or resolve_device(cfg.device, local_rank())
    search_convolutions(device)  # (as the run's steps will be: the candidates are timed so)
    p = Plan(recipe, str(device), machine_name(device),
             {k: getattr(cfg, k) for k in ("precision", "compile", "attention", "channels_last")})
    cfg, semi_note = choose_semi(cfg, device.type)  # (where the run's own command has not decided it first)
    if semi_note:
        p.notes.append(semi_note)
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
    _check_device_settings(cfg, data, device)
    if in_run and world == 1 and threads_note == "" and device.type == "cpu":
        _plan_on_the_free_cores(p)
    if rank == 0:
        cfg = _decide(cfg, data, device, p, start_time, refresh, threads_note == "", log, in_run and world == 1)
        # (rank 0's alone, as every decision here: ranks reading their free memory apart could shard apart)
        params = count_params(model_config(cfg, data)) if world > 1 else 0
        cfg, note = decide_shard(cfg, params, device, world, p.asked["compile"])
        if note:
            p.notes.append(note)
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
    p.seconds, p.ended_s = time.time() - start, round(time.time() - start_time, 2)
    if rank == 0:
        for line in p.lines():
            log(line)
    return cfg, p


LOAD_SAMPLE_S = 0.3  # how long the planner looks at the other processes' load before it times anything


def _plan_on_the_free_cores(p: Plan) -> None:
    """Where other processes hold a core, the planner's own steps (the memory it measures, the step it times) run on
    one thread: two OpenMP threads sharing a core with a busy process wait for each other at every operator, and
    planning a 1-minute run on ants-bees took 15.5 s beside a busy loop (2.6 s quiet). The run's first steps time
    the thread count all the same."""
    n = torch.get_num_threads()
    if n < 2:
        return
    with OtherLoad() as load:
        time.sleep(LOAD_SAMPLE_S)
    if load.contended(n):
        torch.set_num_threads(1)
        p.notes.append(f"planned on 1 thread: other processes held {load.cores:.1f} of the {usable_cores()} cores")


def _decide(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan, start_time: float, refresh: bool,
            measure_threads: bool, log: Callable[[str], None] = print, in_run: bool = False) -> TrainConfig:
    """Every decision of ``DECISIONS``, in order, on the plan so far: the config they leave."""
    run_data = data.with_train_fraction(cfg.train_fraction, holdout=cfg.holdout)
    so_far = Planning(cfg, run_data, device, p, start_time, refresh, measure_threads, log, in_run=in_run)
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
    in_run: bool = False  # the threads and step settings may be left to the run's first steps (make_plan)
    compile_in_run: dict[str, Any] | None = None  # the compile's cache key, where it is tried on the run's steps

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


def _batches_make_a_step(s: Planning) -> None:
    """The training images make an optimizer step, from the counts alone, before any memory is measured (``-b
    100000`` on 1,437 digits was split 50000 x 2 by the memory plan first, then refused as "1 x 50000"). Where a
    tier or a GPU's batch search may still change the batch, the trainer checks the batch it ends with."""
    if not s.tiered and not s.gpu_batch:
        check_batches(s.data.name, len(s.data.train), s.cfg.batch_size, s.cfg.grad_accum, rank_and_world()[1])


def _weights_fit(s: Planning) -> None:
    """On a CPU, the model's weights fit the memory this process may use (--init's are counted as they are read)."""
    if s.device.type == "cpu" and not s.cfg.init:
        check_weights_fit(s.cfg, model_config(s.cfg, s.data))


def _the_step(s: Planning) -> None:
    """The run's own step on a real batch, and the candidates for every ``auto`` setting; then, before any
    full-size step is run (the threads' and the candidates' timings run them), what fits in memory."""
    s.probe = _probe(s.cfg, s.data, s.device)
    _foresee_the_step(s, f"training step ({_describe_model(s.probe.model)}, batch {s.probe.n})")
    s.cands = step_candidates(s.cfg, s.device, bool(getattr(s.probe.model.config, "hybrid", None)))
    if s.cfg.precision == "auto" and s.device.type == "cpu" and (left_out := cpu_precisions()[1]):
        s.plan.notes.append(left_out)
    s.cfg, s.probe, s.cands = _fit_memory(s.cfg, s.data, s.device, s.plan, s.probe, s.cands, s.log)


def _threads(s: Planning) -> None:
    """The thread count, timed on the step first: every candidate below is timed at the count the run trains with
    (timed at two threads on a busy 2-core machine, then trained at one, a noisy step chose the precision)."""
    if s.measure_threads and (not s.in_run or s.device.type != "cpu"):  # (off a CPU: a note, nothing timed)
        _measure_threads(s)


def _measure_threads(s: Planning) -> None:
    s.plan.notes.append(choose_threads(s.probe.make(s.cands[0]), None, "training step", s.device,
                                       optional_seconds(s.cfg, s.start_time))[1])
    s.measure_threads = False
    release_free_memory()  # each phase's steps are freed before the next one's: see runtime/memory.py


def _batch_on_a_gpu(s: Planning) -> None:
    """On a GPU, the batch: every setting below is timed at the batch the run trains with."""
    s.unbatched = s.cfg
    if s.gpu_batch:
        s.cfg = _decide_batch(s.cfg, s.data, s.device, s.plan, s.cands[0])
        s.probe = _probe(s.cfg, s.data, s.device) if s.cfg.batch_size != s.probe.n else s.probe


def _step_settings(s: Planning) -> None:
    """Precision, attention path and memory layout: every candidate timed on the run's step (calibrate: cached per
    machine); for a tier, the step timed as it is. Where the run may decide them on its own first steps
    (``in_run``), one step is timed here, for the tier, the schedule and the budget; unless a compile was asked
    for (``--compile``: the compiled model keeps the settings it is built with, so they are all timed first). A
    compile left ``auto`` is tried on the run's own steps too, after the settings (``_compile``)."""
    if not (s.cfg.needs_plan or s.tiered):
        return
    what = f"training step ({_describe_model(s.probe.model)}, batch {s.probe.n})"
    workload = step_workload(s.cfg, s.probe.model, s.probe.n, s.device)
    if s.in_run:
        s.cal = time_step(what, s.device, workload, s.cands, s.probe.make, s.refresh, one=True,
                          threads_free=s.measure_threads)
        if s.cfg.compile in (False, "auto") or s.cfg.naflex:
            s.plan.calibrations.append(s.cal)
            release_free_memory()
            return
        s.in_run = False  # a compile asked for: every candidate timed first, the compiled step built on the chosen
        if s.measure_threads:
            _measure_threads(s)
        workload = step_workload(s.cfg, s.probe.model, s.probe.n, s.device)
    s.cal = calibrate(what, s.device, workload, s.cands, s.probe.make, refresh=s.refresh)
    s.plan.calibrations.append(s.cal)
    release_free_memory()


LONG_STEP_S = 10.0  # a first step foreseen to take this long is said before it is run (it was 150 s of silence)


def _foresee_the_step(s: Planning, what: str) -> None:
    """On a CPU, before the first step is run: its matmuls' FLOPs (3x the forward's, for the backward) at this
    CPU's fp32 matmul rate. A budget that cannot hold even half of that (a larger matmul runs faster: 60 against 49
    GFLOP/s at 2048) is refused now, with nothing run; a step foreseen to take ``LONG_STEP_S`` or more is said
    (``--recipe imagenet-vit-s16 --estimate`` on 150 small images printed nothing for 150 s)."""
    if s.device.type != "cpu":
        return
    rate = fp32_matmul_flops()
    step_s = 3 * flops_per_image(s.probe.model.config) * s.probe.n / rate
    if s.cfg.time_limit and s.cfg.objective == "classify":  # (MAE's encoder sees a quarter of the patches, and
        # its decoder is not this model: the classifier's FLOPs would over-refuse a pre-training's short budget)
        try:
            check_budget(s.cfg.time_limit, time.time() - s.start_time, step_s / 2, s.probe.n * s.cfg.grad_accum,
                         len(s.data.train), len(s.data.val))
        except ValueError as e:
            raise ValueError(f"{e} (a step foreseen at half its FLOPs' time at this CPU's fp32 matmul rate, "
                             f"{rate / 1e9:.0f} GFLOP/s: nothing was run)") from None
    if step_s >= LONG_STEP_S:
        s.log(f" {what}: ~{step_s:.0f} s a step or more, foreseen from its FLOPs at this CPU's matmul "
              f"rate ({rate / 1e9:.0f} GFLOP/s)")


ESTIMATE_CALLS = 2  # timed calls of the one step the planner times (after a warm-up), the fastest kept: a step's
# second call can still be warming up (the CIFAR-10 hybrid's bf16 sdpa step: 599, 615, then 439-398 ms)


def time_step(what: str, device: torch.device, workload: dict[str, Any], cands: list[dict[str, Any]],
              make: Callable[[dict[str, Any]], Callable[[], Any]], refresh: bool, one: bool,
              reuse: Calibration | None = None, threads_free: bool = False) -> Calibration:
    """The step's calibration: cached, or every candidate timed (calibrate), or with ``one`` the step of the
    candidate the run starts from (``prior_first``), once warm: the others are timed on the run's own steps
    (training/tune.py). ``reuse``: what to take, uncached, instead of timing one step (a tier with the same model and
    batch: its optimizer and augmentation change the step little, and the run's first steps time it).
    ``threads_free``: the thread count is the run's to choose; where other processes held a core while the step was
    timed on all of them, it is timed on one too, and the faster count kept (the run starts there): on a 2-core
    Xeon with a busy loop beside it the CIFAR-10 hybrid's step took 1.3 s on two threads, 0.76 s on one, and a
    1-minute run was refused from the two-thread figure."""
    hit = None if refresh else cached(device, {**workload, "candidates": cands})
    if hit is None and one and reuse is not None:
        return reuse
    if hit is not None or not one:
        return hit or calibrate(what, device, workload, cands, make, refresh=refresh)
    first = prior_first(cands, device)
    t0 = time.perf_counter()
    try:
        step = make(first)
        step()
        with OtherLoad() as load:
            samples = [timed(step) for _ in range(ESTIMATE_CALLS)]
        n, note = torch.get_num_threads(), ""
        if threads_free and device.type == "cpu" and n > 1 and load.contended(n):
            torch.set_num_threads(1)
            step()  # (oneDNN builds its primitives again for a new thread count)
            one_thread = [timed(step) for _ in range(ESTIMATE_CALLS)]
            if min(one_thread) < min(samples):
                samples, note = one_thread, (f"on 1 thread: others held {load.cores:.1f} cores "
                                             f"({min(samples) * 1e3:.0f} ms on {n})")
            else:
                torch.set_num_threads(n)
    except (RuntimeError, ValueError, NotImplementedError, MemoryError) as e:  # as calibrate: try them all then
        if len(cands) == 1:
            raise NothingRuns(f"{what}: {' '.join(str(e).split())[:120]}") from None
        return calibrate(what, device, workload, cands, make, refresh=refresh)
    return Calibration(f"{what}; one step, the others timed on the run's first steps",
                       [Timing(first, min(samples), len(samples), note)], seconds_spent=time.perf_counter() - t0)


def _check_device_settings(cfg: TrainConfig, data: DataSplits, device: torch.device) -> None:
    """Settings that mean nothing for this device or data are refused, not accepted and ignored (torch warned "No
    CUDA runtime" for CUDA graphs on a CPU, and --decode on data held in memory changed nothing, unsaid). A resumed
    run's are its own plan's (decided on another machine, or for data streamed then), not the user's flags."""
    if cfg.resume:
        return
    if cfg.compile in COMPILE_MODES and device.type != "cuda":
        raise ValueError(f"--compile {cfg.compile}: CUDA graphs, which a GPU runs; this run is on {device.type}: "
                         "--compile true (Inductor's default mode) or auto")
    if cfg.decode != "auto" and not data.streamed:
        raise ValueError(f"--decode {cfg.decode}: where streamed files are decoded; {data.name} is held in memory, "
                         "decoded once before training: leave --decode out, or --data-mode stream")


def prior_first(cands: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The candidate most like what won the training steps timed on this machine before (any model, cached): the one
    the run starts from, and times first. Without any, the first (step_candidates' order: CPU flags order them)."""
    won = [c.best.settings for c in cached_of_kind(device, "train step")]
    if not won:
        return cands[0]
    return max(cands, key=lambda c: (sum(w.get(k) == v for w in won for k, v in c.items()), -cands.index(c)))


def _tier(s: Planning) -> None:
    """The recipe's tier for the epochs the budget buys (and no tiers left in the config either way)."""
    if s.tiered and s.cal is not None:
        s.cfg, s.probe, s.cal, s.cands = _take_tier(s.cfg, s.data, s.device, s.plan, s.probe, s.cal, s.start_time,
                                                    s.refresh, s.unbatched if s.gpu_batch else None, s.log,
                                                    s.cands if s.in_run else None)
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
    elif s.cfg.compile == "auto" and s.in_run and not (s.cal is not None and s.cal.cached
                                                       and compile_cached(s.cfg, s.probe, s.chosen, s.device,
                                                                          s.refresh)):
        # the settings are decided on the run's first steps: a compile, where one may pay, is tried on the steps
        # after them (training/tune.py), on the step they chose
        compile_on, s.compile_in_run, why = False, *compile_left_to_the_run(
            s.cfg, s.probe, s.chosen, s.device, s.start_time, s.refresh, s.cal)
        s.plan.notes.append(why)
    elif s.cfg.compile == "auto":
        compile_on, why = decide_compile(s.cfg, s.probe, s.chosen, s.device, s.plan, s.start_time, s.refresh, s.cal)
        s.plan.notes.append(why)
        if compile_on and s.in_run:  # (from the cache) a compiled model keeps its thread count: timed here
            s.in_run = False
            if s.measure_threads:
                _measure_threads(s)
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


REPAY_SHARE = 0.1  # a setting is timed on the run's first steps where its worst cost is at most this share of what
# is left of the budget: a step 10% faster repays it


def _leave_to_the_run(s: Planning) -> None:
    """What is left to the run's first steps (training/tune.py): the thread count, and the step's settings left
    ``auto`` where they were not read from the cache. A setting whose timing cannot repay itself in the budget is
    not timed: each candidate it adds costs at most its warm-up and first timed step at up to ``FIRST_CUT`` times
    the pace and two more at up to ``CUT`` (it is dropped beyond), ~3 steps' time, against ``REPAY_SHARE`` of what is
    left (the steps train all the same)."""
    if not s.in_run or s.cfg.compile:
        return
    compiled = {"compile": [False, True]} if s.compile_in_run else {}  # (its cost was judged in _compile)
    cached_ = s.cal is not None and s.cal.cached
    options = {} if cached_ else {k: list(dict.fromkeys(c[k] for c in s.cands)) for k in TUNED
                                  if s.plan.asked.get(k) == "auto"}
    options = {k: v for k, v in options.items() if len(v) > 1}
    threads = thread_candidates(usable_cores()) if s.measure_threads and s.device.type == "cpu" else None
    threads = threads if threads and len(threads) > 1 else None
    step_s = s.step_s()
    if s.cfg.time_limit and step_s > 0:
        left = budget_left(s.cfg.time_limit, s.start_time)
        cost = (lambda n: WORST_STEPS * (n - 1) * step_s)
        dropped = [k for k, v in options.items() if cost(len(v)) > REPAY_SHARE * left]
        if threads and cost(len(threads)) > REPAY_SHARE * left:
            dropped.append("threads")
            threads = None
        options = {k: v for k, v in options.items() if k not in dropped}
        if dropped:
            s.plan.notes.append(f"not timed: {', '.join(dropped)} (each candidate could cost ~{WORST_STEPS} steps of "
                                f"{step_s * 1e3:.0f} ms, more than {REPAY_SHARE:.0%} of the ~{left:.0f} s left): "
                                + ", ".join(f"{k} {v}" for k, v in s.chosen.items()) + " as timed first")
    options.update(compiled)
    if not options and not threads:
        return
    s.plan.tuning = {"start": {**s.chosen, "compile": False, "threads": torch.get_num_threads()}, "options": options,
                     "threads": threads, "what": s.cal.what.split(";")[0] if s.cal is not None else "training step",
                     "workload": step_workload(s.cfg, s.probe.model, s.probe.n, s.device) if s.probe else None,
                     "candidates": s.cands, "compile_workload": s.compile_in_run}
    s.plan.notes.append("decided while training: " + ", ".join(
        [*(["threads"] if threads else []), *options]) + " (each timed on the run's own first steps, which train; "
                        + ("the rest cached" if cached_ else "the cache has none yet") + ")")


# The planner's decisions, in the order they are made: each a function of the plan so far. A new decision (a GPU's,
# say) is a new entry here, placed where what it needs has been decided.
DECISIONS: list[Callable[[Planning], None]] = [
    _batches_make_a_step, _weights_fit, _the_step, _threads, _batch_on_a_gpu, _step_settings, _tier,
    _fastest_settings, _compile, _leave_to_the_run, _schedule, _data_pipeline, _budget_holds]


def _decide_workers(cfg: TrainConfig, data: DataSplits, device: torch.device, p: Plan,
                    probe: StepProbe | None = None, step_s: float = 0.0,
                    max_seconds: float = math.inf) -> TrainConfig:
    """A streamed dataset: how many DataLoader workers decode while the run's step trains (stream.choose_workers:
    the pipeline timed with each count, on the chosen settings' eager step), unless ``--workers`` said. Timing a
    count costs a few steps; where the counts would cost more than ``max_seconds`` (``step_s`` a step), two
    workers (or what memory allows) are used untimed."""
    if not data.streamed:
        return cfg
    if device.type == "cuda" and p.memory is None:
        _plan_host_memory(cfg, data, p)
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
    """Where a streamed run's JPEGs are decoded, where the timing above did not decide it (``--workers`` given, or a
    budget too short to time it): the workers. On a CPU its own cores train the step; on a GPU the device's decode
    is a path no GPU has run yet for vitkit (issue 80: nothing auto takes untimed that has no measurement in
    results/gpu/): ``--decode device`` asks for it."""
    if cfg.decode == "auto":
        p.notes.append("decode: by the workers " + ("(decoding on the GPU is not timed in this run, and no GPU has "
                                                     "measured it yet: --decode device to use it)"
                                                     if device.type == "cuda" and not cfg.naflex else
                                                     "(the training process's cores train)"))
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "decode": "workers"})
    p.chosen["decode"] = cfg.decode
    return cfg


def _plan_host_memory(cfg: TrainConfig, data: DataSplits, p: Plan) -> None:
    """On a GPU host: the workers the host's memory holds beside the training process, at the larger of the
    training and evaluation batches (memory_plan.gpu_host_workers), kept in ``plan.memory`` as a CPU's plan is."""
    _, c, h, w = data.train.shape
    batch = max(cfg.batch_size, cfg.eval_batch_size)
    host = gpu_host_workers(c * h * w, batch)
    if host is None:
        return
    most, per, memory = host
    p.memory = {"note": f"host memory: {memory.describe()}; a DataLoader worker holds ~{per / 2**20:,.0f} MiB at "
                        f"batch {batch}: {most} fit", "max_workers": most}
    p.notes.append(p.memory["note"])


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
    held, what_held = _held_beside_the_step(cfg, data, device)
    batch, trials = choose_batch(_batch_measure(cfg, data, device, setting), cfg.batch_size, len(data.train),
                                 max(free - held, 0))
    torch.cuda.empty_cache()
    if held:
        p.notes.append(f"GPU memory held beside the step: {held / 2**30:.2f} GiB ({', '.join(what_held)}), out of the "
                       "free memory the batch is sized to")
    p.notes.append("batch on this GPU: " + (", ".join(
        f"{t.batch} {t.img_per_s:,.0f} img/s {t.peak_bytes / 2**30:.1f} GiB" + ("" if t.fits else " (does not fit)")
        for t in trials) + f" -> {batch}" if trials else
        f"{batch}, the recipe's (a larger one would leave an epoch of {len(data.train):,} images fewer than "
        f"{MIN_STEPS_PER_EPOCH} steps; nothing timed)"))
    if batch == cfg.batch_size:
        if not cfg.grad_checkpointing and (ckpt := checkpointing_fits(
                trials, batch, _batch_measure(TrainConfig.from_dict({**cfg.to_dict(), "grad_checkpointing": True}),
                                              data, device, setting), max(free - held, 0))):
            torch.cuda.empty_cache()
            mine = next(t for t in trials if t.batch == batch)
            p.notes.append(f"batch {batch} does not fit in {MEMORY_SHARE:.0%} of the GPU's free memory (its step peaks "
                           f"at {mine.peak_bytes / 2**30:.1f} GiB or more): activation checkpointing "
                           f"(--grad-checkpointing) fits it, {ckpt.peak_bytes / 2**30:.1f} GiB at "
                           f"{ckpt.img_per_s:,.0f} img/s; the recipe's batch and learning rate unchanged")
            return TrainConfig.from_dict({**cfg.to_dict(), "gpu_batch": False, "grad_checkpointing": True})
        return TrainConfig.from_dict({**cfg.to_dict(), "gpu_batch": False})
    new = scale_lr(cfg, batch)
    p.notes.append(f"batch {cfg.batch_size} -> {batch}: lr {cfg.lr:g} -> {new['lr']:g} "
                   f"({'linear' if cfg.opt == 'sgd' else 'square-root'} scaling), the schedule in epochs unchanged")
    return TrainConfig.from_dict({**cfg.to_dict(), **new, "gpu_batch": False})


def _held_beside_the_step(cfg: TrainConfig, data: DataSplits, device: torch.device) -> tuple[int, list[str]]:
    """Bytes the run will hold on the GPU besides what its step peaks at, once the batch is chosen, and what they
    are: the dataset when it will live there (build.resident), the EMA's copy of the parameters, and where a stream's
    JPEGs may be decoded on the GPU (``--decode device``, or ``auto`` before it is decided) the decode's full-size
    chunk, which is decoded while the step runs (data/stream.py, ``_decoded_ahead``)."""
    parts = {"the dataset, resident there": resident_bytes(data, device)}
    if cfg.model_ema:
        parts["the EMA copy of the weights"] = 4 * sum(p.numel() for p in
                                                      VisionTransformer(model_config(cfg, data)).parameters())
    if data.streamed and cfg.decode in ("device", "auto") and not cfg.naflex:
        parts["the next batch's JPEGs decoded at full size, while the step runs"] = DECODE_BYTES
    return sum(parts.values()), [what for what, n in parts.items() if n]


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
               log: Callable[[str], None] = print, in_run: list[dict[str, Any]] | None = None
               ) -> tuple[TrainConfig, StepProbe, Calibration, list[dict[str, Any]]]:
    """The tier the budget buys; a tier that changes the step re-times the candidates close to the best on it, and
    on a GPU (``unbatched``: the config before its batch was chosen) first chooses the tier's model its own batch.
    An upward tier whose own step buys too few epochs gives way to the tiers under it. ``in_run``: the candidates
    the run will time on its own steps (the tier's step is timed once here, and they are what fits for its model);
    returned with the rest (the candidates close to the best otherwise)."""
    _, world = rank_and_world()
    gain, whose = expected_compile_gain(cfg, device, budget_left(cfg.time_limit, start_time))
    epochs = affordable_epochs(budget_left(cfg.time_limit, start_time), (cal.best.seconds or 0.0) / gain, probe.n, world,
                               len(data.train))
    p.epochs_affordable = round(epochs, 2)
    tiers = list(cfg.tiers or [])
    said = (f"a {cfg.time_limit:g}-minute budget buys ~{epochs:.1f} epochs of this model at the fastest step"
            + (f" compiled ({gain:.2f}x the eager step, {whose})" if gain > 1 else "") + ": ")
    while (tier := pick_tier(tiers, epochs)) is not None:
        taken = _try_tier(cfg, tier, data, device, p, probe, cal, start_time, refresh, unbatched, log, gain, said,
                          in_run)
        if taken is not None:
            return taken
        tiers = _under(tiers, tier)
        said = ""  # the budget's line is said once; the line above said where the fallback ends
    if said:
        p.notes.append(f"{said}the recipe as it is (no tier for {epochs:.1f} epochs)")
    return TrainConfig.from_dict({**cfg.to_dict(), "tiers": None}), probe, cal, in_run or [t.settings for t in
                                                                                         cal.timings]


def _try_tier(cfg: TrainConfig, tier: dict[str, Any], data: DataSplits, device: torch.device, p: Plan,
              probe: StepProbe, cal: Calibration, start_time: float, refresh: bool, unbatched: TrainConfig | None,
              log: Callable[[str], None], gain: float, said: str, in_run: list[dict[str, Any]] | None = None
              ) -> tuple[TrainConfig, StepProbe, Calibration, list[dict[str, Any]]] | None:
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
        return new, probe, cal, in_run or [t.settings for t in cal.timings]
    if unbatched is not None and new.model_args != cfg.model_args:  # another model: its own batch on this GPU
        new = _decide_batch(unbatched.with_tier(tier), data, device, p, cal.best.settings)
    try:  # the tier's model is first checked here, where it is built
        new_probe = _probe(new, data, device)
    except ValueError as e:
        raise type(e)(f"{tier_name(tier)}: {e}") from None
    close = in_run or [t.settings for t in cal.timings
                       if t.seconds is not None and t.seconds <= RETIME * cal.best.seconds]
    if p.memory is not None and not _holds_no_more(cfg, new):  # the tier's model and batch: what fits again,
        new, new_probe, close = _fit_memory(new, data, device, p, new_probe, close, log)  # before a step is timed
    same_model = new.model_args == cfg.model_args and new_probe.n == probe.n
    new_cal = time_step(f"training step ({_describe_model(new_probe.model)}, batch {new_probe.n}; the tier's model)",
                        device, step_workload(new, new_probe.model, new_probe.n, device), close, new_probe.make,
                        refresh, one=in_run is not None, reuse=cal if in_run is not None and same_model else None)
    if new_cal is not cal:  # (the step timed before, reused: listed once)
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
    return new, new_probe, new_cal, close


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


def _holds_no_more(a: TrainConfig, b: TrainConfig) -> bool:
    """Whether ``b``'s step holds no more memory than ``a``'s, measured: the same model and batch, an optimizer with
    no more moments (CIFAR-10's tier below 4 trades AdamW for Muon; measuring it again took 2.7 s of a minute)."""
    keys = ("model_args", "batch_size", "grad_accum", "objective", "model_ema")
    return all(getattr(a, k) == getattr(b, k) for k in keys) and optimizer_moments(b) <= optimizer_moments(a)


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
