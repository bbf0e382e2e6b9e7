"""``vitkit tune``'s search space: which TrainConfig fields a study varies and over what (parsed from ``--space``),
and how a trial draws them from Optuna. The study itself (storage, sampler, pruner, the runs) is cli/tune_cmd.py.

A dimension is ``NAME=LOW..HIGH`` (``:log`` for a log scale), ``NAME=A|B|C`` (choices), and its bounds may be
multiples of the run's own value, ``xF``: ``lr=x0.25..x4:log`` is a quarter to four times the learning rate the
recipe (or the flags) would use, so the default space suits AdamW's 1e-3 and SGD's 0.03 alike."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from .config import TrainConfig

# fields that are no hyper-parameter: where the data is, where the run goes, how it is run
NOT_SEARCHED = {"dataset", "data_dir", "output", "resume", "cache_dir", "device", "threads", "download", "init",
                "recipe", "unlabeled", "time_limit", "holdout", "train_fraction", "classes", "model_args",
                "objective", "compile", "precision", "attention", "channels_last", "data_mode", "workers", "decode",
                "eval_every", "eval_batch_size", "tiers", "skip_bad_images", "seed"}


@dataclass(frozen=True)
class Dimension:
    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    relative: bool = False  # low/high are multiples of the run's own value
    integer: bool = False

    def spec(self) -> str:
        if self.choices:
            return f"{self.name}={'|'.join(map(str, self.choices))}"
        x = "x" if self.relative else ""
        return f"{self.name}={x}{self.low:g}..{x}{self.high:g}" + (":log" if self.log else "")

    def bounds(self, base: Any) -> tuple[float, float]:
        """The range for a run whose own value is ``base``."""
        if not self.relative:
            return self.low, self.high  # type: ignore[return-value]
        if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
            raise ValueError(f"--space {self.spec()}: the run's own {self.name} is {base!r}, so multiples of it make "
                             f"no range; give the bounds themselves ({self.name}=LOW..HIGH)")
        lo, hi = self.low * base, self.high * base  # type: ignore[operator]
        if self.integer:
            lo, hi = max(round(lo), 1 if self.log else 0), round(hi)
            if lo >= hi:
                raise ValueError(f"--space {self.spec()}: the run's own {self.name} is {base}, so the range is "
                                 f"{lo}..{hi}, one whole number: widen it, or give the bounds themselves")
        return lo, hi


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _scalar_kind(hint: Any) -> type | None:
    """int, float, str or bool for a field's type (``float | None`` -> float), None for anything else."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for kind in (bool, int, float, str):
        if kind in args:
            return kind
    return None


def parse_space(specs: list[str] | tuple[str, ...]) -> list[Dimension]:
    """``--space`` strings -> dimensions, each a TrainConfig field of a type it can take; refused with the reason."""
    types = _field_types()
    dims: list[Dimension] = []
    for spec in specs:
        name, eq, rng = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not rng:
            raise ValueError(f"--space {spec}: expected NAME=LOW..HIGH[:log], NAME=xLOW..xHIGH[:log] or NAME=A|B|C")
        if name not in types:
            close = sorted(n for n in types if name[:3] in n)[:5]
            raise ValueError(f"--space {spec}: {name} is not a training setting"
                             + (f" (did you mean {', '.join(close)}?)" if close else ""))
        if name in NOT_SEARCHED:
            raise ValueError(f"--space {spec}: {name} says where or how the run goes, not how it learns; it is set "
                             "by its flag for every trial")
        if any(d.name == name for d in dims):
            raise ValueError(f"--space {spec}: {name} is given twice")
        kind = _scalar_kind(types[name])
        if kind is None:
            raise ValueError(f"--space {spec}: {name} is not a number or a word")
        if "|" in rng or kind in (str, bool):
            dims.append(Dimension(name, choices=tuple(_value(v.strip(), kind, spec) for v in rng.split("|"))))
            continue
        body, _, scale = rng.partition(":")
        if scale not in ("", "log"):
            raise ValueError(f"--space {spec}: the scale after ':' is log or nothing, not {scale!r}")
        lo_text, dots, hi_text = body.partition("..")
        if not dots:
            raise ValueError(f"--space {spec}: a range is LOW..HIGH (or choices A|B|C)")
        rel = [t.strip().startswith("x") for t in (lo_text, hi_text)]
        if rel[0] != rel[1]:
            raise ValueError(f"--space {spec}: both bounds are multiples (xLOW..xHIGH) or neither")
        lo, hi = (_number(t.strip().lstrip("x"), spec) for t in (lo_text, hi_text))
        integer = kind is int
        if not lo < hi:
            raise ValueError(f"--space {spec}: LOW must be below HIGH")
        if scale == "log" and lo <= 0:
            raise ValueError(f"--space {spec}: a log scale needs LOW > 0")
        if integer and not rel[0] and (lo != int(lo) or hi != int(hi)):
            raise ValueError(f"--space {spec}: {name} is a whole number; give whole bounds")
        dims.append(Dimension(name, lo, hi, scale == "log", relative=rel[0], integer=integer))
    return dims


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--space {spec}: {text!r} is not a number") from None


def _value(text: str, kind: type, spec: str) -> Any:
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--space {spec}: {text!r} is not true or false")
        return text.lower() == "true"
    if kind in (int, float):
        v = _number(text, spec)
        return int(v) if kind is int and v == int(v) else v
    return text


def suggest(trial: Any, dims: list[Dimension], base: TrainConfig) -> dict[str, Any]:
    """The trial's values, drawn by Optuna within each dimension's range for this run."""
    out: dict[str, Any] = {}
    for d in dims:
        if d.choices:
            out[d.name] = trial.suggest_categorical(d.name, list(d.choices))
            continue
        lo, hi = d.bounds(getattr(base, d.name))
        if d.integer:
            out[d.name] = trial.suggest_int(d.name, int(lo), int(hi), log=d.log)
        else:
            out[d.name] = trial.suggest_float(d.name, lo, hi, log=d.log)
    return out
