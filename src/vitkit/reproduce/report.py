"""A claim's figure and summary, from its results.csv alone (so they can be redrawn from committed results)."""
from __future__ import annotations

import platform
import statistics
import textwrap
from pathlib import Path
from typing import Any

from ..runtime.cpu import cpu_kind
from ..runtime.threads import cores_text
from .claims import Claim, num


def figure(claim: Claim, rows: list[dict[str, Any]], path: Path, quick: bool = False) -> None:
    import matplotlib  # ≈0.5 s to import: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the file-only backend

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    if claim.name == "data-size":
        for model in dict.fromkeys(r["model"] for r in rows):
            pts = sorted((num(r, "train_images"), num(r, "test_top1")) for r in rows if r["model"] == model)
            ax.plot(*zip(*pts), marker="o", label=model)
        _log_x_at(ax, sorted({int(num(r, "train_images")) for r in rows}), "{:,}")  # the fractions' sizes
        ax.set_xlabel("training images (log scale)")
        ax.legend(loc="center right", fontsize=8)
    elif claim.name == "posemb":
        kinds = list(dict.fromkeys(r["pos_embed"] for r in rows))
        accs = [[num(r, "test_top1") for r in rows if r["pos_embed"] == k] for k in kinds]
        means = [statistics.mean(a) for a in accs]
        spread = [[m - min(a) for m, a in zip(means, accs)], [max(a) - m for m, a in zip(means, accs)]]
        ax.bar(kinds, means, yerr=spread, capsize=6, color="#8cb4d8")
        for i, a in enumerate(accs):
            ax.scatter([i] * len(a), a, color="k", s=10, zorder=3)
        ax.set_ylim(min(min(a) for a in accs) - 3, max(max(a) for a in accs) + 2)
        ax.set_xlabel("position embedding (bars: mean, whiskers: min-max over seeds, dots: seeds)")
    elif claim.name == "patch-size":
        for r in rows:
            ax.scatter(num(r, "train_pflop"), num(r, "test_top1"), s=40)
            ax.annotate(f"patch {r['patch_size']}", (num(r, "train_pflop"), num(r, "test_top1")),
                        textcoords="offset points", xytext=(5, 5))
        _log_x_at(ax, sorted(num(r, "train_pflop") for r in rows), "{:.3g}")  # the runs' own compute
        ax.set_xlabel("training compute (PFLOP, log scale)")
    elif claim.name == "self-supervision":  # test top-1 against the share of labels, a line per starting point
        target = [r for r in rows if r["stage"] == "target"]
        for kind in dict.fromkeys(r["weights"] for r in target):
            shares = sorted({num(r, "labels") for r in target if r["weights"] == kind})
            means = [statistics.mean(num(r, "test_top1") for r in target if r["weights"] == kind
                                     and num(r, "labels") == f) for f in shares]
            ax.plot(shares, means, marker="o", label={"random": "from scratch"}.get(kind, f"pre-trained: {kind}"))
            ax.scatter([num(r, "labels") for r in target if r["weights"] == kind],
                       [num(r, "test_top1") for r in target if r["weights"] == kind], s=10, color="k", zorder=3)
        ax.set_xscale("log")
        ax.set_xlabel("share of the training labels (log scale; dots: seeds)")
        ax.legend(fontsize=8)
    else:  # transfer
        names = [r["run"] for r in rows]
        ax.bar(names, [num(r, "test_top1") for r in rows], color=["#bbbbbb" if r["run"] == "pretrain" else "#8cb4d8"
                                                                  for r in rows])
        ax.tick_params(axis="x", rotation=20)
        ax.set_xlabel("run (grey: the CIFAR-10 pre-training, on its own test set)")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title("\n".join(textwrap.wrap(claim.title + (" (--quick: checks the machinery, says nothing about the "
                                                        "claim)" if quick else ""), 70)), fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _log_x_at(ax, values: list[float], fmt: str) -> None:  # type: ignore[no-untyped-def]
    """A log x axis labelled at ``values`` only (matplotlib's minor labels, 3x10^3 4x10^3 ..., run into each other)."""
    ax.set_xscale("log")
    ax.set_xticks(values, [fmt.format(v) for v in values], minor=False)
    ax.set_xticks([], minor=True)


def summary(claim: Claim, rows: list[dict[str, Any]], wall_s: float, quick: bool, budget_min: float,
            command: str, not_run: list[str] | None = None) -> str:
    cols = [c for c in rows[0] if c not in ("command", "claim", "held_equal", "cpu", "cores", "torch")] if rows else []
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    total = sum(num(r, "wall_s") for r in rows)
    budget_text = ("--quick (a tiny slice, one epoch: checks the machinery, says nothing about the claim)" if quick
                   else f"{budget_min:g} min of wall-clock time per {claim.budget_per}")
    lines = [f"# `{claim.name}`: {claim.title}", "",
             f"**The paper.** {claim.paper}", "",
             f"**Ours.** {claim.verdict(rows)}", "",
             f"**Held equal.** {claim.held_equal}.", "",
             f"**Budget.** {budget_text}; "
             f"{len(rows)} runs, {total / 60:.1f} min of training in all ({wall_s / 60:.1f} min in this invocation).",
             "", f"**Machine.** {machine(rows)}; Python {platform.python_version()}.", "",
             f"**Command.** `{command}` (each run's own `vitkit train` or `vitkit pretrain` command is in "
             "results.csv).", "",
             *([f"**Not run.** {', '.join(not_run)} (`--runs` left them out): the verdict speaks of the runs above "
                "only.", ""] if not_run else []),
             *table, ""]
    return "\n".join(lines)


def machine(rows: list[dict[str, Any]]) -> str:
    """The machine the runs recorded (a report drawn again elsewhere must not name the machine it is drawn on);
    runs from before the cores were recorded get this process's, if they ran on this kind of CPU."""
    here = cpu_kind()
    seen: dict[str, None] = {}
    for r in rows:
        if r.get("cpu"):
            cores = r.get("cores") or (cores_text() if r["cpu"] == here else "")
            seen[f"{r['cpu']}, {cores}" if cores else r["cpu"]] = None
    return "; ".join(seen) or f"{here}, {cores_text()}"
