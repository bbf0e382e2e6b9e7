"""How many CPU threads a run uses: measured, not defaulted.

PyTorch starts with one intra-op thread per core. For a model whose step takes a few milliseconds a second thread
buys almost nothing (the work per matmul is too small to split), and on a machine that is doing something else it
costs a great deal: OpenMP threads wait for each other at every operator, so a thread sharing its core with another
process holds all of them back (the default `vitkit train` on 2 AMD EPYC AVX512-BF16 cores, one kept busy by another
process: 115-124 s with 2 threads, 43-44 s with 1; 38-45 s on the quiet machine; results/threads-contention.csv).
So the candidates are timed round-robin on the run's own step, and the fewest threads within 10% of the fastest win.
``--threads N`` (or ``OMP_NUM_THREADS``) decides instead.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch

TIE = 1.10  # more threads must be this much faster to be chosen: a near tie goes to the one that shares better
BIG_STEP_S = 1.0  # a warm step this long on all cores is big: one step on one thread decides (not a full timing)
HUGE_STEP_S = 4.0  # ... and one this long splits well for certain: all cores, nothing more timed
TIMING_STEPS = 9  # what timing the counts costs, in steps on all cores (two warm-ups and two rounds on 2 cores)
MIN_LOAD_WINDOW_S = 0.3  # OtherLoad judges no shorter block: /proc/stat counts in 10 ms ticks per core


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cores_text() -> str:
    """``"2 cores"``, or ``"1 core of 2"`` when the process may use fewer than the machine has (taskset)."""
    n, total = usable_cores(), os.cpu_count() or usable_cores()
    return f"{n} core" + ("s" if n != 1 else "") + ("" if n == total else f" of {total}")


def candidates(cores: int) -> list[int]:
    """1, half the cores and all of them (without repeats)."""
    return sorted({1, max(1, cores // 2), cores})


def time_threads(step: Callable[[], object], counts: list[int], budget_s: float = 2.0,
                 rounds: int = 5) -> dict[int, float]:
    """The fastest seconds of ``step`` under each thread count, timed round-robin (so drift falls on all alike).
    Stops after ``rounds`` rounds or ``budget_s`` seconds, whichever comes first (at least two timed rounds).

    The fastest, not the median: a step of ~1 s gets two rounds in the budget, and the median of two is their mean,
    so one round that a passing hiccup slowed decides. On a 2-core Xeon with AMX a fine-tuning step timed 911 ms on
    one thread and 994 ms on two (so one was chosen), and then trained at 501 ms a step where the same model's run
    on two threads took 320 ms. Another process's load, which is what fewer threads are for, slows every round
    of the contended count, so its fastest round still shows it."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:  # warm-up: oneDNN's first call at a new thread count builds its primitives
        torch.set_num_threads(n)
        step()
    start = time.perf_counter()
    for r in range(rounds):
        for n in counts:
            torch.set_num_threads(n)
            t = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - t)
        if r >= 1 and time.perf_counter() - start > budget_s:
            break
    return {n: min(ts) for n, ts in times.items()}


def timed(step: Callable[[], object]) -> float:
    """Seconds one call of ``step`` takes."""
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def pick(fastest: dict[int, float]) -> int:
    """The fewest threads within ``TIE`` of the fastest."""
    best = min(fastest.values())
    return min(n for n, t in fastest.items() if t <= best * TIE)


