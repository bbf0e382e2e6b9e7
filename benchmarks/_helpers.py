"""Helpers that only the benchmark scripts in this folder use (``vitkit bench`` does not need them)."""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from typing import Any

import torch

from vitkit.model.config import ViTConfig
from vitkit.model.registry import get_config
from vitkit.runtime.cpu import cpu_kind
from vitkit.runtime.threads import cores_text, usable_cores
from vitkit.training.config import read_recipe

def recipe_vit_config(dataset: str, **overrides: Any) -> ViTConfig:
    """The ViT of the shipped recipe configs/<dataset>.yaml (its full-budget settings), with ``overrides`` (e.g. the
    dataset's ``in_chans`` and ``num_classes``, which the trainer takes from the data), for the benchmarks."""
    r = read_recipe(dataset)
    return get_config(r["model"], **{**r["model_args"], **overrides})


def fashion_mnist_vit_config(depth: int, hybrid: str) -> ViTConfig:
    """The Fashion-MNIST recipe's ViT (configs/fashion-mnist.yaml) at ``depth`` (3: the 5-minute model, 6: the
    30-minute one) with the stem ``hybrid`` (``"none"``: the plain patch-7 ViT, the issue's tutorial model), for the
    benchmarks (muon_step.py)."""
    return recipe_vit_config("fashion-mnist", in_chans=1, num_classes=10, depth=depth,
                             hybrid=None if hybrid == "none" else hybrid)


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # stand-ins for other CPU kinds
LIMITED = {"AVX2": "AVX2", "AVX512_CORE": "AVX-512 without bf16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE)"}


def isa_limits() -> list[str]:
    """The instruction-set limits set in the environment (``ONEDNN_MAX_CPU_ISA=AVX2`` ...), as ``KEY=value``."""
    return [f"{k}={os.environ[k]}" for k in ISA_LIMITS if k in os.environ]


def cpu_label() -> str:
    """This CPU's kind and cores (and threads, if fewer), and the instruction set it was limited to, if it was (for a
    results CSV)."""
    threads = torch.get_num_threads()
    fewer = "" if threads >= usable_cores() else f", {threads} thread{'s' if threads > 1 else ''}"
    label = f"{cpu_kind()} ({cores_text()}{fewer})"
    if not isa_limits():
        return label
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return f"{label}, emulated: limited to {LIMITED.get(isa, torch.backends.cpu.get_cpu_capability())}"


def csv_arg(path: str) -> str:
    """``--csv PATH`` checked before anything is timed (an argparse ``type``): its folder must exist, so minutes of
    measurement are not lost to a typo at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{path}: its folder {folder} does not exist")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a folder; expected a CSV file to append to")
    return path


def append_csv_rows(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path`` with this command (after the thread count and any instruction-set
    limits set in the environment, and benchmarks/as_cpu_kind.sh if it runs under it) as their ``command``; a file
    that exists keeps its own columns (e.g. a source)."""
    prefix = [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    if "VITKIT_AS_CPU" in os.environ:  # set by as_cpu_kind.sh, which makes cpuid answer as the smaller kind
        prefix += ["bash", "benchmarks/as_cpu_kind.sh", os.environ["VITKIT_AS_CPU"]]
    command = " ".join(prefix + isa_limits() + [shlex.join(["python", *sys.argv])])
    rows = [{**row, "command": command} for row in rows]
    new = not os.path.exists(path) or os.path.getsize(path) == 0  # (an empty file gets the header too)
    with open(path, "a+", newline="") as f:
        f.seek(0)
        fields = list(rows[0]) if new else next(csv.reader(f))
        missing = [k for k in rows[0] if k not in fields]
        if missing:  # an older file: say so, rather than csv's traceback
            raise SystemExit(f"{path}: its header has no column for {', '.join(missing)}, so the rows were not "
                             "appended; add the columns to its header, or give a new file to --csv")
        f.seek(0, os.SEEK_END)
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        if new:
            w.writeheader()
        w.writerows(rows)
