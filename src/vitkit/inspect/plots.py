"""PNG plots (matplotlib, Agg): training curves, confusion matrix, and the inspection figures."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_curves(metrics_jsonl: Path, out: Path) -> None:
    """Loss and validation top-1 per epoch from a run's ``metrics.jsonl``."""
    if not Path(metrics_jsonl).is_file():
        return
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    if not rows:
        return
    ep = [r["epoch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ep, [r["train_loss"] for r in rows], label="train loss")
    a.plot(ep, [r["val_loss"] for r in rows], label="val loss")
    a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.set_title("Loss"), a.legend(), a.grid(alpha=0.3)
    b.plot(ep, [r["val_top1"] for r in rows], color="tab:green", marker="o", ms=3)
    b.set_xlabel("epoch"), b.set_ylabel("top-1 (%)"), b.grid(alpha=0.3)
    b.set_title(f"Validation top-1 (best {max(r['val_top1'] for r in rows):.2f}%)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_confusion(confusion: list[list[int]], classes: list[str], out: Path, title: str = "Confusion matrix") -> None:
    cm = np.asarray(confusion)
    n = len(classes)
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * n + 2), max(4, 0.5 * n + 1.5)))
    im = ax.imshow(cm, cmap="Blues")
    fig.colorbar(im, ax=ax, label="images")
    ax.set_xticks(range(n), classes, rotation=45, ha="right"), ax.set_yticks(range(n), classes)
    ax.set_xlabel("predicted"), ax.set_ylabel("true"), ax.set_title(title)
    if n <= 20:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if cm[i, j] > cm.max() / 2 else "black")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
