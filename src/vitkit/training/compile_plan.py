"""Whether a run compiles its step (the planner's compile decision, training/plan.py): only where the budget can
repay the compile, at the gain measured on this device (cached), and timed on the run's own chosen step."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..runtime.calibrate import Calibration, Timing, cached, cached_of_kind, store_unless_loaded, time_candidates
from ..runtime.compile import has_cxx_compiler
from .budget import budget_left
from .config import COMPILE_MODES, TrainConfig
from .probe import StepProbe, step_workload

# Compile is timed only where a run could repay twice its compile time at the best gain over the eager step seen on
# this device: measured there once any compile has been timed (cached), and until then a prior of the device's kind:
# on CPUs what the Fashion-MNIST recipe's compiled fp32 step gained over the eager trainer on an AVX-512 Xeon, 1.17x
# (1.12x in bf16 on an AMD EPYC with AVX512-BF16; results/train-fp32-ab.csv, docs: Speed), where 5-minute runs never
# pay for a cold one; on CUDA GPUs the H200's CIFAR-10 step in bf16 at 4096, 2.7x (results/gpu-train-step-h200.csv)
# (the CPU's 1.2x had kept an H100's runs eager).
COMPILE_GAIN = 1.2
COMPILE_GAIN_PRIOR = {"cpu": COMPILE_GAIN, "cuda": 2.7}
# a cold compile of a small ViT's step, until measured on this machine (then the measured one, cached): 30-40 s on 2
# CPU cores; 15-19 s on an H200 (results/gpu-train-step-h200.csv), where the CPU's figure kept compile off
COMPILE_PRIOR_S = {"cpu": 30.0, "cuda": 15.0}
COMPILE_MARGIN = 1.03  # compiled must be this much faster to be used: a tie is not worth the recompiles
# and the steps' time it saves must exceed its compile by this much: the saving is estimated on the steps alone, and
# a run also evaluates, writes last/ and warms its compiled step up. An H200's 2-minute Fashion-MNIST run compiled for
# 36 s to save an estimated 40 (20.6 ms a step against 35.9 eager), with the process 60.8 s in at its first step: it
# trained 1,632 steps where the eager step would have trained ~1,900 (results/gpu/h200-2026-12-04b)
COMPILE_REPAY = 1.25
def trained_step_s(p: Any, cal: Calibration, chosen: dict[str, Any], compiled: bool | str) -> float:
    """Seconds a step of the chosen settings takes as the run will train it: the compile calibration's compiled
    step where compile is on, else the chosen eager one."""
    if compiled:
        timed = next((c for c in reversed(p.calibrations) if c.what.startswith("compile")), None)
        if timed is not None and timed.seconds_of(compiled=compiled):
            return timed.seconds_of(compiled=compiled)
    return cal.seconds_of(**chosen) or cal.best.seconds or 0.0


def expected_compile_gain(cfg: TrainConfig, device: torch.device, run_s: float) -> tuple[float, str]:
    """What compiling is expected to give the step of a run of ``run_s`` seconds: the best gain measured on this
    device, or its kind's prior (``compile_gain``), where the run may compile and could repay it (as the compile
    decision will judge it); 1 where it will not compile. The tiers are chosen before compile is timed, on eager
    steps, and an eager step's epochs undercount a GPU's (2.7x on an H200)."""
    if cfg.compile is False or cfg.naflex or (device.type == "cpu" and not has_cxx_compiler()):
        return 1.0, "not compiled"
    gain, whose = compile_gain(device)
    prior = COMPILE_PRIOR_S.get(device.type, COMPILE_PRIOR_S["cpu"])
    if cfg.compile == "auto" and not compile_worth_timing(run_s, prior, gain):
        return 1.0, "a compile this budget cannot repay"
    return gain, whose


def compile_worth_timing(run_s: float, compile_s: float, gain: float = COMPILE_GAIN) -> bool:
    """Whether a run of ``run_s`` seconds could repay twice ``compile_s`` at the best ``gain`` compiling has given."""
    return run_s * (1 - 1 / gain) > 2 * compile_s


def compile_gain(device: torch.device) -> tuple[float, str]:
    """The best eager/compiled ratio measured on this device (any model, cached), or its kind's prior; and which."""
    gains = []
    for cal in cached_of_kind(device, "compile"):
        eager = cal.seconds_of(compiled=False)
        compiled = min((t for t in (cal.seconds_of(compiled=m) for m in (True, *COMPILE_MODES)) if t), default=None)
        if eager and compiled:
            gains.append(eager / compiled)
    if gains:
        return max(gains), "measured here"
    return COMPILE_GAIN_PRIOR.get(device.type, COMPILE_GAIN), f"the prior for a {device.type} device"


