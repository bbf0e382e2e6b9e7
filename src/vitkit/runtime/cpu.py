"""What kind of CPU this is, in the words the results tables use: vendor and the widest vector/matrix units
(AVX2, AVX-512, AVX512-BF16, AMX). Speeds differ several-fold between kinds, so every measurement names it."""
from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import torch

from .threads import cores_text


@functools.cache
def cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; ("", empty) where there is none (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "", frozenset()
    name, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if name and flags:
            break
    return name, flags


# the widest units first: (flag, as the tables write it, as a column key)
UNITS = (("amx_bf16", "AMX", "amx"), ("avx512_bf16", "AVX512-BF16", "avx512bf16"), ("avx512f", "AVX-512", "avx512"),
         ("avx2", "AVX2", "avx2"))


def _units(flags: frozenset[str]) -> list[str]:
    return [u for f, u, _ in UNITS[:2] if f in flags] or [next((u for f, u, _ in UNITS[2:] if f in flags), "no AVX2")]


def _hidden() -> frozenset[str]:
    """Flags /proc/cpuinfo lists but PyTorch's own cpuid check (what the kernels dispatch on) does not see."""
    cpu = torch.cpu
    checks = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported",
              "avx512f": "_is_avx512_supported", "avx2": "_is_avx2_supported"}
    return frozenset(f for f, check in checks.items() if not getattr(cpu, check, lambda: True)())


@functools.cache
def cpu_kind() -> str:
    """e.g. ``"AMD EPYC, AVX2"``, ``"Intel Xeon, AVX-512"``, ``"Intel Xeon, AMX + AVX512-BF16"``: what the CPU
    reports, which names it in tables; never what is fast on it (runtime/calibrate.py times that)."""
    name, flags = cpuinfo()
    vendor = " ".join(name.replace("(R)", "").replace("(TM)", "").split()[:2]) or platform.processor() \
        or platform.machine()
    if flags:
        units = _units(flags)
        seen = _units(flags - _hidden())
        if seen != units:  # run as a smaller CPU (a cpuid mask, benchmarks/as_cpu_kind.sh): say both
            units = [f"{' + '.join(seen)} (emulated: a cpuid mask on a {' + '.join(units)} CPU)"]
    else:  # no /proc/cpuinfo: PyTorch's own dispatch level says as much
        units = [torch.backends.cpu.get_cpu_capability()]
    return f"{vendor}, {' + '.join(units)}"


def reports_bf16_unit() -> bool:
    """Whether the CPU reports a bf16 unit (AVX512-BF16 or AMX) to PyTorch's own cpuid check. It orders the
    candidates the planner times (bf16 first), and decides nothing: the flag is on CPUs where bf16 is half as fast
    as fp32 too."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


BF16_SLOW = 1.5  # bf16 matmuls this many times an fp32 one's: bf16 is not a candidate on this CPU (see below)


@functools.cache
def bf16_matmul_slowdown(n: int = 256) -> float:
    """How many times an fp32 matmul's time a bf16 one takes on this CPU (n x n by n x n; each warmed once, then
    the least of three, round-robin, so that a neighbour's load falls on both alike). A timing, not a flag: on a
    2-core AMD EPYC with AVX2 only, bf16 is emulated at ~128x fp32 (1024: 2.7 s against 21 ms), and one bf16
    training step of the CIFAR-10 hybrid, its warm-up, cost 20.3 s against fp32's 1.57 s before it could be cut;
    this costs ~0.1 s there."""
    a = {dt: torch.randn(n, n).to(dt) for dt in (torch.float32, torch.bfloat16)}
    best = {dt: float("inf") for dt in a}
    for rep in range(4):
        for dt, m in a.items():
            started = time.perf_counter()
            m @ m
            if rep:  # (the first of each builds its kernel)
                best[dt] = min(best[dt], time.perf_counter() - started)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


@functools.cache
def fp32_matmul_flops(n: int = 1024) -> float:
    """This CPU's fp32 matmul rate in FLOP/s (n x n by n x n, the least of three after a warm one: ~0.2 s in all on
    a 2-core AVX2 EPYC, 49 GFLOP/s there; 2.2 at n=256, 28 at 512, 60 at 2048). A ViT step's matmuls at this rate
    foresee its time before a step is run."""
    a = torch.randn(n, n)
    a @ a
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - started)
    return 2 * n ** 3 / max(best, 1e-9)


def cpu_precisions() -> tuple[list[str], str]:
    """The precisions worth timing on this CPU, the first timed first, and a note where bf16 is left out: its
    matmuls are ``BF16_SLOW`` or more times fp32's, so no step of it can win, and its first step alone could cost
    many of fp32's. Where the CPU reports a bf16 unit, bf16 is timed first; the flag decides nothing (CPUs with it
    where bf16 is half as fast as fp32 exist)."""
    slow = bf16_matmul_slowdown()
    if slow >= BF16_SLOW:
        return ["fp32"], (f"precision: bf16 not timed (its matmuls take {slow:.1f}x fp32's on this CPU"
                          f"{', emulated' if slow >= 4 else ''}; --precision bf16 to use it anyway)")
    return (["bf16", "fp32"] if reports_bf16_unit() else ["fp32", "bf16"]), ""


def machine_name(device: torch.device) -> str:
    """The machine a measurement was taken on: the CPU kind and cores, or the GPU's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_kind()} ({cores_text()})"


def cpu_kind_short() -> str:
    """A column-friendly form: ``amd-avx2``, ``intel-avx512``, ``intel-amx``, ``amd-avx512bf16``."""
    name, flags = cpuinfo()
    flags -= _hidden()  # the kind as run (benchmarks/as_cpu_kind.sh)
    vendor = "amd" if "AMD" in name else "intel" if "Intel" in name else platform.machine().lower()
    unit = next((key for f, _, key in UNITS if f in flags), torch.backends.cpu.get_cpu_capability().lower())
    return f"{vendor}-{unit}"
