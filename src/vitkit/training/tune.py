"""Deciding while training: the run's first steps are the timings of its ``auto`` settings, and each of them trains.

Timing the candidates up front cost a 5-minute CIFAR-10 run 15-33 s on a quiet 2-core machine and 110-186 s beside
another job (issue 79), seconds in which nothing trained; and the steps timed there were not the steps the run then
trained at. Here the trainer asks ``StepTuner.next()`` for the settings of its next optimizer step, trains it with
them, and reports its seconds (``record``). The settings are decided one at a time, the others held at the best so
far: the thread count first (on a shared machine it decides how fast everything else runs), then the precision,
the attention path and the conv weights' layout. Each candidate's first step warms it up (oneDNN builds its
primitives) and is not counted; then the candidates are timed round-robin, so that a neighbour's load falls on all
of them alike, and one ``FIRST_CUT`` times slower than the best is dropped after its first timed step (``CUT``
after the later ones; already at its warm-up where that took ``WARM_CUT`` times the best timed step: an emulated
bf16 costs one slow step, not four).

A run's master weights, optimizer state and data are the same under every candidate (autocast, the attention
kernel, the weights' memory format and the thread count change how a step computes, not what it learns), so the
tuning steps are ordinary training steps. What they cost is only how much slower the candidates that lost were
than the one chosen (``excess_s``), which the plan reports.

Last, where the budget could repay a compile (training/compile_plan.py) and none was timed for this step before, the
chosen step compiled (``compile``) against it eager: torch.compile shares the module's parameters, so the compiled
step trains the same weights. Its first two steps are the compile (Inductor may recompile once for the second call's
guards) and are never cut on; then the two are timed round-robin like any setting, and eager is kept unless compiled
is clearly faster. Timed before the first step instead, a 30-minute CIFAR-10 run spent 48 s (2.7% of its budget) on
all 8 candidates and a compile that lost (418 vs 399 ms); here what a lost compile costs is its compile alone,
which on that 2-core EPYC is most of it (a cold compile of 36-58 s): a first run on a machine still pays it once,
and the next reads the loss from the cache.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from ..runtime.calibrate import CUT, Calibration, Timing
from ..runtime.threads import BIG_STEP_S, OtherLoad, pick

ROUNDS = 3  # timed steps per candidate (round-robin) ...
# ... or up to MAX_ROUNDS while a setting's timed steps have taken less than SHORT_PHASE_S: a 60 ms step's three
# samples told bf16 from fp32 by less than their noise (Fashion-MNIST's tier model: 77 against 69 ms, 62 ms before)
MAX_ROUNDS, SHORT_PHASE_S = 8, 1.0
WARM_CUT = 3.0  # a candidate whose warm-up step took this many of the best timed step is dropped without timing
# after its first timed step a candidate is dropped only this far behind (CUT after the later ones): a step's second
# call can still be warming up (the CIFAR-10 hybrid's bf16 sdpa step: 599, 615, then 439-398 ms)
FIRST_CUT = 2.0
# what a candidate that loses can cost, in steps of the winner's pace: its warm-up and first timed step at up to
# FIRST_CUT times it, and ROUNDS - 1 more at up to CUT times it (the planner's repay test, training/plan.py)
WORST_STEPS = round(2 * (FIRST_CUT - 1) + (ROUNDS - 1) * (CUT - 1) + 0.49)
# A setting's held value (the prior's, or the cache's) is kept against one at most this much faster: beside a busy
# process two 5-minute CIFAR-10 runs on the AVX2 EPYC chose different attention paths and layouts on steps within a
# few percent of each other (82 and 90 steps, 40.97% and 43.23%; issue 79 asks the same settings twice), and the
# AMX Xeon's bf16 exact step with and without channels_last is 236 against 235 ms: a choice on noise
TIE = 1.03
STEP_SETTINGS = ("precision", "attention", "channels_last")  # the step's settings, in the order they are decided
SETTINGS = (*STEP_SETTINGS, "compile")  # ... and then, on the chosen step, whether it is compiled
COMPILE_WARM_STEPS = 2  # a compiled candidate's untimed first steps: the compile, and the recompile it may need
# Cores of other processes' load that moved this much between two steps makes them unfair to cut one on the other: a
# neighbour that left mid-round made the up-front timing's last candidate, fp32, timed alone at 1.9 s, beat bf16's
# 7.6 s under load (a 30-minute FixMatch run then trained at half bf16's pace, issue 79); a steady neighbour (a busy
# loop from the start) falls on every step alike, and the cuts stay as cheap as they are on a quiet machine
LOAD_SHIFT = 0.5


@dataclass
class _Candidate:
    value: Any
    warm: float | None = None
    samples: list[float] = field(default_factory=list)
    note: str = ""
    warm_load: float | None = None  # others' cores during its warm-up step (OtherLoad; None: too short to tell)
    loads: list[float | None] = field(default_factory=list)  # ... during each of its timed steps

    @property
    def alive(self) -> bool:
        return not self.note


@dataclass
class Phase:
    """One setting's candidates (``key``: "threads" or one of ``SETTINGS``), timed with the others held."""

    key: str
    candidates: list[_Candidate]
    held: dict[str, Any]  # the other settings while this one was timed
    chosen: Any = None
    note: str = ""  # why a cut was not made (the load moved)