def _compile_outlook(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device,
                     start_time: float, refresh: bool, cal: Calibration | None
                     ) -> tuple[dict[str, Any], Calibration | None, float, float, str | None]:
    """(the compile's workload, its cached timing, the run's seconds, the compile's seconds, and why a compile is
    not worth timing, or None where it is)."""
    workload = _compile_workload(cfg, probe, chosen, device)
    known = None if refresh else cached(device, workload)
    eager_s = (cal.seconds_of(**chosen) if cal is not None else None)
    if cfg.time_limit:
        run_s = budget_left(cfg.time_limit, start_time)
    elif eager_s:
        run_s = cfg.epochs * _steps_per_epoch(cfg, probe) * eager_s
    else:
        run_s = 0.0
    prior = COMPILE_PRIOR_S.get(device.type, COMPILE_PRIOR_S["cpu"])
    compile_s = known.extra.get("compile_s", prior) if known else prior
    gain, whose = compile_gain(device)
    if device.type == "cpu" and not has_cxx_compiler():
        return workload, known, run_s, compile_s, "compile: off (no C++ compiler for Inductor's CPU kernels)"
    if not compile_worth_timing(run_s, compile_s, gain):
        return workload, known, run_s, compile_s, (
            f"compile: off (a run of ~{run_s:.0f} s cannot repay a ~{compile_s:.0f} s compile at the best gain, "
            f"{gain:.2f}x, {whose}; --compile to compile anyway)")
    return workload, known, run_s, compile_s, None


def compile_cached(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device,
                   refresh: bool) -> bool:
    """Whether this step's compile, at ``chosen``, was timed on this machine before (cached)."""
    return not refresh and cached(device, _compile_workload(cfg, probe, chosen, device)) is not None


def _compile_workload(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device
                      ) -> dict[str, Any]:
    """The cache key of this step's compile timing, at the step settings ``chosen``."""
    return {**step_workload(cfg, probe.model, probe.n, device), "kind": "compile", "settings": chosen}


def compile_left_to_the_run(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device,
                            start_time: float, refresh: bool, cal: Calibration | None
                            ) -> tuple[dict[str, Any] | None, str]:
    """Where the run's own steps decide its settings: whether they try a compile after them (training/tune.py),
    only where the budget could repay one, as ``decide_compile`` judges it before timing. (The compile's cache key,
    its settings filled in by the run; or None), and a line for the plan."""
    workload, _, run_s, compile_s, off = _compile_outlook(cfg, probe, chosen, device, start_time, refresh, cal)
    if off is not None:
        return None, off
    gain, whose = compile_gain(device)
    return workload, (f"compile: tried on the run's own steps once its settings are decided (a run of ~{run_s:.0f} "
                      f"s could repay a ~{compile_s:.0f} s compile at the best gain, {gain:.2f}x, {whose}); kept "
                      "only where the compiled step is clearly faster")


