"""What kind of CPU this is, in the words the results tables use: vendor and the widest vector/matrix units
(AVX2, AVX-512, AVX512-BF16, AMX). Speeds differ several-fold between kinds, so every measurement names it."""
from __future__ import annotations

import functools
import platform
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
