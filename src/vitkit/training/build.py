"""Building a run's parts from a TrainConfig: the data, the model (new, or from weights for fine-tuning), its
preprocessing, and the model as it trains (attention path, DDP, torch.compile). The Trainer calls these; so can
anyone assembling their own loop."""
from __future__ import annotations

import warnings

from typing import Any, Callable

import torch
import torch.nn as nn

from ..data.augment import BatchAugment
from ..data.datasets import DataSplits, load_dataset
from ..data.images import crop_spec
from ..data.naflex import NaFlexImages, as_naflex
from ..interop.pretrained import init_image_size, init_preprocessing, load_init
from ..model.config import ViTConfig, to_2tuple
from ..model.fields import check_range
from ..model.hub import ADAPTABLE
from ..model.registry import get_config
from ..model.vit import VisionTransformer, set_attention
from ..runtime.compile import compile_for_training
from ..runtime.device import resolve_device
from ..runtime.memory import available_memory
from .config import TrainConfig


def build_data(cfg: TrainConfig, say: Callable[[str], None] | None = None) -> DataSplits:
    """The dataset the config names, decoded into memory (cached in ``cfg.cache_dir``) or, for a folder that
    would not fit (or ``data_mode: stream``), streamed from its files."""
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.download, cfg.skip_bad_images, cfg.cache_dir,
                        max_side=cfg.folder_max_side, crop=run_crop(cfg.to_dict()),
                        mode="stream" if cfg.naflex else cfg.data_mode, say=say,
                        unlabeled=cfg.objective != "classify", classes=cfg.classes)
    return for_run(cfg, data)


def for_run(cfg: TrainConfig, data: DataSplits, say: Callable[[str], None] | None = None) -> DataSplits:
    """``data`` as the run reads it: with ``--naflex``, both splits as NaFlex batches (data/naflex.py) of the model's
    patch, at most ``max_tokens`` patches an image (the model's own grid's count unless given)."""
    if not cfg.naflex or isinstance(data.train, NaFlexImages):
        return data
    c = model_config(cfg, data)
    if c.hybrid:  # (a recipe's stem is said where the recipe is read: sources.py)
        raise ValueError(f"--naflex: {cfg.model} has a CNN stem (hybrid={c.hybrid!r}), whose patches are cut from its "
                         "feature map, not the image: NaFlex needs a plain ViT (--hybrid none, or a --model without a "
                         "stem)")
    grid = c.grid_size[0] * c.grid_size[1]
    tokens = cfg.max_tokens or grid
    check_naflex_budget(tokens, grid, c, say, resolve_device(cfg.device))
    return as_naflex(data, c.patch_size, tokens)


NAFLEX_FAR_ABOVE = 4  # a budget this many times the model's own grid: said (its position embeddings are resampled
# far beyond what they were trained at, and every step costs the square of the tokens in attention)


