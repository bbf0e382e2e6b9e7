"""Everything a training run needs, in one dataclass; the CLI maps flags and YAML onto it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..data.datasets import DATASETS
from ..model.config import ViTConfig
from ..model.fields import check_keys, check_range, coerce_fields
from ..runtime.device import resolve_device
from ..runtime.precision import PRECISIONS, resolve_precision
from .evaluate import EVAL_BATCH_SIZE


# What a few_epochs section may change: what the trainer builds once the data is loaded and a step has been timed.
FEW_EPOCHS_KEYS = frozenset({
    "model_args", "opt", "muon_stem", "muon_embed", "lr", "min_lr", "momentum", "weight_decay", "warmup_epochs",
    "clip_grad", "smoothing", "batch_size", "crop_padding", "hflip", "aa", "mixup", "cutmix", "model_ema",
    "model_ema_decay", "eval_every"})


@dataclass
class TrainConfig:
    # data
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    skip_bad_images: bool = False
    cache_dir: str | None = None
    # model: a preset plus ViTConfig overrides (img_size, patch_size, embed_dim, depth, ...)
    model: str = "vit_nano_patch2_8"
    model_args: dict[str, Any] = field(default_factory=dict)
    init: str | None = None  # fine-tune from weights: a registered NAME.TAG or any file/folder vitkit.load reads
    freeze_body: bool = False  # train the head alone (a linear probe on the pretrained features)
    train_fraction: float = 1.0  # train on this class-balanced share of the training split (learning curves)
    folder_max_side: int = 128  # --dataset folder: images are held in memory at up to this many pixels a side
    # optimisation
    epochs: int = 30
    batch_size: int = 128
    grad_accum: int = 1
    opt: str = "adamw"  # adamw | sgd | muon (Muon for the blocks' weight matrices, AdamW for the rest)
    muon_stem: bool = False  # opt muon: Muon for the hybrid's CNN stem filters too (each an out x in*k*k matrix)
    muon_embed: bool = False  # opt muon: Muon for the patch embedding's projection E (Eq. 1) too
    lr: float = 1e-3
    body_lr_scale: float = 1.0  # LR of everything but the head, relative to --lr (fine-tuning)
    min_lr: float = 1e-5
    momentum: float = 0.9
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    clip_grad: float | None = None
    smoothing: float = 0.0
    # augmentation (in batches, on the device)
    crop_padding: int = 0
    hflip: bool = False
    aa: str | None = None  # "rand" | "trivial"
    mixup: float = 0.0
    cutmix: float = 0.0
    model_ema: bool = False
    model_ema_decay: float = 0.999
    # machinery
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (bf16 where the device has it natively, else fp32)
    compile: bool | str = False  # true | false | auto (compile where it pays: runtime/compile.py says where)
    device: str = "auto"
    threads: int | None = None  # CPU intra-op threads; None = measured at the start of the run (runtime/threads.py)
    seed: int = 0
    time_limit: float | None = None  # minutes of wall time for the whole run, evaluation included
    eval_batch_size: int = EVAL_BATCH_SIZE
    eval_every: int = 1  # epochs between evaluations; the last epoch is always evaluated
    output: str | None = None
    resume: str | None = None  # a run folder, or "auto" (the --output folder if it has last/)
    # With a --time-limit: settings laid over these when the budget buys fewer than `below` epochs of the configured
    # model, timed at the start of the run (a slower CPU gets a cheaper model): {below: 4, lr: 0.003, ...}
    few_epochs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, "train config")  # YAML's `lr: 1e-3` is a string to PyYAML: taken as the number meant
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        check_keys(self.model_args, "model override", ViTConfig)
        choices = {"opt": ("adamw", "sgd", "muon"), "precision": PRECISIONS,
                   "aa": (None, "rand", "trivial")}
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"{k} must be one of {allowed}, got {getattr(self, k)!r}")
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile must be true, false or auto, got {self.compile!r}")
        check_range("train config", "folder_max_side", self.folder_max_side, 8, 4096)
        for k in ("epochs", "batch_size", "threads", "grad_accum", "eval_batch_size", "eval_every"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ValueError(f"{k} must be at least 1, got {getattr(self, k)}")
        for k, lo, hi, lo_open, hi_open in (
                ("lr", 0, None, True, False), ("min_lr", 0, None, False, False),
                ("body_lr_scale", 0, None, False, False), ("train_fraction", 0, 1, True, False),
                ("momentum", 0, 1, False, True), ("weight_decay", 0, None, False, False),
                ("warmup_epochs", 0, None, False, False), ("clip_grad", 0, None, True, False),
                ("smoothing", 0, 1, False, True), ("crop_padding", 0, None, False, False),
                ("mixup", 0, None, False, False), ("cutmix", 0, None, False, False),
                ("model_ema_decay", 0, 1, True, True)):
            check_range("train config", k, getattr(self, k), lo, hi, lo_open, hi_open)
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError(f"time_limit must be more than 0 minutes (leave it out for no limit), got "
                             f"{self.time_limit:g}")
        if self.few_epochs is not None:
            below = self.few_epochs.get("below")
            bad = sorted(set(self.few_epochs) - FEW_EPOCHS_KEYS - {"below"}, key=str)
            if isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below < math.inf:
                raise ValueError(f"few_epochs needs below: N (a number of epochs, more than 0), got {below!r}")
            if not isinstance(self.few_epochs.get("model_args", {}), dict):
                raise ValueError(f"few_epochs: model_args must be a mapping, got {self.few_epochs['model_args']!r}")
            if bad:
                raise ValueError(f"few_epochs cannot set {bad}: it may set {sorted(FEW_EPOCHS_KEYS)} (what is "
                                 "built after the data is loaded and the step timed)")
            try:  # its values checked now, not when the run has started
                self.for_few_epochs()
            except ValueError as e:
                raise type(e)(f"few_epochs: {e}") from None

    @property
    def few_epochs_settings(self) -> dict[str, Any]:
        """The settings of ``few_epochs`` (all but its ``below``)."""
        return {k: v for k, v in (self.few_epochs or {}).items() if k != "below"}

    def for_few_epochs(self) -> "TrainConfig":
        """This config with its ``few_epochs`` settings laid over it, and no ``few_epochs``: what a run trains when
        its budget buys fewer epochs than ``few_epochs["below"]``."""
        d = lay_over({**self.to_dict(), "few_epochs": None}, self.few_epochs_settings)
        return TrainConfig.from_dict(d, source="few_epochs")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "TrainConfig":
        return cls(**check_keys(d, cls=cls, source=source))


def lay_over(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``layer``'s settings in place of its own; ``model_args`` merge key by key (a layer changing the
    depth keeps the width)."""
    return {**base, **layer, "model_args": {**base.get("model_args", {}), **layer.get("model_args", {})}}


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    d = safe_yaml(p)
    if not isinstance(d, dict):
        raise ValueError(f"{p}: expected a mapping of TrainConfig keys, got {type(d).__name__}")
    return d


