"""Calibration: the fast way to run a workload *here*, found by timing it, not by reading CPU flags.

A CPU's flags say what it can decode, not what is fast: bf16 was 3x faster than fp32 on one 2-core AMD EPYC with
AVX512-BF16, half as fast on an Intel Xeon with the same flag and no AMX, and emulated (5x slower) on an AVX-512
Xeon without it (docs: Speed). So every ``auto`` (training precision, attention path, memory format, compile, the
inference dtype) is decided by timing the candidates on the run's own workload, round-robin after a warm-up, and a
candidate that is clearly slower is dropped after one timed call (emulated bf16 is never timed for minutes).

Results are cached per machine fingerprint (CPU model name and flags, usable cores, torch version, device) and
workload (model shape, batch, ...), in ``$VITKIT_CACHE_DIR`` or ``~/.cache/vitkit``: a second run pays nothing.
``vitkit calibrate`` prints the table and refreshes the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.serialization import atomic_write
from .cpu import cpuinfo
from .threads import OtherLoad, usable_cores

CUT = 1.5  # a candidate this much slower than the best after one timed call is dropped
ROUNDS = 4  # timed calls per candidate at most (round-robin)
BUDGET_S = 2.5  # ...or fewer, once this many seconds of timed calls have passed (two rounds at least)
# ... or more, up to MAX_ROUNDS, while the timed calls have taken less than SHORT_TIMED_S in all: an H200's CIFAR-10
# step of 9 ms gave 4 calls, 36 ms of samples, inside one launch's jitter (issue 80, P14); a second of samples is
# still a fraction of the warm-up calls' cost
MAX_ROUNDS, SHORT_TIMED_S = 16, 0.5
CACHE_VERSION = 1
TIMING_KEYS = {"settings", "seconds", "calls", "note"}


class NothingRuns(ValueError):
    """No candidate of a calibration could run here (each one's reason in the message)."""


@dataclass
class Timing:
    """One candidate: its settings, the median seconds of its timed calls (None: not timed), and what happened."""

    settings: dict[str, Any]
    seconds: float | None = None
    calls: int = 0
    note: str = ""

    @property
    def name(self) -> str:
        return " ".join(str(v) if not isinstance(v, bool) else (k if v else f"no-{k}")
                        for k, v in self.settings.items())


@dataclass
class Calibration:
    """The timings of one workload's candidates and the fastest of them."""

    what: str
    timings: list[Timing]
    cached: bool = False
    seconds_spent: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. a compile time
    chosen: dict[str, Any] | None = None  # a later stage's winner (see ``then``); else the fastest timing

    @property
    def best(self) -> Timing:
        if self.chosen is not None:
            return next(t for t in self.timings if t.settings == self.chosen)
        timed = [t for t in self.timings if t.seconds is not None]
        if not timed:
            raise NothingRuns(f"calibration of {self.what}: no candidate could run here ("
                              + "; ".join(f"{t.name}: {t.note or 'not timed'}" for t in self.timings) + ")")
        return min(timed, key=lambda t: t.seconds)  # type: ignore[arg-type, return-value]

    def then(self, later: "Calibration") -> "Calibration":
        """This calibration followed by ``later``, which timed variants of this one's best: every timing of both,
        the choice ``later``'s (timings from separate stages are not compared with each other)."""
        return Calibration(self.what, self.timings + later.timings, self.cached and later.cached,
                           self.seconds_spent + later.seconds_spent, {**self.extra, **later.extra},
                           later.best.settings)

    def seconds_of(self, **settings: Any) -> float | None:
        return next((t.seconds for t in self.timings if t.settings == settings), None)

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "timings": [asdict(t) for t in self.timings], "extra": self.extra,
                "seconds_spent": round(self.seconds_spent, 3), "chosen": self.chosen}

    @classmethod
    def from_dict(cls, d: dict[str, Any], cached: bool = True) -> "Calibration":
        """A calibration from its stored form, checked like any input file: a ValueError naming what is wrong (a
        cache edited by hand or by another version once gave ZeroDivisionError, TypeError or StopIteration)."""
        if not isinstance(d, dict) or not isinstance(d.get("what"), str) or not isinstance(d.get("timings"), list):
            raise ValueError("not a calibration: expected 'what' (text) and 'timings' (a list)")
        timings = []
        for t in d["timings"]:
            if not isinstance(t, dict) or not isinstance(t.get("settings"), dict) or set(t) - TIMING_KEYS:
                raise ValueError(f"a timing is not {{settings, seconds, calls, note}}: {str(t)[:80]}")
            s, calls = t.get("seconds"), t.get("calls", 0)
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < 1e6):
                raise ValueError(f"timing {t['settings']}: seconds {s!r} is not a positive number")
            if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0 or not isinstance(
                    t.get("note", ""), str):
                raise ValueError(f"timing {t['settings']}: calls {calls!r} / note {t.get('note')!r} malformed")
            timings.append(Timing(**t))
        chosen, extra = d.get("chosen"), d.get("extra", {})
        if chosen is not None and chosen not in [t.settings for t in timings]:
            raise ValueError(f"chosen {chosen!r} is none of the timed candidates")
        if not isinstance(extra, dict):
            raise ValueError(f"extra {extra!r} is not a mapping")
        cal = cls(d["what"], timings, cached, float(d.get("seconds_spent", 0.0) or 0.0), extra, chosen)
        cal.best  # noqa: B018 - raises where no candidate was timed
        return cal

    @property
    def heading(self) -> str:
        """`` training step (...) (cached):``, saying why it was not cached where others held the cores."""
        busy = self.extra.get("other_load_cores")
        why = (f" (other processes kept {busy:.1f} cores busy meanwhile: these timings are this run's only, not "
               "cached)" if busy is not None else "")
        return f" {self.what}{' (cached)' if self.cached else ''}{why}:"

    def table(self) -> str:
        """The candidates, fastest first: ``  bf16 sdpa      41.2 ms  1.00x  <- chosen``."""
        best = self.best
        rows = self.timings if self.chosen is not None else \
            sorted(self.timings, key=lambda t: (t.seconds is None, t.seconds or 0.0))
        width = max(len(t.name) for t in rows)
        lines = []
        for t in rows:
            if t.seconds is None:
                lines.append(f"  {t.name:<{width}}  {'-':>9}         {t.note}")
                continue
            mark = "  <- chosen" if t is best else ""
            lines.append(f"  {t.name:<{width}}  {t.seconds * 1e3:7.1f} ms  {t.seconds / best.seconds:4.2f}x"
                         f"{'  ' + t.note if t.note else ''}{mark}")
        return "\n".join(lines)