class StepTuner:
    """The settings of the run's next steps while its ``auto`` settings are being decided (``next``), their timings
    (``record``), and once ``done``, what was chosen (``chosen``) and how (``lines``, ``calibration``)."""

    def __init__(self, start: dict[str, Any], options: dict[str, list[Any]], threads: list[int] | None = None,
                 rounds: int = ROUNDS, load: Callable[[], OtherLoad] = OtherLoad) -> None:
        """``start``: the settings the run starts with (``SETTINGS`` and ``threads``); ``options``: for each setting
        left ``auto``, its candidates (the start's value among them); ``threads``: the thread counts to time, or
        None where the count is given; ``load``: what measures other processes' load over a step."""
        self.current = dict(start)
        self.rounds = rounds
        self._load = load
        self._step_load: float | None = None  # others' cores over the step ``_timed`` last gave
        keys = (["threads"] if threads and len(threads) > 1 else []) + [k for k in SETTINGS
                                                                       if len(options.get(k, [])) > 1]
        self.options = {**{k: list(v) for k, v in options.items()}, **({"threads": list(threads)} if threads else {})}
        self.keys = keys
        self.phases: list[Phase] = []
        self.steps = 0  # steps taken under the tuner
        self.seconds = 0.0  # what they took
        self._pending: float | None = None
        self._failed: str | None = None  # why the step being timed failed (``fail``)
        self._plan = self._schedule()
        self._next = self._advance()

    # ------------------------------------------------------------------------------------------ the trainer's side
    @property
    def done(self) -> bool:
        return self._next is None

    def next(self) -> dict[str, Any] | None:
        """The settings of the next step, or None: the tuning is over (``chosen``)."""
        return dict(self._next) if self._next is not None else None

    def record(self, seconds: float) -> None:
        """The step ``next`` gave the settings of took ``seconds``."""
        if self._next is None:
            return
        self.steps += 1
        self.seconds += seconds
        self._pending = seconds
        self._next = self._advance()

    def fail(self, why: str) -> None:
        """The candidate of the step being timed failed (a compile Inductor could not build; the run stepped on
        eagerly): it is dropped, ``why`` said."""
        self._failed = why

    def stop(self) -> None:
        """End the tuning now (the run is ending, or the budget cannot afford more): the best so far is kept."""
        if self.phases and self.phases[-1].chosen is None:
            self._decide(self.phases[-1])
        self._next = None

    @property
    def chosen(self) -> dict[str, Any]:
        return dict(self.current)

    # ------------------------------------------------------------------------------------------ the schedule
    def _advance(self) -> dict[str, Any] | None:
        try:
            return next(self._plan)
        except StopIteration:
            return None

    def _timed(self, phase: Phase, c: _Candidate) -> Generator[dict[str, Any], None, float]:
        """Yields the settings of one step of candidate ``c``; returns its seconds."""
        with self._load() as load:  # (the generator waits here while the trainer runs the step)
            yield {**phase.held, phase.key: c.value}
        self._step_load = load.cores
        assert self._pending is not None
        seconds, self._pending = self._pending, None
        if self._failed:
            c.note, self._failed = self._failed, None
        return seconds

    def _schedule(self) -> Generator[dict[str, Any], None, None]:
        for key in self.keys:
            phase = Phase(key, [_Candidate(v) for v in self._ordered(key)], dict(self.current))
            self.phases.append(phase)
            for c in phase.candidates:  # round 1: each one's warm-up, then its first timed step
                # (the value held from the phase before is warm: its steps there were its warm-up)
                if not (self.phases[0] is not phase and c.value == self.current.get(key)):
                    c.warm = yield from self._timed(phase, c)
                    for _ in range(COMPILE_WARM_STEPS - 1 if key == "compile" and c.value and c.alive else 0):
                        c.warm += yield from self._timed(phase, c)
                    c.warm_load = self._step_load
                if not c.alive:  # (failed)
                    continue
                best = _best_timed(phase)
                # (a compile's warm-up is the compile: what it costs was judged before it was tried)
                cut = key != "compile" and c.warm is not None and best is not None
                if cut and _load_moved(c.warm_load, _load_at_best(phase)):  # timed, not cut at its warm-up
                    phase.note, cut = _moved_note(c.warm_load, _load_at_best(phase)), False
                if cut and c.warm > WARM_CUT * best:
                    c.note = f"cut at warm-up ({c.warm * 1e3:.0f} ms vs {best * 1e3:.0f} ms)"
                    continue
                if cut and _splits_well(phase, c, best):
                    c.note = f"cut at warm-up ({c.warm * 1e3:.0f} ms: a {best:.1f} s step splits well)"
                    continue
                c.samples.append((yield from self._timed(phase, c)))
                c.loads.append(self._step_load)
            first = [c.loads[0] for c in phase.candidates if c.alive and c.loads and c.loads[0] is not None]
            if first and _load_moved(min(first), max(first)):  # round 1 is not cut on; the pace leaves it out
                phase.note = _moved_note(min(first), max(first))
            else:
                self._cut(phase, FIRST_CUT)
            for r in range(1, MAX_ROUNDS):
                alive = [c for c in phase.candidates if c.alive]
                timed_s = sum(sum(c.samples) for c in phase.candidates)
                if len(alive) < 2 or (r >= self.rounds and timed_s >= SHORT_PHASE_S):
                    break
                for c in alive:
                    c.samples.append((yield from self._timed(phase, c)))
                    c.loads.append(self._step_load)
                self._cut(phase)
            self._decide(phase)

    def _ordered(self, key: str) -> list[Any]:
        """The candidates of ``key``, the value the run holds now first (it is warm: its first step is the run's)."""
        values = self.options[key]
        now = self.current.get(key)
        return ([now] if now in values else []) + [v for v in values if v != now]

    @staticmethod
    def _cut(phase: Phase, cut: float = CUT) -> None:
        best = _best_timed(phase)
        for c in phase.candidates:
            if c.alive and c.samples and best is not None and min(c.samples) > cut * best:
                c.note = f"cut after {len(c.samples)} step{'s' if len(c.samples) > 1 else ''}"

    def _decide(self, phase: Phase) -> None:
        timed = [c for c in phase.candidates if c.samples and c.alive]
        if not timed:
            phase.chosen = self.current.get(phase.key)
            return
        if phase.key == "threads":  # the fewest threads within 10% of the fastest (threads.pick: they share better)
            phase.chosen = pick({c.value: min(c.samples) for c in timed})
        else:  # the fastest, unless the value held into the phase (the prior or the cache's) is not clearly slower
            best = min(timed, key=lambda c: _pace(c.samples))
            held = next((c for c in timed if c.value == phase.held.get(phase.key) and c.alive), best)
            phase.chosen = best.value if _clearly_faster(best.samples, held.samples) else held.value
        self.current[phase.key] = phase.chosen

    # ------------------------------------------------------------------------------------------ what was decided
    @property
    def excess_s(self) -> float:
        """Seconds the tuning steps took beyond what as many steps of the chosen settings would have (the warm-up of
        the first candidate, which the run's first step pays anyway, not counted)."""
        pace = self.pace()
        return max(0.0, self.seconds - self.steps * pace) if pace else 0.0

    def pace(self) -> float | None:
        """Seconds a step of the chosen settings took: its timed steps in the last phase."""
        for phase in reversed(self.phases):
            c = next((c for c in phase.candidates if c.value == phase.chosen and c.samples), None)
            if c is not None:
                return _pace(c.samples)
        return None

    def calibration(self, what: str) -> Calibration | None:
        """The step settings' timings as a ``Calibration`` (for the plan and the cache): each candidate timed with the
        others at the settings its phase held (the held best appears in each phase: its samples are pooled)."""
        pooled: dict[tuple, tuple[dict[str, Any], list[float], list[str]]] = {}
        for phase in self.phases:
            if phase.key not in STEP_SETTINGS:
                continue
            for c in phase.candidates:
                settings = {k: (c.value if k == phase.key else phase.held[k]) for k in STEP_SETTINGS}
                _, samples, notes = pooled.setdefault(tuple(settings.items()), (settings, [], []))
                samples += c.samples
                notes += [c.note] if c.note else []
        if not pooled:
            return None
        timings = [Timing(s, _pace(x) if x else None, len(x), notes[0] if notes else "")  # (as chosen)
                   for s, x, notes in pooled.values()]
        cal = Calibration(what, timings, seconds_spent=self.seconds)
        chosen = {k: self.current[k] for k in STEP_SETTINGS}
        if any(t.settings == chosen and t.seconds is not None for t in timings):
            cal.chosen = chosen
        return cal

    @property
    def step_phases(self) -> int:
        """How many of the step's settings were timed (not the threads, not the compile)."""
        return sum(p.key in STEP_SETTINGS for p in self.phases)

    def compile_calibration(self, what: str) -> Calibration | None:
        """The compile's timing, as the planner's compile decision reads it from the cache (``compile_plan``): the
        eager and the compiled step, and the compile's seconds (its untimed first steps)."""
        phase = next((p for p in self.phases if p.key == "compile"), None)
        tried = next((c for c in phase.candidates if c.value), None) if phase else None
        if tried is None or tried.warm is None:
            return None
        timings = [Timing({"compiled": c.value}, _pace(c.samples) if c.samples else None, len(c.samples), c.note)
                   for c in phase.candidates]
        return Calibration(what, timings, seconds_spent=sum(c.warm or 0.0 for c in phase.candidates) + sum(
            sum(c.samples) for c in phase.candidates), extra={"compile_s": round(tried.warm, 2)})

    def threads_line(self, cores: int) -> str | None:
        phase = next((p for p in self.phases if p.key == "threads"), None)
        if phase is None:
            return None
        each = ", ".join(f"{c.value} thread{'s' if c.value > 1 else ''} "
                         + (f"{min(c.samples) * 1e3:.1f} ms" if c.samples else c.note or "not timed")
                         for c in phase.candidates)
        return (f"threads: {phase.chosen} of {cores} cores (timed on the run's own steps while it trained: {each}; "
                "--threads N to set)")

    def lines(self) -> list[str]:
        """What the tuning did, for the run's log."""
        pace = self.pace()
        out = [f"decided while training: {self.steps} steps ({self.seconds:.1f} s, ~{self.excess_s:.1f} s more than "
               f"as many of the chosen settings' steps{f' at {pace * 1e3:.0f} ms' if pace else ''})"]
        for phase in self.phases:
            if not any(c.samples for c in phase.candidates):  # stopped before it (the budget's share, the run's end)
                out.append(f"  {phase.key}: not timed (the tuning was stopped) -> {_name(phase.key, phase.chosen)}")
                continue
            each = ", ".join(f"{_name(phase.key, c.value)} "
                             + (f"{_pace(c.samples) * 1e3:.0f} ms" if c.samples else "-")
                             + (f" (its compile: {c.warm:.1f} s)" if phase.key == "compile" and c.value
                                and c.warm is not None else "")
                             + (f" ({c.note})" if c.note else "") for c in phase.candidates)
            out.append(f"  {phase.key}: {each} -> {_name(phase.key, phase.chosen)}"
                       + (f" ({phase.note})" if phase.note else ""))
        return out