def check_naflex_budget(tokens: int, grid: int, c: ViTConfig, say: Callable[[str], None] | None,
                        device: torch.device = torch.device("cpu")) -> None:
    """Refuse a ``--max-tokens`` whose attention alone cannot fit in the memory the step runs in (the host's this
    process may use, or a GPU's free memory; one image's scores, probabilities and their gradient in each head:
    100,000 tokens are 120 GB a head), and say one far above the model's grid."""
    one_image = 3 * c.num_heads * tokens ** 2 * 4  # fp32 scores, probabilities, their gradient: (heads, L, L) each
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = (free, f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on {device}")
    else:
        memory = available_memory()
        room = (memory.available, f"this process may use {memory.describe()}") if memory is not None else None
    if room is not None and one_image > room[0]:
        raise ValueError(f"--max-tokens {tokens:,}: one image's attention alone takes {one_image / 2**30:,.1f} GiB "
                         f"({c.num_heads} heads x {tokens:,}^2 scores, probabilities and their gradient), and "
                         f"{room[1]}; the model's own grid is {grid} patches: a budget near it, or a few times it, "
                         "trains")
    if tokens > NAFLEX_FAR_ABOVE * grid and say is not None:
        say(f"--max-tokens {tokens:,} is {tokens / grid:.0f} times the model's own grid ({grid} patches): its position "
            "embeddings are resampled far beyond their size, and each step's attention costs the square of the "
            "tokens")


def model_config(cfg: TrainConfig, data: DataSplits) -> ViTConfig:
    """The preset with the data's classes and channels, at the data's own size where the preset's patches tile it."""
    # pre-training from the images alone: an encoder with no head (`--init` of its checkpoint adds one)
    classes = data.num_classes if cfg.objective == "classify" else 0
    overrides = {"num_classes": classes, "in_chans": data.in_chans, **cfg.model_args}
    if "img_size" not in cfg.model_args:  # the data's own size, where the preset's patches tile it
        preset = get_config(cfg.model)
        p = to_2tuple(preset.patch_size)[0] * preset.input_stride
        if data.img_size[0] % p == 0 and data.img_size[1] % p == 0:
            overrides["img_size"] = data.img_size
    return get_config(cfg.model, **overrides)


RESIDENT_SHARE = 0.25  # of the GPU's free memory a dataset may take to live there


def resident(data: DataSplits, device: torch.device, log: Callable[[str], None] = print) -> DataSplits:
    """On a GPU, a dataset that fits in a quarter of its free memory lives there as uint8 (Fashion-MNIST: 55 MB,
    CIFAR-10: 184 MB): each batch is cut and augmented on the GPU, with no per-image CPU work and no copy per step.
    Elsewhere, and for larger sets, the data stays in host memory and each batch is copied."""
    size = resident_bytes(data, device)
    if not size:
        return data
    log(f"dataset on {device} as uint8 ({size / 2**20:.0f} MiB): batches are cut and augmented there")
    return data.to(device)


def resident_bytes(data: DataSplits, device: torch.device) -> int:
    """The GPU memory ``resident`` will give ``data`` (0: it stays in host memory). The planner takes it from the
    free memory before it sizes the batch, which is chosen before the data moves."""
    if device.type != "cuda" or data.streamed or data.train.images.device.type == "cuda":
        return 0
    size = sum(t.images.nbytes + t.labels.nbytes for t in (data.train, data.val))
    free, _ = torch.cuda.mem_get_info(device)
    return size if size <= RESIDENT_SHARE * free else 0


def init_crop(init: str | None, model_args: dict[str, Any]) -> dict[str, Any] | None:
    """Fine-tuning pretrained weights on a folder: its photos resized and centre-cropped as the weights' publisher
    prepared theirs, the preprocessing the checkpoint keeps and predict, serve and eval apply, so training,
    evaluation and use see the same pixels (squashing every photo to one shape would distort some and not others)."""
    if not init:
        return None
    return crop_spec(init_preprocessing(init), model_args.get("img_size") or init_image_size(init))


def run_crop(settings: dict[str, Any]) -> dict[str, Any] | None:
    """How a run's photos are cut (``images.crop_spec``), from its settings (a TrainConfig's, or the layered dict
    before there is one): the weights' own geometry when fine-tuning, ``crop_pct``'s centre crop for evaluation, and
    ``inception_crop``'s random crops for training (``train_area``: the share of the image's area a crop may
    cover); None: every image resized whole."""
    model_args = settings.get("model_args") or {}
    spec = init_crop(settings.get("init"), model_args)
    crop_pct, area = (_fraction(settings, k) for k in ("crop_pct", "inception_crop"))  # before any file is read
    if not spec and not crop_pct and not area:
        return None
    if not spec:
        model = settings.get("model")
        size = model_args.get("img_size") or (get_config(model).img_size if model else None)
        if size is None:  # the recipe is chosen from the images, after they are read: its size is not known yet
            raise ValueError("--crop-pct and --inception-crop cut photos to the size the model reads: give "
                             "--img-size N (or a --model or --recipe, whose size it is)")
        h, w = to_2tuple(size)
        spec = {"img_size": [h, w], "crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear"}
    if crop_pct:
        spec = {**spec, "crop_pct": float(crop_pct), "crop_mode": "center"}
    return {**spec, "train_area": [float(area), 1.0]} if area else spec


def _fraction(settings: dict[str, Any], key: str) -> float | None:
    """``settings[key]`` as a share in (0, 1], or None; YAML's ``8e-2`` arrives as text and is taken as meant."""
    v = settings.get(key)
    if v is None:
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"train config: {key} must be a number, got {v!r}") from None
    check_range("train config", key, v, 0, 1, lo_open=True)
    return v


def build_model(cfg: TrainConfig, data: DataSplits) -> VisionTransformer:
    """The preset with the data's classes and channels; ``--init`` loads weights (new head, resampled grid); with
    ``grad_checkpointing``, its blocks checkpointed (model/vit.Blocks)."""
    model = _built_model(cfg, data)
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    return model


