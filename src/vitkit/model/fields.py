"""The config boundary: every config dataclass (ViTConfig, TrainConfig) checks its keys, types and ranges here, so
what a YAML or JSON file says is either taken as the user meant it or refused with one message naming the key."""
from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A config value that is not what its field takes."""


def check_keys(d: dict[str, Any], what: str = "", cls: type | None = None, source: str = "") -> dict[str, Any]:
    """``d`` if every key is a field of the dataclass ``cls``; else an error naming the unknown and the known keys."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source + ': ' if source else ''}expected a mapping of keys to values, got "
                          f"{type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - known, key=str)
    if unknown:
        raise ConfigError(f"{source + ': ' if source else ''}unknown {what + ' ' if what else ''}key(s) {unknown}; "
                          f"known keys: {sorted(known)}")
    return dict(d)


def coerce_fields(obj: Any, source: str) -> None:
    """Give every field of the dataclass instance ``obj`` the type its annotation names, or raise ConfigError.

    Taken as meant: a number written as a string (YAML reads ``1e-3`` as one), a whole float for an int, a list for a
    pair. Refused: text that is no number, a fraction for an int, NaN or infinity, a bool for a number."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = coerce(value, str(f.type), f"{source}: {f.name}")
        if new is not value:
            object.__setattr__(obj, f.name, new)


def coerce(v: Any, typ: str, where: str) -> Any:
    """``v`` as the type ``typ`` (a field's annotation, as text) names, or a ConfigError naming ``where``."""
    kinds = [t.strip() for t in typ.split("|")]
    if v is None:
        if "None" in kinds:
            return None
        raise ConfigError(f"{where} must not be empty (expected {typ})")
    for kind in kinds:
        try:
            if kind == "bool" and isinstance(v, bool):
                return v
            if kind == "int":
                return _int(v)
            if kind == "float":
                return _float(v)
            if kind.startswith("tuple[int") and isinstance(v, (list, tuple)) and len(v) == 2:
                return tuple(_int(x) for x in v)
            if kind == "str" and isinstance(v, str):
                return v
            if kind.startswith("dict") and isinstance(v, dict):
                return v
            if kind.startswith("list") and isinstance(v, list):
                return v
        except (TypeError, ValueError):
            continue
    raise ConfigError(f"{where} must be {_describe(kinds)}, got {v!r}")


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
        return int(v)
    raise ValueError


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError
    x = float(v)
    if not math.isfinite(x):
        raise ValueError
    return x


def _describe(kinds: list[str]) -> str:
    names = {"int": "a whole number", "float": "a finite number", "bool": "true or false", "str": "text",
             "None": "empty (null)"}
    return " or ".join(names.get(k, "a pair [H, W]" if k.startswith("tuple") else "a list" if k.startswith("list")
                                      else "a mapping") for k in kinds)


def check_range(source: str, name: str, value: float | None, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """``value`` within [lo, hi] (an open end excludes it); None passes (an optional field left unset)."""
    if value is None:
        return
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or \
          (hi is not None and (value > hi or (hi_open and value == hi)))
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi:g}"
        raise ConfigError(f"{source}: {name} must be {' and '.join(s for s in (lo_s, hi_s) if s)}, got {value!r}")