def _splits_well(phase: Phase, c: _Candidate, best: float) -> bool:
    """A step of ``BIG_STEP_S`` or more on more threads, which fewer ran no faster even at its warm-up, splits well:
    no more of it is timed (as threads.choose_threads decides before a run). Quiet, the CIFAR-10 hybrid's 1 s step
    took ~1.8 s on one of two AVX2 EPYC cores, and its two more timed steps were ~1.7 s of a 5-minute run's ~6 s
    tuning excess; beside a busy process one thread's steps are the faster ones, and they are timed."""
    faster = [o.value for o in phase.candidates if o.samples and o.alive and min(o.samples) == best]
    return phase.key == "threads" and best >= BIG_STEP_S and c.warm >= best and bool(faster) \
        and c.value < faster[0]


def _clearly_faster(a: list[float], b: list[float]) -> bool:
    """Whether steps ``a`` are clearly faster than steps ``b``: by more than TIE at their pace, and every one of the
    steps that pace reads faster than every one of ``b``'s (beside a busy process a step's time varies by more than
    3%: two 5-minute CIFAR-10 runs still chose different layouts at TIE alone)."""
    return TIE * _pace(a) < _pace(b) and max(_paced(a)) < min(_paced(b))


def _paced(samples: list[float]) -> list[float]:
    """The timed steps a pace reads: the first left out where there are three (it may still be warming up)."""
    return samples[1:] if len(samples) >= 3 else samples


def _pace(samples: list[float]) -> float:
    """A candidate's seconds a step: the median of its timed steps, the first left out where there are three (it
    may still be warming up)."""
    return statistics.median(_paced(samples))


def _load_moved(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) > LOAD_SHIFT


def _moved_note(a: float | None, b: float | None) -> str:
    return (f"other processes' load moved between its first steps ({min(a, b):.1f} to {max(a, b):.1f} cores): "
            "none cut on them")


def _load_at_best(phase: Phase) -> float | None:
    """Others' load during the fastest timed step of the phase."""
    timed = [(s, load) for c in phase.candidates if c.alive for s, load in zip(c.samples, c.loads)]
    return min(timed, key=lambda t: t[0])[1] if timed else None


def _best_timed(phase: Phase) -> float | None:
    timed = [min(c.samples) for c in phase.candidates if c.samples and c.alive]
    return min(timed) if timed else None


def _name(key: str, value: Any) -> str:
    if key == "channels_last":
        return "channels_last" if value else "no-channels_last"
    if key == "compile":
        return "compiled" if value else "eager"
    return str(value)