def choose_threads(step: Callable[[], object], requested: int | None = None, what: str = "step",
                   device: torch.device | None = None, max_seconds: float = float("inf")) -> tuple[int, str]:
    """Set and return the intra-op thread count for a workload whose unit of work is ``step``, and a sentence
    saying how it was chosen (for the run log). ``requested`` (``--threads``) is taken as given. Timing the counts
    costs about ``TIMING_STEPS`` steps on all cores; where that is more than ``max_seconds`` (a share of a short
    time budget), all cores are used untimed."""
    cores = usable_cores()
    if device is not None and device.type != "cpu":
        return torch.get_num_threads(), f"threads: {torch.get_num_threads()} (the model runs on {device})"
    if requested is not None and requested > cores:
        torch.set_num_threads(cores)
        return cores, (f"threads: {cores} of {cores} cores (--threads {requested} is more than the cores this process "
                       "may use: OpenMP threads beyond them wait for each other at every operator)")
    if requested is not None:
        torch.set_num_threads(requested)
        return requested, f"threads: {requested} of {cores} cores (--threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        return n, f"threads: {n} of {cores} cores (OMP_NUM_THREADS)"
    counts = candidates(cores)
    if len(counts) == 1:
        torch.set_num_threads(1)
        return 1, "threads: 1 (one core)"
    torch.set_num_threads(cores)
    step()  # cold: the first call builds oneDNN's primitives and the allocator's pools
    t_all = timed(step)
    if TIMING_STEPS * t_all > max_seconds:
        return cores, (f"threads: all {cores} cores, not timed (a {what} takes {t_all:.2f} s on {cores} threads: "
                       f"timing fewer would take ~{TIMING_STEPS * t_all:.0f} s of a short budget)")
    if t_all > HUGE_STEP_S:
        return cores, f"threads: all {cores} cores (a {what} takes {t_all:.1f} s on {cores} threads: it splits well)"
    if t_all > BIG_STEP_S:
        # a big step usually splits well, but one slowed down by another process's threads (two OpenMP teams on the
        # same cores spin-wait for each other) is fast again on one thread: one such step tells the two apart
        torch.set_num_threads(1)
        t_one = timed(step)
        if t_one >= t_all:
            torch.set_num_threads(cores)
            return cores, (f"threads: all {cores} cores (a {what} takes {t_all:.1f} s on {cores} threads, "
                           f"{t_one:.1f} s on one: it splits well)")
    fastest = time_threads(step, counts)
    n = pick(fastest)
    torch.set_num_threads(n)
    each = ", ".join(f"{k} thread{'s' if k > 1 else ''} {v * 1e3:.1f} ms" for k, v in fastest.items())
    return n, f"threads: {n} of {cores} cores (measured per {what}: {each}; --threads N to set)"


def threads_for_ranks(local_world: int) -> int:
    """Each of ``local_world`` processes on this machine gets its share of the cores (at least one)."""
    return max(1, usable_cores() // max(local_world, 1))


class OtherLoad:
    """How busy other processes kept this process's cores while a block ran, from /proc/stat's per-CPU counters
    (steal time included: a hypervisor's other guests) less this process's own CPU time. ``cores`` is how many
    cores' worth, on average, others used; None where /proc/stat cannot be read (not Linux)."""

    def __init__(self) -> None:
        self.cores: float | None = None

    def __enter__(self) -> "OtherLoad":
        self._start = (_busy_seconds(), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        busy0, own0, t0 = self._start
        busy1, wall = _busy_seconds(), time.perf_counter() - t0
        if busy0 is not None and busy1 is not None and wall >= MIN_LOAD_WINDOW_S:  # counters tick every 10 ms
            self.cores = max(0.0, (busy1 - busy0) - (_own_seconds() - own0)) / wall

    def contended(self, threads: int) -> bool:
        """Whether others took cores this process's ``threads`` needed: more than the cores left over for them,
        by half a core (the measurement's own noise, a shell, the kernel's work)."""
        return self.cores is not None and self.cores > max(0, usable_cores() - threads) + 0.5


def _busy_seconds() -> float | None:
    """Seconds the usable cores spent on anything but idling (user, system, irq, softirq, steal), and on niced
    processes (``nice -n 19``) only where this process is niced too: at its own priority they yield it the cores,
    and a nice-19 PyTorch job counted as load made a 5-minute CIFAR-10 run plan on one thread (issue 79)."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        lines = Path("/proc/stat").read_text().splitlines()
    except (AttributeError, OSError):
        return None
    count_nice = _niceness() > 0
    ticks = 0
    for line in lines:
        name, *v = line.split()
        if name in cpus and len(v) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, v[:8])
            ticks += user + (nice if count_nice else 0) + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def _niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):  # not Unix
        return 0


def _own_seconds() -> float:
    """This process's CPU seconds, and its live children's (a DataLoader's workers decode for it: not others' load)."""
    t = os.times()  # (children_*: the ended ones, waited for)
    return t.user + t.system + t.children_user + t.children_system + _children_seconds()


def _children_seconds() -> float:
    try:
        pids = {p for task in Path("/proc/self/task").iterdir()
                for p in (task / "children").read_text().split()}
    except OSError:  # not Linux, or a kernel without the children file
        return 0.0
    ticks = 0
    for pid in pids:
        try:  # utime and stime: the 14th and 15th fields, counted after the command's closing parenthesis
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):  # (it ended meanwhile)
            continue
    return ticks / os.sysconf("SC_CLK_TCK")
