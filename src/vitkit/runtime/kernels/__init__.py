"""vitkit's one hand-written kernel: multi-head attention for bf16 inference on CPUs with AMX (cpu_attention.cpp).

It is built from source on first use with torch.utils.cpp_extension (a C++ compiler and ninja; ~21 s once per
machine, then loaded from torch's extension cache in ~0.05 s) and registered as the operator
``torch.ops.vitkit.vit_attention``, which torch.compile treats as one opaque call. Where it cannot be built or the
CPU lacks AMX, ``load()`` returns False and the model keeps PyTorch's fused attention. ``VITKIT_CPU_KERNELS=0``
turns it off.

A hand-written kernel can take the process down (it crashed on a 16-core AMX host it had never run on). So before
the first use on a machine it must prove itself in a child process: every shape class it takes (odd and single
tokens, every head size class, fewer and more heads than threads, strided inputs) at 1, 2, an odd number and all
of the usable threads, against exact fp32 attention. A crash or a wrong answer there refuses it, with a warning
naming what happened; the verdict is kept per build and torch version in vitkit's cache folder.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..calibrate import cache_dir
from ..compile import has_cxx_compiler
from ..threads import usable_cores

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpu_flags() -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    try:
        return next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_supported() -> bool:
    """Linux on an x86 CPU with AVX-512 BF16 and AMX (read from /proc/cpuinfo)."""
    flags = _cpu_flags()
    return all(f in flags for f in _CPU_FLAGS)


def _build_name() -> str:
    """The extension's name in torch's cache, one per CPU feature set: it is built with -march=native, so a cache
    shared between machines never hands one CPU another's build."""
    return "vitkit_cpu_attention_" + hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:10]


@functools.cache
def load(verbose: bool = False) -> bool:
    """Build (once) and load the kernel; True when ``torch.ops.vitkit.vit_attention`` is ready to use (built, and
    proven on this machine: ``proven()``)."""
    if os.environ.get("VITKIT_CPU_KERNELS", "1") == "0" or not cpu_supported():
        return False
    if not _build(verbose):
        return False
    init_amx = getattr(torch._C._cpu, "_init_amx", None)  # Linux: ask the kernel for AMX's tile state
    if init_amx is not None and not init_amx():
        return False
    if os.environ.get(_PROVING) != "1" and not proven():
        return False

    @torch.library.register_fake("vitkit::vit_attention")
    def _(qkv: torch.Tensor, scale: float) -> torch.Tensor:
        B, T, _, H, D = qkv.shape
        return qkv.new_empty(B, T, H, D)

    return True


def _build(verbose: bool) -> bool:
    from torch.utils import cpp_extension  # only here: its import warns "No CUDA runtime" on CPU-only machines

    if not (has_cxx_compiler() and cpp_extension.is_ninja_available()):
        return False
    try:
        cpp_extension.load(
            name=_build_name(), sources=[str(SOURCE)], is_python_module=False, verbose=verbose,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
            extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - a failed build must not stop inference: PyTorch's attention is used
        warnings.warn(f"vitkit: could not build the CPU attention kernel {SOURCE} ({type(e).__name__}: {e}); "
                      "using PyTorch's attention", stacklevel=3)
        return False
    return True


_PROVING = "VITKIT_KERNEL_PROVING"  # set in the child process that runs the proof
# (B, T, H, D): single and odd token counts, T under and over one 32-query block and one 16-key vector, head sizes
# of 16, 32, 64 and 80 (q copied when D is not a multiple of 32), more images x heads than threads and fewer
PROOF_SHAPES = [(1, 1, 1, 16), (1, 5, 2, 16), (2, 9, 2, 32), (3, 50, 4, 32), (2, 65, 2, 80), (2, 197, 3, 64),
                (1, 577, 2, 64), (4, 33, 12, 64)]


def proof_thread_counts() -> list[int]:
    """1, 2, an odd count and every usable core (the crash came at 16 threads on a machine tested only with 2)."""
    n = usable_cores()
    return sorted({1, 2, 3, n, n - 1 if n > 2 and n % 2 == 0 else n})


def run_proof(attention: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> None:
    """The proof itself (in the child): raise, or crash, on any failure of ``attention`` (the kernel)."""
    attention = attention or torch.ops.vitkit.vit_attention
    gen = torch.Generator().manual_seed(0)
    for threads in proof_thread_counts():
        torch.set_num_threads(threads)
        for B, T, H, D in PROOF_SHAPES:
            for strided in (False, True):
                x = torch.randn(B, 3, T, H, D, generator=gen) * 2
                qkv = (x.transpose(1, 2) if strided else x.transpose(1, 2).contiguous()).bfloat16()
                q, k, v = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)
                ref = (torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1) @ v).transpose(1, 2)
                out = attention(qkv, D ** -0.5).float()
                err = (out - ref).abs().max().item()
                if not err < 0.05 * max(1.0, ref.abs().max().item()):
                    raise AssertionError(f"{threads} threads, (B, T, H, D) = {(B, T, H, D)}, strided {strided}: "
                                         f"max error {err:.3g}")


def _verdict_file() -> Path:
    return cache_dir() / f"kernel-{_build_name()}-torch{torch.__version__}.json"


def proven(code: str = "from vitkit.runtime.kernels import load, run_proof; assert load(); run_proof()") -> bool:
    """Whether the kernel passed its proof on this machine (run once in a child process, then remembered)."""
    f = _verdict_file()
    try:
        return bool(json.loads(f.read_text())["ok"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, _PROVING: "1"}, capture_output=True,
                           text=True, timeout=600)
        ok, why = r.returncode == 0, _why(r.returncode, r.stderr)
    except subprocess.TimeoutExpired:
        ok, why = False, "it did not finish in 600 s"
    if not ok:
        warnings.warn(f"vitkit: the CPU attention kernel failed its proof on this machine ({why}); PyTorch's "
                      f"attention is used. The verdict is kept in {f} (delete it to try again)", stacklevel=3)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"ok": ok, "why": why, "threads": proof_thread_counts(), "shapes": PROOF_SHAPES}))
    except OSError:
        pass  # proven again next time
    return ok


def _why(rc: int, stderr: str) -> str:
    if rc < 0:
        try:
            return f"the process died of {signal.Signals(-rc).name}"
        except ValueError:
            return f"the process died of signal {-rc}"
    if rc == 0:
        return "passed"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"exit {rc}: {last[:300]}"


def takes_head_size(head_size: int) -> bool:
    """The head sizes the kernel works on: multiples of 16 (cpu_attention.cpp refuses any other)."""
    return head_size % 16 == 0


def vit_attention(qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, from the qkv linear's output (B, T, 3, H, D) bf16 to (B, T, H, D)."""
    return torch.ops.vitkit.vit_attention(qkv, scale)