def time_candidates(what: str, candidates: list[dict[str, Any]], make: Callable[[dict[str, Any]], Callable[[], Any]],
                    rounds: int = ROUNDS, budget_s: float = BUDGET_S, cut: float = CUT,
                    clock: Callable[[], float] = time.perf_counter) -> Calibration:
    """Time ``make(settings)()`` for each candidate: one warm-up call each, then round-robin timed calls (so drift
    falls on all alike), ``rounds`` each or fewer once ``budget_s`` has passed, more (up to ``MAX_ROUNDS``) while
    they have taken less than ``SHORT_TIMED_S`` in all. After the first timed round, and
    already at warm-up when it is that far behind, a candidate ``cut`` times slower than the best is dropped.
    ``make`` may raise ValueError/RuntimeError for a candidate that cannot run here (noted, not timed)."""
    start = clock()
    timings = [Timing(dict(c)) for c in candidates]
    steps: dict[int, Callable[[], Any]] = {}
    warm: dict[int, float] = {}
    for i, t in enumerate(timings):
        try:
            steps[i] = make(t.settings)
            t0 = clock()
            steps[i]()
            warm[i] = clock() - t0
        except (RuntimeError, ValueError, NotImplementedError, MemoryError) as e:  # out of memory included
            steps.pop(i, None)
            t.note = f"cannot run here: {' '.join(str(e).split())[:80]}"
            continue
        fastest_warm = min(warm.values())
        if warm[i] > 4 * cut * fastest_warm and warm[i] > 0.5:  # e.g. emulated bf16: not worth a timed call
            steps.pop(i)
            t.note = f"cut at warm-up ({warm[i]:.2f} s vs {fastest_warm:.2f} s)"
    samples: dict[int, list[float]] = {i: [] for i in steps}
    t_timed = clock()
    with OtherLoad() as load:
        first_shared = False
        for r in range(max(rounds, MAX_ROUNDS) if steps else 0):
            with OtherLoad() as during:
                _timed_round(steps, samples, clock, reverse=r % 2 == 1)
            # a first round that another process shared is neither cut on nor counted: the load may have come or gone
            # between its candidates (one left mid-round while a 30-minute FixMatch run planned, and its last
            # candidate, fp32, was timed alone at 1.9 s against 5-8 s for the others, bf16 among them: each cut after
            # that one call, and the run trained at half bf16's pace); the second round, in the reverse order, decides
            if r == 0 and during.contended(torch.get_num_threads()):
                first_shared = True
                continue
            if first_shared and r == 1:
                for s in samples.values():
                    del s[0]
            _cut_slower(steps, samples, timings, cut)
            timed = clock() - t_timed
            if (r >= 1 and timed > budget_s) or (r + 1 >= rounds and timed >= SHORT_TIMED_S):
                break
    for i, s in samples.items():
        timings[i].seconds, timings[i].calls = statistics.median(s), len(s)
    cal = Calibration(what, timings, seconds_spent=clock() - start)
    if load.contended(torch.get_num_threads()):
        cal.extra["other_load_cores"] = round(load.cores, 2)  # type: ignore[arg-type]
    return cal