def decide_compile(cfg: TrainConfig, probe: StepProbe, chosen: dict[str, Any], device: torch.device, p: Any,
                    start_time: float, refresh: bool, cal: Calibration | None) -> tuple[bool, str]:
    workload, known, run_s, compile_s, off = _compile_outlook(cfg, probe, chosen, device, start_time, refresh, cal)
    if off is not None:
        return False, off
    if known is None:
        known = _time_compile(probe, chosen, device)
        store_unless_loaded(device, workload, known)
        p.calibrations.append(known)
    else:
        p.calibrations.append(known)
    eager = known.seconds_of(compiled=False)
    modes = [(m, known.seconds_of(compiled=m)) for m in (True, *COMPILE_MODES)]
    timed = [(m, t) for m, t in modes if t is not None]
    if not timed or eager is None:
        return False, "compile: off (the compiled step could not be timed here)"

    def cost(mode: bool | str) -> float:  # each mode's own compile: CUDA graphs' capture comes on top of Inductor's
        return known.extra.get(f"compile_s_{mode}", known.extra["compile_s"])  # (the default mode: compile_s)

    # the default mode, or CUDA graphs where they save more than their own compile costs (issue 80, N6)
    mode, compiled = max(timed, key=lambda mt: (eager - mt[1]) * (run_s / eager) - cost(mt[0]))
    compile_s = cost(mode)
    how = "" if mode is True else f" with {mode} (CUDA graphs)"
    gain_s = (eager - compiled) * (run_s / eager)
    if eager < compiled * COMPILE_MARGIN or gain_s < COMPILE_REPAY * compile_s:
        return False, (f"compile: off (compiled step{how} {compiled * 1e3:.1f} ms vs eager {eager * 1e3:.1f} ms; "
                       f"saves ~{max(gain_s, 0):.0f} s of the run's steps against a {compile_s:.0f} s compile: at "
                       f"least {COMPILE_REPAY:g}x it is worth one)")
    return mode, (f"compile: on{how} (compiled step {compiled * 1e3:.1f} ms vs eager {eager * 1e3:.1f} ms: saves "
                  f"~{gain_s:.0f} s of the run for a {compile_s:.0f} s compile, a few seconds once Inductor's cache "
                  "is warm)")


def _steps_per_epoch(cfg: TrainConfig, probe: StepProbe) -> int:
    """Timed steps (forward and backward of one batch) an epoch takes: micro-batches, with accumulation."""
    return max(1, probe.n_train // cfg.batch_size)


# On a CUDA GPU one mode is compiled and timed: reduce-overhead (Inductor's kernels, launched as CUDA graphs), and the
# default mode only where the graphs cannot be captured. Each mode is a compile of its own (a CUDA-graphs config
# misses the default mode's cache), and the graphs were never slower on the three H200 logs: 20.8 vs 27.2 ms
# (Fashion-MNIST), 49.5 vs 50.2 and 48.3 vs 49.0 ms (CIFAR-10); timing both cost a 4-minute CIFAR-10 run 48.7 s of
# its 240 (results/gpu/h200-2026-12-04).
GPU_COMPILE_MODES: tuple[bool | str, ...] = ("reduce-overhead", True)


def _time_compile(probe: StepProbe, chosen: dict[str, Any], device: torch.device) -> Calibration:
    """The compiled step against the eager one, round-robin; the first compiled calls' time is the compile."""
    failed, began = [], time.perf_counter()
    for mode in GPU_COMPILE_MODES if device.type == "cuda" else (True,):
        t0 = time.perf_counter()
        try:
            step = probe.make(chosen, compiled=mode)
            step()
            step()  # Inductor may recompile once for the second call's guards; CUDA graphs record on these calls
            break
        except Exception as e:  # noqa: BLE001 - a backend failure means: the next mode, or do not compile
            failed.append(Timing({**chosen, "compiled": mode}, note=f"failed: {e}"[:100]))
    else:
        return Calibration("compile", failed, extra={"compile_s": time.perf_counter() - t0})
    compile_s, tries_s = time.perf_counter() - t0, time.perf_counter() - began  # (tries_s: a failed mode's too)
    cal = time_candidates("compile (the chosen step)", [{"compiled": False}, {"compiled": mode}],
                          lambda s: step if s["compiled"] else probe.make(chosen), cut=10.0)
    cal.timings += failed
    cal.extra["compile_s"] = round(compile_s, 2)  # what the run pays to use it (graphs: their capture included)
    if isinstance(mode, str):  # the mode's own key, as decide_compile reads it
        cal.extra[f"compile_s_{mode}"] = round(compile_s, 2)
    cal.seconds_spent += tries_s
    return cal