def _built_model(cfg: TrainConfig, data: DataSplits) -> VisionTransformer:
    if cfg.init:
        # the architecture comes from the weights; only what fine-tuning may change is taken from the config
        classes = data.num_classes if cfg.objective == "classify" else 0  # (pre-training: an encoder, no head)
        overrides = {"num_classes": classes, "in_chans": data.in_chans, **cfg.model_args}
        model = load_init(cfg.init, **{k: v for k, v in overrides.items() if k in ADAPTABLE})
        if model.config.in_chans != data.in_chans:
            raise ValueError(f"--init {cfg.init} expects {model.config.in_chans}-channel images but {data.name} has "
                             f"{data.in_chans}")
        return model
    return VisionTransformer(model_config(cfg, data))


def preprocessing_for(cfg: TrainConfig, model: VisionTransformer, data: DataSplits) -> dict[str, Any]:
    """Mean, std and class names saved with every checkpoint. Fine-tuning keeps the weights' own statistics."""
    pre = getattr(model, "preprocessing", None) or {}
    if cfg.mean is not None:
        if len(cfg.mean) != model.config.in_chans:
            raise ValueError(f"mean {cfg.mean} and std {cfg.std}: one number per channel, and {data.name} has "
                             f"{model.config.in_chans}")
        mean, std = cfg.mean, cfg.std
    elif cfg.init and len(pre.get("mean") or []) == model.config.in_chans:
        mean, std = pre["mean"], pre["std"]
    else:
        mean, std = data.mean_std()
    naflex = {"naflex_max_tokens": data.train.max_tokens} if isinstance(data.train, NaFlexImages) else {}
    names = {"class_names": data.classes} if cfg.objective == "classify" else {}  # an encoder has no classes
    # the evaluation geometry the run's photos had, kept with the weights: eval, predict and serve cut the same way
    crop = {k: v for k, v in (run_crop(cfg.to_dict()) or {}).items() if k in ("crop_pct", "crop_mode", "interpolation")}
    return {"mean": mean, "std": std, **names, **naflex, **crop}


def augment_for(cfg: TrainConfig, preprocessing: dict[str, Any], c: ViTConfig) -> BatchAugment:
    """The batch augmentation the run trains with (its standardisation, crops, flips, RandAugment, MixUp/CutMix):
    the trainer's, and the planner's timed step's, so that what is timed is what trains."""
    return BatchAugment(preprocessing["mean"], preprocessing["std"], to_2tuple(c.img_size), c.num_classes,
                        cfg.crop_padding, cfg.hflip, cfg.aa, mixup=cfg.mixup, cutmix=cfg.cutmix,
                        aa_magnitude=cfg.aa_magnitude)


def model_for_training(model: nn.Module, cfg: TrainConfig, device: torch.device, world: int,
                       log: Callable[[str], None] = print, sharded: bool = False) -> nn.Module:
    """``model`` as the training step calls it: the attention path and memory layout the config names (decided by
    the planner when ``auto``), wrapped in DDP when there are several processes, compiled if ``cfg.compile``. Its
    parameters are ``model``'s own. ``sharded``: FSDP2 holds it already (training/shard.py), laid out before."""
    if cfg.needs_plan:
        raise ValueError("model_for_training needs a planned config (no 'auto' left): vitkit.training.plan(cfg)")
    search_convolutions(device)
    if sharded:
        return model
    apply_layout(model, cfg.attention, cfg.channels_last)
    if world > 1:  # (a pre-trained encoder's unused parts, e.g. a GAP model's fc_norm, are no error)
        # DDP compares a gradient's strides with its bucket's literally: a weight with a dimension of size 1 (a
        # one-channel image's patch embedding, D x 1 x P x P) lies in memory the same either way, yet warned on
        # every process. The layout is set before the wrap (above) and not changed under DDP (training/tune.py
        # runs on one process), so no real mismatch is hidden.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                    find_unused_parameters=cfg.objective != "classify")
    return compile_for_training(model, device, log, cfg.compile if isinstance(cfg.compile, str) else None) \
        if cfg.compile else model


def search_convolutions(device: torch.device) -> None:
    """On a GPU, cuDNN times its convolution algorithms for each shape once and keeps the fastest (a run's steps have
    fixed shapes: the stem's and the patch embedding's search is paid once). Set before the planner times any step
    too: its candidates were timed without it and the run trained with it (issue 80, N10)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def apply_layout(model: nn.Module, attention: str, channels_last: bool) -> None:
    """The attention implementation and the memory layout of the conv weights (a hybrid's stem, the patch
    embedding's E) a run trains with."""
    set_attention(model, attention)
    # (moves only 4-D tensors; back to the default layout too: the run's first steps may time both, training/tune.py)
    model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
