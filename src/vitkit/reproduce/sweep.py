"""Running a claim's runs: each one an ordinary training run (the same planner, recipes and Trainer as ``vitkit
train``), one after another in this process, its row appended to ``results.csv`` as soon as it ends. A sweep that
is stopped continues where it stopped: finished runs (rows in the CSV) are not repeated, the run that was cut off
resumes from its ``last/``."""
from __future__ import annotations

import csv
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from ..model.config import to_2tuple
from ..model.serialization import read_config
from ..model.vit import VisionTransformer
from ..training.plan import Sources, plan_run
from ..training.runlog import read_metrics
from ..training.trainer import Trainer
from .runs import Run, train_flags  # noqa: F401 - Run and train_flags: the sweep's public names, as before


class SweepError(RuntimeError):
    """A run of the sweep failed; the message names its log and command. Finished runs stay in the CSV."""


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of an earlier sweep's results.csv ([] if there is none); an error naming the file for anything
    that is not one (nothing is overwritten)."""
    if not path.is_file():
        return []
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (csv.Error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a results.csv of vitkit reproduce ({e}); move it away or choose another "
                         "--out") from None
    if "run" not in (reader.fieldnames or []) or any(not r.get("run") for r in rows):
        raise ValueError(f"{path}: not a results.csv of vitkit reproduce (no 'run' column, or a row without one); "
                         "move it away or choose another --out")
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """The whole CSV, written to a temporary file and renamed over the old one: a kill never leaves half a file."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def train_flops_per_image(run_dir: Path) -> float:
    """Forward+backward FLOPs of one training image for the model the run trained (PyTorch's FLOP counter on a
    forward of one image, x3 for the backward), CNN stem included."""
    cfg = read_config(run_dir / "last")[0]
    model = VisionTransformer(cfg).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, cfg.in_chans, *to_2tuple(cfg.img_size)))
    return 3.0 * counter.get_total_flops()


def execute(run: Run, out: Path) -> dict[str, Any]:
    """Train one run (resuming its folder if it was cut off) and return its row."""
    run_dir = out / "runs" / run.id
    if run_dir.exists() and not (run_dir / "last").exists():
        shutil.rmtree(run_dir)  # cut off before its first checkpoint: nothing to resume, start it again
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = {**run.train_settings(), "output": str(run_dir), "resume": "auto"}
    given = {k: v for k, v in settings.items() if k != "model_args"}
    t = time.time()
    with (run_dir / "train.log").open("a") as f:
        def say(line: str) -> None:
            f.write(line + "\n")
            f.flush()

        try:
            cfg, plan, data = plan_run(Sources(given, settings.get("model_args", {}), started=t), log=say, start_time=t)
            trainer = Trainer(cfg, data=data, log=say, start_time=t, progress=False, plan_=plan)
            result = trainer.fit()
        except Exception as e:  # noqa: BLE001 - the traceback goes to the run's log, the sweep says what and where
            traceback.print_exc(file=f)
            raise SweepError(f"run {run.id} failed: {type(e).__name__}: {e}; its log: {run_dir / 'train.log'}; "
                             f"command: {run.command()}") from None
    metrics = read_metrics(run_dir / "metrics.jsonl")
    images = metrics[-1]["step"] * cfg.batch_size * cfg.grad_accum if metrics else 0
    if cfg.objective == "classify":
        flops = train_flops_per_image(run_dir)
        score = {"test_top1": round(result.val_top1, 3)}
        cost = {"gflop_per_train_image": float(f"{flops / 1e9:.4g}"),
                "train_pflop": float(f"{flops * images / 1e15:.4g}")}
    else:  # a pre-training: no top-1, its own task's loss on the test images; its step is not the classifier's
        score = {"test_top1": "", "test_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), "")}
        cost = {"gflop_per_train_image": "", "train_pflop": ""}
    return {"run": run.id, **run.fields, **score,
            "train_images": len(trainer.data.train), "test_images": len(trainer.data.val),
            "epochs": result.epochs, "train_images_seen": images, **cost, "elapsed_s": round(result.elapsed_s, 1),
            "wall_s": round(time.time() - t, 1), "budget_min": run.budget_min or "",
            "precision": cfg.precision, "command": run.command()}


def said(row: dict[str, Any]) -> str:
    """A finished run's result in words: its test top-1, or a pre-training's loss on its own task."""
    if row.get("test_top1") not in ("", None):
        return f"test top-1 {float(row['test_top1']):.2f}%"
    return f"test loss {float(row['test_loss']):.4f} (the pre-training's own task)"


def sweep(runs: list[Run], out: Path, common: dict[str, Any], progress: bool = True,
          say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every run of ``runs`` not yet in ``out/results.csv``, in order; the CSV's rows (``common`` columns added)."""
    path = out / "results.csv"
    rows = read_rows(path)
    done = {r["run"] for r in rows}
    todo = [r for r in runs if r.id not in done]
    if done:
        say(f"{len(done)} of {len(runs)} runs already in {path}: continuing with the other {len(todo)}")
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="runs", unit="run", disable=not progress,
               dynamic_ncols=True)
    for run in todo:
        bar.set_postfix_str(run.id)
        row = {**execute(run, out), **common}
        rows.append(row)
        write_rows(path, rows)
        bar.update(1)
        bar.write(f"{run.id}: {said(row)} ({row['epochs']} epochs, {row['elapsed_s']:.0f} s)")
    bar.close()
    order = {r.id: i for i, r in enumerate(runs)}
    return sorted(rows, key=lambda r: order.get(r["run"], len(order)))