def safe_yaml(path: Path) -> Any:
    """A YAML file's plain values (no ``!!python`` tags: safe_load refuses them), or an error naming the file."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not a plain YAML file of keys and values ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None


def recipe(name: str, time_limit: float | None = None, cpu_fp32: bool = False) -> dict[str, Any]:
    """The shipped recipe ``configs/<name>.yaml`` (the per-dataset defaults), or {} if there is none.

    A recipe may hold settings for short budgets under ``budgets: {MINUTES: {key: value, ...}}``: with
    ``time_limit`` <= MINUTES they replace the recipe's own (the smallest such MINUTES wins; ``model_args`` merge
    key by key), since what trains best in 5 minutes is not what trains best in 30. A ``cpu_fp32:`` section, in
    the recipe or in a budget, is laid over it when training runs in fp32 on a CPU (``cpu_fp32``), where a step
    costs 2-4x what it costs with native bf16, so fewer epochs fit the budget.
    """
    return for_budget(read_recipe(name), time_limit, cpu_fp32)


def read_recipe(name: str) -> dict[str, Any]:
    """``configs/<name>.yaml`` as written, ``budgets`` section and all ({} if there is no such recipe)."""
    f = resources.files("vitkit") / "configs" / f"{name}.yaml"
    return yaml.safe_load(f.read_text()) or {} if f.is_file() else {}


def for_budget(d: dict[str, Any], time_limit: float | None, cpu_fp32: bool = False) -> dict[str, Any]:
    """``d`` without its ``budgets`` and ``cpu_fp32`` sections; laid over it, in this order: its ``cpu_fp32``
    section (when ``cpu_fp32``), the budget's settings for ``time_limit`` minutes, that budget's ``cpu_fp32``
    section (when ``cpu_fp32``)."""
    d = dict(d)
    budgets, fp32 = d.pop("budgets", None) or {}, d.pop("cpu_fp32", None) or {}
    fits = sorted((float(m), m) for m in budgets if time_limit is not None and time_limit <= float(m))
    short = dict(budgets[fits[0][1]]) if fits else {}
    short_fp32 = short.pop("cpu_fp32", None) or {}
    for layer in (fp32, short, short_fp32) if cpu_fp32 else (short,):
        d = lay_over(d, layer)
    return d


def describe_changes(before: dict[str, Any], after: dict[str, Any], before_model: dict[str, Any] | None = None
                     ) -> list[str]:
    """``["lr 0.001 -> 0.002", "depth 6 -> 3"]``: what the settings ``after`` change of ``before``, ``model_args`` key
    by key (against ``before_model`` when given: the model's full config rather than its overrides)."""
    model = before.get("model_args", {}) if before_model is None else before_model
    pairs = [(k, before.get(k), v) for k, v in after.items() if k != "model_args"]
    pairs += [(k, model.get(k), v) for k, v in after.get("model_args", {}).items()]
    return [f"{k} {a} -> {b}" for k, a, b in pairs if a != b]


def trains_in_fp32_on_cpu(precision: str, device: str) -> bool:
    """Whether a run with these ``precision`` and ``device`` settings (``auto`` allowed) computes in fp32 on a CPU."""
    dev = resolve_device(device)
    return dev.type == "cpu" and resolve_precision(precision, dev) == "fp32"


def list_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in (resources.files("vitkit") / "configs").iterdir() if p.name.endswith(".yaml"))
