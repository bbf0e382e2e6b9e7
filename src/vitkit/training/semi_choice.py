"""``--semi auto``: learn from the unlabelled images the way that measured best for this budget on this kind of
machine, or not at all where neither route beat the default recipe there.

An accuracy cannot be timed in the first seconds of a run the way a kernel can (both routes start slower than the
default and may or may not overtake it), so ``auto`` reads what was measured: the rows of
``results/semi-supervised.csv``, copied into ``MEASURED`` below (a test checks the copy against the file). A
measurement counts for a run whose ``--time-limit`` is within a factor of two of its budget and whose
``--train-fraction`` within a factor of two of its fraction, on the same device type; where none does, ``auto``
trains the default recipe and says that nothing was measured there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import mean

from .config import TrainConfig

NEAR = 2.0  # a measurement's budget and label fraction count for a run within this factor of them


@dataclass(frozen=True)
class Measured:
    device: str  # the device type it ran on ("cpu", "cuda")
    budget_min: float  # --time-limit
    train_fraction: float
    semi: str | None  # None: the default recipe, beside it on the same machine
    val_top1: float


# results/semi-supervised.csv (CIFAR-10 zip, 2-core AMD EPYC AVX2 and AVX512-BF16, quiet): one row a run
MEASURED = (
    Measured("cpu", 5, 0.1, None, 63.12), Measured("cpu", 5, 0.1, "joint", 49.77),
    Measured("cpu", 5, 0.01, None, 35.64), Measured("cpu", 5, 0.01, "joint", 30.71),
    Measured("cpu", 5, 0.1, None, 62.35), Measured("cpu", 5, 0.1, "fixmatch", 56.76),
    Measured("cpu", 30, 0.1, None, 70.59),
    Measured("cpu", 5, 0.1, None, 67.69), Measured("cpu", 5, 0.1, "fixmatch", 63.08),
)


def _near(a: float, b: float) -> bool:
    return max(a, b) / min(a, b) <= NEAR


def choose_semi(cfg: TrainConfig, device_type: str, measured: tuple[Measured, ...] = MEASURED
                ) -> tuple[TrainConfig, str]:
    """``cfg`` with ``semi: auto`` decided, and the line that says why (``cfg`` unchanged, "" otherwise)."""
    if cfg.semi != "auto":
        return cfg, ""
    fraction = cfg.train_fraction or 1.0
    rows = [m for m in measured if m.device == device_type and cfg.time_limit is not None
            and _near(m.budget_min, cfg.time_limit) and _near(m.train_fraction, fraction)]
    by_route: dict[str | None, list[float]] = {}
    for m in rows:
        by_route.setdefault(m.semi, []).append(m.val_top1)
    unread = f"; --unlabeled {cfg.unlabeled} is not read" if cfg.unlabeled else ""
    if None not in by_route or len(by_route) < 2:
        where = (f"--time-limit {cfg.time_limit:g}" if cfg.time_limit is not None else "a run without --time-limit")
        return replace(cfg, semi=None, unlabeled=None), (
            f"semi: auto -> none: neither route was measured against the default on a {device_type} at {where} with "
            f"{fraction:g} of the labels (results/semi-supervised.csv); the default recipe trains{unread}. --semi "
            "joint or --semi fixmatch tries one")
    scores = {route: mean(v) for route, v in by_route.items()}
    best = max((r for r in scores if r is not None), key=lambda r: scores[r])
    said = ", ".join(f"{r or 'default'} {scores[r]:.2f}%" for r in sorted(scores, key=lambda r: -scores[r]))
    at = (f"at {'/'.join(f'{b:g}' for b in sorted({m.budget_min for m in rows}))} min with "
          f"{'/'.join(f'{f:g}' for f in sorted({m.train_fraction for m in rows}))} of the labels on a {device_type}")
    if scores[best] > scores[None]:
        return replace(cfg, semi=best), f"semi: auto -> {best}: measured best {at} ({said})"
    return replace(cfg, semi=None, unlabeled=None), (
        f"semi: auto -> none: neither route beat the default recipe {at} ({said}; results/semi-supervised.csv); the "
        f"default trains on the labelled images alone{unread}")
