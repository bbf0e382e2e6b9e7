"""How much memory this process may still use, and how much a piece of work needs.

A container's limit is its cgroup's, not the host's free memory: a process under a 1.5 GiB limit on a 24 GiB host is
killed (exit 137, no message) long before ``MemAvailable`` runs out. So the smaller of the two is what a plan may
count on: cgroup v2 (``memory.max`` - ``memory.current``) or v1 (``memory.limit_in_bytes`` - ``memory.usage_in_bytes``)
of the cgroup this process is in, less the page cache the kernel would drop before killing anything (the inactive
files of ``memory.stat``: the images a run has read are charged to its group), and ``MemAvailable`` from
/proc/meminfo.

``peak_bytes`` measures what a function allocates at most: on the CPU from PyTorch's allocator (the resident set
counts memory glibc keeps after a free, and is not linear in the batch: 141 MiB for a step at batch 8 and 120 at
batch 16 in one process), on a GPU from the caching allocator's peak.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

UNLIMITED = 1 << 60  # cgroup v1 writes a huge number (9223372036854771712) for "no limit"


@dataclass
class Memory:
    available: int  # bytes this process may still allocate
    limit: int | None  # the cgroup's limit, when there is one
    source: str  # what the number is: "cgroup v2 limit", "cgroup v1 limit" or "host MemAvailable"

    def describe(self) -> str:
        if self.limit is None:
            return f"{self.available / 2**30:.1f} GiB available ({self.source})"
        return f"{self.available / 2**30:.1f} GiB left of a {self.limit / 2**30:.1f} GiB {self.source}"


def available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Memory | None:
    """The memory this process may still use (the smaller of its cgroup's room and the host's MemAvailable), or
    None where neither can be read (not Linux)."""
    host = _meminfo_available(proc)
    group = _cgroup_room(proc, cgroup_root)
    if group is not None and (host is None or group[0] < host):
        return Memory(group[0], group[1], group[2])
    return Memory(host, None, "host MemAvailable") if host is not None else None


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(proc: Path, root: Path) -> tuple[int, int, str] | None:
    """(room, limit, which) of the memory cgroup this process is in, or None without a limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/path" (v2) or "N:memory:/path" (v1)
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if controllers == "" and (root / rel / "memory.max").is_file():
            found = _read_pair(root / rel / "memory.max", root / rel / "memory.current", "cgroup v2 limit")
        elif "memory" in controllers.split(","):
            base = root / "memory" / rel if (root / "memory").is_dir() else root / rel
            found = _read_pair(base / "memory.limit_in_bytes", base / "memory.usage_in_bytes", "cgroup v1 limit")
        else:
            continue
        if found is not None:
            return found
    return None


def _read_pair(limit_file: Path, usage_file: Path, which: str) -> tuple[int, int, str] | None:
    try:
        text = limit_file.read_text().strip()
        if text == "max":
            return None
        limit, usage = int(text), int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if limit >= UNLIMITED:
        return None
    return max(0, limit - usage + _reclaimable(limit_file.parent / "memory.stat")), limit, which


def _reclaimable(stat: Path) -> int:
    """The group's inactive page cache (files read once, such as a dataset's images), which the kernel drops before
    it kills a process of the group: ``total_inactive_file`` (v1) or ``inactive_file`` (v2); 0 where unreadable."""
    try:
        fields = dict(line.split() for line in stat.read_text().splitlines() if line.count(" ") == 1)
        return int(fields.get("total_inactive_file", fields.get("inactive_file", 0)))
    except (OSError, ValueError):
        return 0


def release_free_memory() -> None:
    """Hand the heap memory freed since (a planner's timed steps, a measurement) back to the kernel: glibc keeps it
    for reuse, and a container counts what it keeps. After the planner's steps at batch 64 the resident set stayed
    445 MiB higher; the run's own steps, of other sizes, did not fit in it and a 1.5 GiB container was killed.
    Nothing happens where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The C++ profiler's start and stop lines (and a CUDA build's "gpuGetDeviceCount failed" on a machine without
    a GPU) go to file descriptor 2, whatever Python's sys.stderr is: they are noise in a run's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(fn: Callable[[], Any], device: Any) -> int:
    """The most memory ``fn()`` holds at once beyond what was allocated before it, in bytes: on a GPU the caching
    allocator's peak; on the CPU the running total of the allocations (and frees) PyTorch's CPU allocator reports
    to the profiler while ``fn`` runs (tensors, autograd's saved activations, optimizer state, kernels' buffers;
    not Python objects)."""
    import torch  # (imported where memory is measured: `vitkit --help` reads none of this)

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile  # (the same)

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if isinstance(e.extra_fields, torch._C._profiler._ExtraFields_Allocation):
            sizes.append((e.start_time_ns, e.extra_fields.alloc_size))
    now = peak = 0
    for _, size in sorted(sizes):
        now += size
        peak = max(peak, now)
    return peak
