"""How much memory this process may still use: its container's limit where it has one, else the host's.

A container's limit is its cgroup's, not the host's free memory: a process under a 1.5 GiB limit on a 24 GiB host is
killed (exit 137, no message) long before ``MemAvailable`` runs out. So the smaller of the two is what a plan may
count on: cgroup v2 (``memory.max`` - ``memory.current``) or v1 (``memory.limit_in_bytes`` - ``memory.usage_in_bytes``)
of the cgroup this process is in, and ``MemAvailable`` from /proc/meminfo.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    return max(0, limit - usage), limit, which
