"""Time to accuracy from a cold start, as docs/results.md reports it: ``vitkit train`` with a shipped
recipe in a fresh process (so Python's and torch's start-up count), with an empty Inductor cache (a new cache
folder for that process: the user's own cache is left alone), the wall time measured around the process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# name: the `vitkit train` arguments of a results row; the runs that read a folder take bench's --data-dir
RUNS: dict[str, list[str]] = {
    "digits": [],
    "fmnist5": ["--dataset", "fashion-mnist", "--time-limit", "5"],
    "fmnist30": ["--dataset", "fashion-mnist", "--time-limit", "30"],
    "cifar30": ["--dataset", "folder", "--time-limit", "30"],  # --data-dir: CIFAR-10 as an ImageFolder (or zip)
}
FINAL = re.compile(r"^final: val_top1=([\d.]+) epochs=(\d+) elapsed_s=([\d.]+)")


def train_args(name: str, data_dir: str | None = None) -> list[str]:
    if name not in RUNS:
        raise ValueError(f"time-to-accuracy run {name!r}: expected one of {', '.join(RUNS)}")
    args = list(RUNS[name])
    if data_dir and name != "digits":  # digits is embedded: no data folder
        if "--data-dir" in args:
            args[args.index("--data-dir") + 1] = data_dir
        else:
            args += ["--data-dir", data_dir]
    given = args[args.index("--data-dir") + 1] if "--data-dir" in args else None
    if "folder" in args and not given:
        raise ValueError(f"time-to-accuracy run {name}: give --data-dir (the image folder or zip it trains on)")
    if given and not Path(given).exists():
        raise FileNotFoundError(f"time-to-accuracy run {name}: {given} not found (give --data-dir)")
    return args


def time_to_accuracy(name: str, runs_dir: str = "runs", data_dir: str | None = None, keep_cache: bool = False,
                     echo: Callable[[str], None] = lambda line: print(line, end="", flush=True)) -> dict:
    """Runs one docs/results.md row's ``vitkit train`` command and returns its final accuracy, epochs, the run's own
    elapsed time and the wall time around the process. The run's output is passed to ``echo`` as it comes."""
    out = Path(runs_dir) / f"tta-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "vitkit", "train", *train_args(name, data_dir), "--output", str(out)]
    with tempfile.TemporaryDirectory(prefix="vitkit-tta-inductor-") as cache:
        env = dict(os.environ) if keep_cache else {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        start = time.perf_counter()
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                echo(line)
                lines.append(line)
        wall = time.perf_counter() - start
    final = [m for m in map(FINAL.match, lines) if m]
    if proc.returncode or not final:
        raise RuntimeError(f"time-to-accuracy run {name}: `{' '.join(cmd[1:])}` exited with {proc.returncode} "
                           f"and no final line; its last output:\n{''.join(lines[-5:])}")
    top1, epochs, elapsed = final[-1].groups()
    return {"task": "time-to-accuracy", "name": name, "command": " ".join(["vitkit", *cmd[3:]]),
            "cold_cache": not keep_cache, "val_top1": float(top1), "epochs": int(epochs),
            "elapsed_s": float(elapsed), "wall_s": round(wall, 1), "output": str(out)}