def _timed_round(steps: dict[int, Callable[[], Any]], samples: dict[int, list[float]], clock: Callable[[], float],
                 reverse: bool = False) -> None:
    """One timed call of every candidate still in ``steps`` (in the reverse order on ``reverse``: a drift falls on
    the first and the last alike)."""
    for i in (list(reversed(steps)) if reverse else list(steps)):
        t0 = clock()
        steps[i]()
        samples[i].append(clock() - t0)


def _cut_slower(steps: dict[int, Callable[[], Any]], samples: dict[int, list[float]], timings: list[Timing],
                cut: float) -> None:
    """The candidates ``cut`` times slower than the best (each at its fastest call) go."""
    best = min(min(samples[i]) for i in steps)
    for i in list(steps):
        if min(samples[i]) > cut * best:
            steps.pop(i)
            timings[i].note = f"cut after {len(samples[i])} call{'s' if len(samples[i]) > 1 else ''}"


# ------------------------------------------------------------------------------------------ the machine and cache
def fingerprint(device: torch.device) -> dict[str, Any]:
    """What a calibration depends on besides the workload: the CPU (model name, a digest of its flags, the cores this
    process may use), the torch version, and the accelerator's name when the device is one."""
    name, flags = cpuinfo()
    fp = {"cpu": name or platform.processor() or platform.machine(),
          "flags": hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:12], "cores": usable_cores(),
          "torch": torch.__version__, "device": device.type,
          "capability": torch.backends.cpu.get_cpu_capability()}  # changes under a cpuid mask (as_cpu_kind.sh)
    if device.type == "cuda":
        fp["gpu"] = torch.cuda.get_device_name(device)
    return fp


def cache_dir() -> Path:
    base = os.environ.get("VITKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vitkit")
    return Path(base)


def cache_file() -> Path:
    return cache_dir() / "calibration.json"


def cache_key(device: torch.device, workload: dict[str, Any]) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "machine": fingerprint(device), "workload": workload}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read_cache() -> dict[str, Any]:
    try:
        d = json.loads(cache_file().read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: calibrate again (the cache is only ever a shortcut)


def cached(device: torch.device, workload: dict[str, Any]) -> Calibration | None:
    """The stored calibration of ``workload``, or None: none, or one that does not check out (timed again)."""
    entry = _read_cache().get(cache_key(device, workload))
    try:
        return Calibration.from_dict(entry) if entry else None
    except (ValueError, KeyError, TypeError):  # NothingRuns is a ValueError
        return None


def cached_of_kind(device: torch.device, kind: str) -> list[Calibration]:
    """Every stored calibration of this machine and device whose workload is of ``kind`` (any model, any batch)."""
    me = json.dumps(fingerprint(device), sort_keys=True, default=str)
    out = []
    for entry in _read_cache().values():
        if not isinstance(entry, dict) or (entry.get("workload") or {}).get("kind") != kind:
            continue
        if json.dumps(entry.get("machine"), sort_keys=True, default=str) != me:
            continue
        try:
            out.append(Calibration.from_dict(entry))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def store(device: torch.device, workload: dict[str, Any], cal: Calibration) -> None:
    """Add ``cal`` to the cache (written to a temporary file, then renamed: a reader never sees half of it). A cache
    that cannot be written costs the next run a calibration, nothing else."""
    d = _read_cache()
    d[cache_key(device, workload)] = {**cal.to_dict(), "machine": fingerprint(device), "workload": workload,
                                      "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(d, indent=1, default=str)))  # Ctrl-C: no half
    except OSError:
        pass


def calibrate(what: str, device: torch.device, workload: dict[str, Any], candidates: list[dict[str, Any]],
              make: Callable[[dict[str, Any]], Callable[[], Any]], refresh: bool = False, **kw: Any) -> Calibration:
    """The cached calibration of ``workload`` on this machine, or a new one (``time_candidates``), stored."""
    if not refresh:
        hit = cached(device, {**workload, "candidates": candidates})
        if hit is not None:
            return hit
    cal = time_candidates(what, candidates, make, **kw)
    cal.best  # noqa: B018 - NothingRuns, naming each candidate's reason, where none could run; nothing is stored
    store_unless_loaded(device, {**workload, "candidates": candidates}, cal)
    return cal


def store_unless_loaded(device: torch.device, workload: dict[str, Any], cal: Calibration) -> None:
    """``store``, except timings taken while other processes held the cores: those are this run's alone, and the
    next run times again (unless VITKIT_CACHE_UNDER_LOAD=1: a test suite on two workers is always under load, and
    caches all the same). (The compile timing was stored under load, and the next run read it as "cached": a
    compiled step of 1.7 s against an eager one of 3.2 s, timed beside a test suite, where alone it takes 1.2 s.)"""
    if "other_load_cores" not in cal.extra or os.environ.get("VITKIT_CACHE_UNDER_LOAD") == "1":
        store(device, workload, cal)
