"""A run folder's record of itself: ``config.yaml``, ``metrics.jsonl`` (one row per epoch), TensorBoard events and
``curves.png``. Only the main process writes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import yaml

from ..model.serialization import atomic_write


LOCK_NAME = ".vitkit-run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


class RunLog:
    """Writes into ``out`` (nothing when ``out`` is None or ``enabled`` is False, as on ranks other than 0)."""

    def __init__(self, out: Path | None, enabled: bool = True, log: Callable[[str], None] = print) -> None:
        self.out = out if enabled else None
        self.log = log
        self.writer: Any = None
        self.locked: Path | None = None
        self.wrote_plan = False  # this part of the run wrote plan.json (a resumed run keeps its first part's)

    def replan(self, config: dict[str, Any], plan: Any) -> None:
        """The config and plan again, once the run's first steps have decided what the planner left to them."""
        if self.out is None or not self.out.is_dir():
            return
        try:  # each written whole and renamed (atomic_write): a full disk leaves the first one as it was
            atomic_write(self.out / "config.yaml", lambda tmp: tmp.write_text(yaml.safe_dump(config, sort_keys=False)))
            if self.wrote_plan:
                atomic_write(self.out / "plan.json",
                             lambda tmp: tmp.write_text(json.dumps(plan.to_dict(), indent=1, default=str)))
        except OSError as e:
            self.log(f"could not rewrite {self.out}/config.yaml and plan.json with what the run decided ({e}); the "
                     "ones written at its start are kept")

    def open(self, config: dict[str, Any], plan: Any = None) -> None:
        """Create the folder, write the resolved config and the plan (``plan.json``: how each ``auto`` was decided)
        and start the TensorBoard writer. A resumed run keeps the plan its first part made."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock()
        (self.out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        if plan is not None and not (self.out / "plan.json").exists():
            plan.save(self.out)
            self.wrote_plan = True
        try:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard (≈1 s): only for a run folder

            self.writer = SummaryWriter(str(self.out / "tb"))
        except ImportError:  # tensorboard is a dependency, but a broken install should not stop training
            self.log("tensorboard not importable: no TensorBoard events")

    def _lock(self) -> None:
        """Hold the run folder for this process (``.vitkit-run.lock`` with its pid, created exclusively): a second
        run into the same folder is refused while this one lives, instead of interleaving the metrics and taking
        over best/. A lock whose process is gone (killed) is taken over."""
        assert self.out is not None
        lock = self.out / LOCK_NAME
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and _alive(pid):
                    raise FileExistsError(f"{self.out} is being written by another vitkit run (process {pid}); "
                                          "wait for it, or choose another --output") from None
                lock.unlink(missing_ok=True)  # its process is gone: a stale lock
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.locked = lock
            return
        raise FileExistsError(f"{self.out}: could not take {LOCK_NAME}")

    def epoch(self, row: dict[str, Any]) -> None:
        """One epoch's metrics: a line of ``metrics.jsonl`` and TensorBoard scalars at ``row["step"]``."""
        if self.out is None:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k not in ("epoch", "step") and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def close(self) -> None:
        """Close the TensorBoard writer and draw ``curves.png`` from ``metrics.jsonl``."""
        if self.out is None:
            return
        if self.writer is not None:
            self.writer.close()
        plot_curves(self.out / "metrics.jsonl", self.out / "curves.png")
        if self.locked is not None:
            self.locked.unlink(missing_ok=True)
            self.locked = None


def read_metrics(metrics_jsonl: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``, one per epoch."""
    return [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]


def plot_curves(metrics_jsonl: Path, out: Path) -> None:
    """Loss and validation top-1 per epoch from a run's ``metrics.jsonl``."""
    if not Path(metrics_jsonl).is_file():
        return
    rows = read_metrics(metrics_jsonl)
    if not rows:
        return
    import matplotlib  # matplotlib's import (≈0.5 s) is paid once, when a run ends

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    val = [r for r in rows if "val_top1" in r]  # epochs skipped by --eval-every have no validation metrics
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["epoch"] for r in rows], [r["train_loss"] for r in rows], label="train loss")
    a.plot([r["epoch"] for r in val], [r["val_loss"] for r in val], label="val loss")
    a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.set_title("Loss"), a.legend(), a.grid(alpha=0.3)
    b.plot([r["epoch"] for r in val], [r["val_top1"] for r in val], color="tab:green", marker="o", ms=3)
    b.set_xlabel("epoch"), b.set_ylabel("top-1 (%)"), b.grid(alpha=0.3)
    if val:
        b.set_title(f"Validation top-1 (best {max(r['val_top1'] for r in val):.2f}%)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
