"""A claim's runs as data: each point a set of TrainConfig settings and the ``vitkit train`` command that trains it
alone (no torch here: ``vitkit reproduce --help`` lists the claims without importing it)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any


@dataclass
class Run:
    """One point of a claim: TrainConfig ``settings`` trained for ``budget_min`` minutes into OUT/runs/ID."""

    id: str
    settings: dict[str, Any]
    fields: dict[str, Any]  # the columns that place the point: model, train_fraction, seed, pos_embed, ...
    budget_min: float | None  # None: the run's own epochs decide (--quick)

    def train_settings(self) -> dict[str, Any]:
        """The settings of this point, as the CSV records them (no run folder)."""
        return {**self.settings, **({"time_limit": self.budget_min} if self.budget_min else {})}

    def command(self) -> str:
        """The ``vitkit train`` (or ``vitkit pretrain``) command that trains this point alone."""
        settings = dict(self.train_settings())
        method = settings.pop("objective", "classify")
        head = ["train"] if method == "classify" else ["pretrain", "--method", method]
        return "vitkit " + shlex.join([*head, *train_flags(settings)])


# model settings whose flag is not --KEY-WITH-DASHES
MODEL_FLAG_NAMES = {"drop_path_rate": "--drop-path", "drop_rate": "--drop"}


def train_flags(settings: dict[str, Any]) -> list[str]:
    """``vitkit train`` flags for TrainConfig ``settings`` (``model_args`` as model flags)."""
    out: list[str] = []
    for k, v in settings.items():
        if k == "model_args":
            for mk, mv in v.items():
                flag = MODEL_FLAG_NAMES.get(mk, "--" + mk.replace("_", "-"))
                out += [flag, *(str(x) for x in mv)] if isinstance(mv, (tuple, list)) else \
                    [flag, "none" if mv is None else str(mv)]
        elif k == "tiers" and v is None:
            out.append("--no-tiers")  # the recipe's tiers off: the run trains the settings it states
        elif isinstance(v, bool):
            out.append(("--" if v else "--no-") + k.replace("_", "-"))
        else:
            out += ["--" + k.replace("_", "-"), f"{v:g}" if isinstance(v, float) else str(v)]
    return out
