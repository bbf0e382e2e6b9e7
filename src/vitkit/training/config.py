"""Everything a training run needs, in one dataclass; the CLI maps flags and YAML onto it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..data.datasets import DATASETS, FILE_DATASETS
from ..data.folder import DATA_MODES
from ..model.config import ViTConfig
from ..model.fields import ConfigError, check_keys, check_range, coerce, coerce_fields
from ..runtime.precision import TRAIN_PRECISIONS
from .evaluate import EVAL_BATCH_SIZE


# What a tier may change: what is built once the data is loaded and the recipe's step has been timed.
TIER_KEYS = frozenset({
    "model_args", "opt", "muon_stem", "muon_embed", "lr", "min_lr", "momentum", "weight_decay", "warmup_epochs",
    "clip_grad", "smoothing", "batch_size", "crop_padding", "hflip", "aa", "mixup", "cutmix", "model_ema",
    "model_ema_decay", "eval_every"})
ATTENTIONS = ("auto", "sdpa", "exact")
DECODES = ("auto", "workers", "device")  # where streamed JPEGs are decoded
# torch.compile's modes a run may name as its compile: CUDA graphs ("reduce-overhead": a step's kernels launched
# as one graph, for the launch-bound small steps of a GPU); compile: true is the default mode
COMPILE_MODES = ("reduce-overhead",)
OBJECTIVES = ("classify", "mpp", "mae")  # what the loss compares: training/objectives.py
SEMI = (None, "joint", "fixmatch", "auto")  # with the labels, what the unlabelled images are learnt by
# (training/objectives.py; auto: training/semi_choice.py)
SEMI_WEIGHT = {"joint": 0.5, "fixmatch": 1.0}  # each one's own loss weight when semi_weight is not given


@dataclass
class TrainConfig:
    # data
    dataset: str = "digits"
    data_dir: str | None = None
    # a shipped recipe by name (configs/<name>.yaml) instead of the one the dataset or its images call for
    recipe: str | None = None
    download: bool = False
    skip_bad_images: bool = False
    cache_dir: str | None = None
    # model: a preset plus ViTConfig overrides (img_size, patch_size, embed_dim, depth, ...)
    model: str | None = "vit_nano_patch2_8"  # None with --init: the architecture is the weights' own
    model_args: dict[str, Any] = field(default_factory=dict)
    init: str | None = None  # fine-tune from weights: a registered NAME.TAG or any file/folder vitkit.load reads
    freeze_body: bool = False  # train the head alone (a linear probe on the pretrained features)
    train_fraction: float = 1.0  # train on this class-balanced share of the training split (learning curves)
    holdout: float = 0.0  # validate on this class-balanced share of those training images, not the val/test split
    folder_max_side: int = 128  # --dataset folder: images are held in memory at up to this many pixels a side
    # Photos (folder, shards) at the model's img_size as ImageNet training prepares them, rather than each image
    # squashed whole: evaluation resizes the short side to img_size / crop_pct and takes the centre (224 of 256:
    # 0.875, Inception's and big_vision's), and, with inception_crop, each training image is a random crop of at
    # least that share of its area and an aspect ratio in [3/4, 4/3], resized to img_size (Szegedy et al. 2015's
    # "inception crop"; big_vision's 0.05, torchvision's 0.08), drawn anew each epoch as the image is read (streamed).
    crop_pct: float | None = None
    inception_crop: float | None = None
    # the standardisation of the pixels, per channel; None: the training images' own mean and std (big_vision's
    # value_range(-1, 1) is mean 0.5, std 0.5)
    mean: list[float] | None = None
    std: list[float] | None = None
    # --dataset folder: decoded into memory, or streamed from the files by DataLoader workers; auto streams a folder
    # whose decode would not fit in the memory the process may use (data/folder.py, data/stream.py)
    data_mode: str = "auto"
    classes: list[str] | None = None  # only these classes' images, by name (--classes a,b,c); None: every class
    workers: int | None = None  # streaming: DataLoader worker processes; None = measured on the run's step
    # streaming: where the JPEGs are decoded and cut: by the workers (PIL), on the training device (torchvision's
    # decode_jpeg on the batch: nvJPEG on a GPU; data/device_decode.py), or auto (the device on a GPU, timed against
    # the workers where the budget allows; the workers on a CPU, whose cores train)
    decode: str = "auto"
    # NaFlex (SigLIP 2): every image at its own aspect ratio, resized to fit max_tokens patches, batches padded with
    # an attention mask (model/naflex.py); max_tokens None = the model's own grid at its img_size (the budget a
    # fixed-size run of that model spends per image). Streams the files.
    naflex: bool = False
    max_tokens: int | None = None
    # What the loss compares: classify (the labels, the paper's supervised training), or learning from the images
    # alone (training/objectives.py, model/ssl.py): mpp (the paper's masked patch prediction, §4.6) or mae (He et
    # al.'s masked autoencoder). Only `vitkit pretrain` sets it.
    objective: str = "classify"
    mask_ratio: float | None = None  # the share of patches masked: None = the method's own (MPP 0.5, MAE 0.75)
    mpp_target: str = "mean"  # mean (the 3-bit mean colour, 512 classes) | 4x4 (16 of them) | l2 (the patch's pixels)
    # MAE: each target patch standardised by its own mean and variance (He et al.'s); None: so, unless a continued
    # pre-training's checkpoint (--init) says otherwise: the mask ratio's rule (issue 81, S2)
    norm_pix_loss: bool | None = None
    decoder_width: int | None = None  # MAE's decoder; None = scaled to the encoder (model/ssl.py decoder_config)
    decoder_depth: int | None = None
    decoder_heads: int | None = None
    # Learning from labelled and unlabelled images in one run (issue 83): joint = the classifier's loss and MAE's on
    # the unlabelled images (Das et al., WACV 2024: a self-supervised auxiliary task beside the primary one). The
    # unlabelled images: with --train-fraction, the training split's images left out of it, and the labelled ones
    semi: str | None = None
    unlabeled: str | None = None  # a folder or zip of more images without labels (class folders, if any, ignored)
    # fixmatch (Sohn et al., NeurIPS 2020): the classifier's own confident predictions on weakly augmented unlabelled
    # images (softmax >= semi_threshold) are the targets of their strongly augmented views
    semi_weight: float | None = None  # the unlabelled loss's weight beside the labelled cross-entropy (weight 1):
    # SEMI_WEIGHT's when not given (joint 0.5, fixmatch 1: FixMatch's lambda_u)
    semi_threshold: float = 0.95  # fixmatch: the confidence a pseudo-label needs (FixMatch's tau)
    unlabeled_ratio: int = 1  # unlabelled images a step per labelled one
    # optimisation
    epochs: int = 30
    batch_size: int = 128
    grad_accum: int = 1
    # On a CUDA GPU, the batch is chosen from the measured step (training/plan.py, choose_batch): the recipe's doubled
    # as long as the images per second grow and memory allows (searched from the top down), the learning rate scaled with it, the schedule in epochs unchanged.
    # Off where the batch was given (a flag, a config file, a resumed run) and on other devices.
    gpu_batch: bool = True
    # activation checkpointing (timm's set_grad_checkpointing): each block's activations rebuilt in the backward
    # pass instead of kept, for a batch that does not fit otherwise (model/vit.Blocks)
    grad_checkpointing: bool = False
    # with several processes: FSDP2, each process holding 1/world of the weights, gradients and optimizer state
    # (training/shard.py) instead of a whole replica (DDP); auto: where a replica would not fit
    shard: bool | str = "auto"
    opt: str = "adamw"  # adamw | sgd | muon (Muon for the blocks' weight matrices, AdamW for the rest)
    adam_beta2: float = 0.999  # AdamW's second-moment decay (MAE pre-trains with 0.95)
    layer_decay: float | None = None  # fine-tuning: block i's LR times decay^(depth - i), the embeddings' the least
    muon_stem: bool = False  # opt muon: Muon for the hybrid's CNN stem filters too (each an out x in*k*k matrix)
    muon_embed: bool = False  # opt muon: Muon for the patch embedding's projection E (Eq. 1) too
    lr: float = 1e-3
    blr: float | None = None  # the learning rate per 256 images a step: lr = blr x global batch / 256 (MAE's rule)
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
    # RandAugment's strength out of 10, every operation at it (big_vision's randaug(2, 10) and timm's rand-m10: the
    # most); None: torchvision's default (9 of its 31 steps, about 3 of 10)
    aa_magnitude: int | None = None
    mixup: float = 0.0
    cutmix: float = 0.0
    model_ema: bool = False
    model_ema_decay: float = 0.999
    # machinery
    # fp32 | bf16 | fp16 | auto; compile true | false | auto; attention sdpa | exact | auto; channels_last (the conv
    # weights' memory layout) true | false | auto. "auto" is decided by timing the run's own step here, by the planner
    # (training/plan.py), which writes the concrete value into the run's config.yaml.
    precision: str = "fp32"
    compile: bool | str = False
    attention: str = "sdpa"
    channels_last: bool | str = False
    device: str = "auto"
    threads: int | None = None  # CPU intra-op threads; None = measured at the start of the run (runtime/threads.py)
    seed: int = 0
    time_limit: float | None = None  # minutes of wall time for the whole run, evaluation included
    eval_batch_size: int = EVAL_BATCH_SIZE
    eval_every: int = 1  # epochs between evaluations; the last epoch is always evaluated
    output: str | None = None
    resume: str | None = None  # a run folder, or "auto" (the --output folder if it has last/)
    # With a --time-limit: settings laid over these by how many epochs of this model the budget buys, timed at the
    # start of the run: [{below: 5, lr: 0.003, ...}, {below: 15, ...}] (the smallest `below` above the epochs wins).
    tiers: list[dict[str, Any]] | None = None
    # With a --time-limit that buys more epochs than `epochs`: the schedule grows to what the budget buys, up to this
    # many (the recipe states with its measurement where more stop helping); None: the recipe's epochs, and the rest
    # of the budget unused.
    max_epochs: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, "train config")  # YAML's `lr: 1e-3` is a string to PyYAML: taken as the number meant
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        check_keys(self.model_args, "model override", ViTConfig)
        choices = {"opt": ("adamw", "sgd", "muon"), "precision": TRAIN_PRECISIONS,
                   "aa": (None, "rand", "trivial"), "data_mode": DATA_MODES, "decode": DECODES,
                   "objective": OBJECTIVES, "semi": SEMI,
                   "mpp_target": ("mean", "4x4", "l2")}
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"{k} must be one of {allowed}, got {getattr(self, k)!r}")
        if self.compile not in (True, False, "auto", *COMPILE_MODES):
            raise ValueError(f"compile must be true, false, auto or {' or '.join(COMPILE_MODES)}, got "
                             f"{self.compile!r}")
        if self.shard not in (True, False, "auto"):
            raise ValueError(f"shard must be true, false or auto, got {self.shard!r}")
        if self.channels_last not in (True, False, "auto"):
            raise ValueError(f"channels_last must be true, false or auto, got {self.channels_last!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        check_range("train config", "folder_max_side", self.folder_max_side, 8, 4096)
        check_range("train config", "aa_magnitude", self.aa_magnitude, 0, 10)
        self._check_photo_crops()
        for k in ("epochs", "batch_size", "threads", "grad_accum", "eval_batch_size", "eval_every", "max_epochs",
                  "decoder_width", "decoder_depth", "decoder_heads", "unlabeled_ratio"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ValueError(f"{k} must be at least 1, got {getattr(self, k)}")
        if self.decoder_width is not None and self.decoder_width % 4:
            raise ValueError(f"decoder_width {self.decoder_width}: MAE's decoder has a 2-D sin-cos position embedding, "
                             "which needs a width that is a multiple of 4")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be 0 (read in the training process) or more, got {self.workers}")
        if self.classes is not None:  # (a config file's `classes: [cat, dog]`; YAML reads 0 and 1 as numbers)
            self.classes = [str(c) for c in self.classes]
            if not self.classes:
                raise ValueError("classes must name at least one class, or be left out for every class")
        if self.data_mode == "stream" and self.dataset not in FILE_DATASETS:
            raise ValueError(f"data_mode stream reads image files (--dataset {' or '.join(FILE_DATASETS)}); "
                             f"{self.dataset} is read into memory whole")
        for k, lo, hi, lo_open, hi_open in (
                ("lr", 0, None, True, False), ("min_lr", 0, None, False, False),
                ("body_lr_scale", 0, None, False, False), ("train_fraction", 0, 1, True, False),
                ("holdout", 0, 1, False, True),
                ("momentum", 0, 1, False, True), ("weight_decay", 0, None, False, False),
                ("warmup_epochs", 0, None, False, False), ("clip_grad", 0, None, False, False),
                ("smoothing", 0, 1, False, True), ("crop_padding", 0, None, False, False),
                ("mixup", 0, None, False, False), ("cutmix", 0, None, False, False),
                ("model_ema_decay", 0, 1, True, True), ("mask_ratio", 0, 1, True, True), ("blr", 0, None, True, False),
                ("adam_beta2", 0, 1, False, True), ("layer_decay", 0, 1, True, False),
                ("semi_weight", 0, None, False, False), ("semi_threshold", 0, 1, True, False)):
            check_range("train config", k, getattr(self, k), lo, hi, lo_open, hi_open)
        self._check_naflex()
        if self.semi and self.objective != "classify":
            raise ValueError(f"semi {self.semi}: learns a classifier from labelled and unlabelled images; "
                             f"{self.objective} pre-trains on images alone (vitkit pretrain)")
        if self.unlabeled and not self.semi:
            raise ValueError(f"unlabeled {self.unlabeled}: images without labels are learnt from by --semi joint or "
                             "fixmatch; give one (or leave --unlabeled out)")
        if self.semi and self.freeze_body:
            raise ValueError(f"semi {self.semi} teaches the encoder from the unlabelled images, and freeze_body trains "
                             "the head alone: one or the other")
        if self.semi and self.naflex:
            raise ValueError(f"semi {self.semi}: " + ("MAE masks a fixed grid of patches" if self.semi == "joint" else
                                                      "its strong augmentation works on images of one size")
                             + "; not with naflex")
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError(f"time_limit must be more than 0 minutes (leave it out for no limit), got "
                             f"{self.time_limit:g}")
        for i, tier in enumerate(self.tiers or []):
            check_tier(tier, i)
            try:  # its values checked now, not when the run has started
                self.with_tier(tier)
            except ValueError as e:
                raise type(e)(f"tiers[{i}]: {e}") from None

    def _check_photo_crops(self) -> None:
        for k in ("crop_pct", "inception_crop"):
            check_range("train config", k, getattr(self, k), 0, 1, lo_open=True)
        if (self.crop_pct or self.inception_crop) and self.dataset not in FILE_DATASETS:
            raise ValueError(f"crop_pct and inception_crop crop photos as they are read (--dataset "
                             f"{' or '.join(FILE_DATASETS)}); {self.dataset} is held in memory at its own size")
        if self.inception_crop and self.data_mode == "memory":
            raise ValueError("inception_crop draws a new crop of each photo every epoch as it is read: --data-mode "
                             "stream (or auto), not memory")
        if self.recipe is not None and self.recipe not in list_recipes():
            raise ValueError(f"recipe {self.recipe!r} is not shipped; the recipes: {', '.join(list_recipes())}")
        for k in ("mean", "std"):
            v = getattr(self, k)
            if v is not None and (not v or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   for x in v) or (k == "std" and min(v) <= 0)):
                raise ValueError(f"{k} must be a list of numbers, one per channel{' (each > 0)' if k == 'std' else ''}"
                                 f", got {v!r}")
        if (self.mean is None) != (self.std is None) or (self.mean and len(self.mean) != len(self.std or [])):
            raise ValueError(f"mean and std go together, one number per channel each; got mean={self.mean!r}, "
                             f"std={self.std!r}")

    def _check_naflex(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.naflex and (why := _naflex_problem(self)):
            raise ValueError(f"--naflex: {why}")
        if self.naflex and self.objective != "classify":
            raise ValueError(f"--naflex: {self.objective} masks a fixed grid of patches; pre-train on fixed-size images "
                             "(a NaFlex model fine-tunes from the encoder)")

    @property
    def needs_plan(self) -> bool:
        """Whether a setting is left to the planner (``auto``): precision, compile, attention, memory format."""
        return "auto" in (self.precision, self.compile, self.attention, self.channels_last)

    def with_tier(self, tier: dict[str, Any]) -> "TrainConfig":
        """This config with ``tier``'s settings laid over it, and no tiers: what a run trains in that tier."""
        settings = {k: v for k, v in tier.items() if k not in TIER_BOUNDS}
        return TrainConfig.from_dict(lay_over({**self.to_dict(), "tiers": None}, settings), source="tier")

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
    if isinstance(d.get("model"), dict):  # (the sources' merge looked the mapping up by name: a TypeError)
        raise ConfigError(f"{p}: model names a model (e.g. vit_tiny_patch16_224; `vitkit models` lists them), got "
                          f"the mapping {d['model']!r}: its settings go under model_args: {{depth: 6, ...}}")
    types = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
    d = {k: coerce(v, types[k], f"{p}: {k}") if k in types else v for k, v in d.items()}  # each named by its file
    if "model_args" in d and not isinstance(d["model_args"], dict):
        raise ValueError(f"{p}: model_args must be a mapping of ViTConfig keys ({{depth: 6, ...}}), got "
                         f"{d['model_args']!r}")
    if d.get("tiers") is not None and not isinstance(d["tiers"], list):
        raise ValueError(f"{p}: tiers must be a list of {{below: EPOCHS, key: value, ...}}, got {d['tiers']!r}")
    return d


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def safe_yaml(path: Path) -> Any:
    """A YAML file's plain values (no ``!!python`` tags: the safe loader refuses them; no key given twice), or an
    error naming the file."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not a plain YAML file of keys and values ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None


TIER_BOUNDS = ("below", "above")  # a tier for budgets that buy fewer epochs than N, or at least N


NAFLEX_REFUSES = {"crop_padding": 0, "aa": None, "mixup": 0.0, "cutmix": 0.0}


def _naflex_problem(cfg: "TrainConfig") -> str | None:
    if cfg.dataset not in FILE_DATASETS:
        return f"it reads image files (--dataset {' or '.join(FILE_DATASETS)}), and {cfg.dataset} is held in memory"
    if cfg.data_mode == "memory":
        return "it streams the files (each image at its own size), so not --data-mode memory"
    if cfg.init:
        return "fine-tuning pretrained weights with NaFlex batches is not built yet (--init)"
    if cfg.compile is True:
        return "each batch has its own grids, so --compile would recompile (leave compile off or auto)"
    for k, off in NAFLEX_REFUSES.items():
        if getattr(cfg, k) not in (off, None, "none"):
            return (f"{k}={getattr(cfg, k)!r} works on fixed-size image batches; NaFlex batches are patches "
                    "(horizontal flips work: --hflip)")
    return None


def check_tier(tier: Any, i: int) -> None:
    """A tier is ``{below: EPOCHS, key: value, ...}`` (budgets that buy fewer epochs) or ``{above: EPOCHS, ...}``
    (budgets that buy at least that many), with keys from ``TIER_KEYS``."""
    if not isinstance(tier, dict):
        raise ValueError(f"tiers[{i}] must be a mapping {{below: EPOCHS, key: value, ...}}, got {tier!r}")
    bounds = [k for k in TIER_BOUNDS if k in tier]
    if len(bounds) != 1:
        raise ValueError(f"tiers[{i}] needs one of below: N or above: N (a number of epochs), got {tier!r}")
    bound = tier[bounds[0]]
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < math.inf:
        raise ValueError(f"tiers[{i}] needs {bounds[0]}: N (a number of epochs, more than 0), got {bound!r}")
    if not isinstance(tier.get("model_args", {}), dict):
        raise ValueError(f"tiers[{i}]: model_args must be a mapping, got {tier['model_args']!r}")
    bad = sorted(set(tier) - TIER_KEYS - set(TIER_BOUNDS), key=str)
    if bad:
        raise ValueError(f"tiers[{i}] cannot set {bad}: a tier may set {sorted(TIER_KEYS)} (what is built after the "
                         "data is loaded and the step timed)")


def read_recipe(name: str) -> dict[str, Any]:
    """``configs/<name>.yaml`` as written, tiers and all ({} if there is no such recipe)."""
    f = resources.files("vitkit") / "configs" / f"{name}.yaml"
    return yaml.safe_load(f.read_text()) or {} if f.is_file() else {}


def describe_changes(before: dict[str, Any], after: dict[str, Any], before_model: dict[str, Any] | None = None
                     ) -> list[str]:
    """``["lr 0.001 -> 0.002", "depth 6 -> 3"]``: what the settings ``after`` change of ``before``, ``model_args`` key
    by key (against ``before_model`` when given: the model's full config rather than its overrides)."""
    model = before.get("model_args", {}) if before_model is None else before_model
    pairs = [(k, before.get(k), v) for k, v in after.items() if k != "model_args"]
    pairs += [(k, model.get(k), v) for k, v in after.get("model_args", {}).items()]
    return [f"{k} {a} -> {b}" for k, a, b in pairs if a != b]


def list_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in (resources.files("vitkit") / "configs").iterdir() if p.name.endswith(".yaml"))
