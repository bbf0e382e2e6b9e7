"""What a run was asked, layered: the shipped recipe (``configs/<dataset>.yaml``, ``finetune.yaml`` with ``--init``,
or for a folder the recipe its images call for), a ``--config`` file, the flags; a ``--resume``'s saved config.
The planner (plan.py) then decides every ``auto`` in the result."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..data.datasets import FILE_DATASETS, DataSplits, default_cache_dir, load_dataset
from ..interop.pretrained import init_image_size, init_preprocessing
from ..model.config import to_2tuple
from ..model.registry import get_config
from .budget import budget_left
from .build import init_crop, run_crop
from .checkpoint import recover_run
from .config import (NAFLEX_REFUSES, TIER_BOUNDS, TrainConfig, lay_over, list_recipes, read_recipe, read_yaml,
                     safe_yaml)
from .recipes import choose_recipe, flips_change_labels


@dataclass
class Sources:
    """What a run was asked: flags (``given``, TrainConfig keys), model overrides from flags, a config file."""

    given: dict[str, Any] = field(default_factory=dict)
    model_args: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    started: float | None = None  # when the process began (time.time()): a --time-limit counts from there


def resolve(src: Sources, say: Callable[[str], None] = print,
            progress: Callable | None = None) -> tuple[TrainConfig, DataSplits | None, str | None]:
    """The layered TrainConfig (``auto`` still in it), the data if it had to be read to choose the recipe, and the
    recipe's name. Tiers keep none of the settings the user gave (the user's file and flags win there too)."""
    given = dict(src.given)
    file_cfg = read_yaml(src.config_file) if src.config_file else {}
    resume = given.get("resume") or file_cfg.get("resume")
    saved: dict[str, Any] = {}
    if resume:
        run_dir = Path(resume if resume != "auto" else (given.get("output") or file_cfg.get("output") or ""))
        recover_run(run_dir)  # a save killed between its two renames left .last.old: that is last/ again
        if not (run_dir / "last").exists():
            if resume != "auto" and not (run_dir / "plan.json").is_file():
                raise FileNotFoundError(f"--resume {resume}: no run there (no last/ checkpoint, no plan.json)")
            if resume != "auto":  # a run killed before its first checkpoint: it starts over in its folder
                given.setdefault("output", str(run_dir))
                if (run_dir / "config.yaml").is_file():  # ... as that run: its own settings, not the defaults (a
                    # tiny run's folder named alone started the digits recipe's 40 epochs of another model there)
                    saved = {k: v for k, v in safe_yaml(run_dir / "config.yaml").items()
                             if k not in ("resume", "few_epochs")}
                    say(f"--resume {resume}: no last/ checkpoint to continue; the run starts over with its own "
                        f"settings ({run_dir / 'config.yaml'})")
            given.pop("resume", None), file_cfg.pop("resume", None)  # nothing to resume: a fresh run
        elif (run_dir / "config.yaml").is_file():
            other = given.get("output") or file_cfg.get("output")
            if other and Path(other).resolve() != run_dir.resolve():  # it would resume there and write another folder
                raise ValueError(f"--resume {resume} continues that run in its own folder, {run_dir}; --output "
                                 f"{other} names another: leave --output out (a new run in {other}: leave --resume "
                                 "out)")
            saved = safe_yaml(run_dir / "config.yaml")
            saved.pop("few_epochs", None)  # a run folder of vitkit before tiers: that key was decided already
            given["resume"] = str(run_dir)
            given.setdefault("output", str(run_dir))
        else:
            raise FileNotFoundError(f"--resume {resume}: {run_dir / 'config.yaml'} not found")
    if saved and given.get("resume"):
        _check_same_model(saved, {**file_cfg, **given}, {**file_cfg.get("model_args", {}), **src.model_args},
                          given["resume"])
    recipe = None if saved else given.get("recipe") or file_cfg.get("recipe")
    shipped = _shipped_recipe(recipe) if recipe else {}
    dataset = given.get("dataset") or file_cfg.get("dataset") or saved.get("dataset") or shipped.get("dataset") \
        or "digits"
    merged: dict[str, Any] = {"dataset": dataset}
    init = given.get("init") or file_cfg.get("init")
    objective = given.get("objective") or file_cfg.get("objective") or saved.get("objective") or "classify"
    # fine-tuning supervised weights: the paper's recipe (finetune.yaml); a self-supervised encoder (vitkit pretrain's
    # checkpoint, its objective's parts beside it) fine-tunes as MAE's does: the dataset's own recipe, AdamW, layer
    # decay (finetune.yaml's SGD without crops measured 51.01% against 53.78% from scratch on CIFAR-10's 10%)
    self_supervised = bool(init) and objective == "classify" and _pretrained_by_vitkit(init)
    finetune = bool(init) and objective == "classify" and not self_supervised
    data, name = None, None
    if not saved:
        if init:  # fine-tuning: held at the weights' resolution, so nothing is lost to a smaller copy
            size = src.model_args.get("img_size") or init_image_size(init)
            merged["folder_max_side"] = max(size) if isinstance(size, tuple) else size
        if dataset in FILE_DATASETS:
            probe = lay_over(lay_over(shipped, file_cfg), {**given, "model_args": src.model_args})
            wanted = src.model_args.get("img_size") or file_cfg.get("model_args", {}).get("img_size")
            if "folder_max_side" in probe:  # the user's own
                merged["folder_max_side"] = probe["folder_max_side"]
            elif wanted and not init and max(to_2tuple(wanted)) > 128:  # photos kept at the size the model reads
                merged["folder_max_side"] = max(to_2tuple(wanted))
                say(f"photos kept at up to {merged['folder_max_side']} px a side, the --img-size the model reads "
                    "(128 otherwise; --folder-max-side N to choose)")
            data = load_dataset(dataset, probe.get("data_dir"), False, probe.get("skip_bad_images", False),
                                probe.get("cache_dir") or default_cache_dir(), progress=progress,
                                max_side=merged.get("folder_max_side", 128), crop=run_crop(probe),
                                mode="stream" if probe.get("naflex") else probe.get("data_mode", "auto"), say=say,
                                unlabeled=probe.get("objective", "classify") != "classify",
                                budget_s=budget_left(probe["time_limit"], src.started)
                                if probe.get("time_limit") and src.started else None, classes=probe.get("classes"))
            name = recipe or ("finetune" if finetune else choose_recipe(data))
            say(f"recipe{'' if recipe else ' for this folder'}: configs/{name}.yaml ({data.describe()})")
        else:
            name = recipe or ("finetune" if finetune else dataset)
            if finetune:  # read now: the recipe's batch of 512 is fitted to the training images (_fit_accumulation)
                probe = {**file_cfg, **given}
                data = load_dataset(dataset, probe.get("data_dir"), probe.get("download", False),
                                    cache_dir=probe.get("cache_dir") or default_cache_dir(),
                                    classes=probe.get("classes"))
        if finetune:
            say(f"--init {init}: the paper's fine-tuning recipe, configs/finetune.yaml (SGD momentum 0.9, no weight "
                "decay, cosine decay, gradient clipping at 1, new zero head; with the official code's linear warmup; "
                "position embeddings resampled to the training size; a --config file or flags override it)")
            if not init_preprocessing(init).get("mean") and Path(init).is_file():
                say(f"--init {init}: the file carries no preprocessing, so images are standardised with the "
                    "dataset's own mean and std; for weights published with theirs (and a resize + crop), `vitkit "
                    f"import {init} --preprocessing NAME.TAG --out DIR`, then --init DIR")
            crop = init_crop(init, src.model_args) if dataset in FILE_DATASETS else None
            if crop:
                h, w = crop["img_size"]
                say(f"photos prepared as the weights' publisher prepares them, for training, eval, predict and serve "
                    f"alike: short side to {h / crop['crop_pct']:.0f} ({crop['interpolation']}), centre {h}x{w} crop")
        merged.update({k: v for k, v in (shipped or read_recipe(name)).items() if k != "dataset"})
        users_model = given.get("model") or file_cfg.get("model")
        if users_model and users_model != merged.get("model"):
            _for_users_model(merged, users_model, {**file_cfg.get("model_args", {}), **src.model_args}, name, say)
        if self_supervised:
            _for_self_supervised_encoder(merged, init, name, {**file_cfg, **given}, say)
        if objective != "classify":
            _for_pretraining(merged, objective, {**file_cfg.get("model_args", {}), **src.model_args}, data, name,
                             {**file_cfg, **given}, say, bool(init))
        if data is not None and merged.get("hflip") and flips_change_labels(data):
            merged["hflip"] = False
            if "hflip" not in given and "hflip" not in file_cfg:
                say("no horizontal flips: small grayscale images are often digits or characters, which a flip "
                    "changes (--hflip to flip anyway)")
        if {**file_cfg, **given}.get("naflex"):
            _without_fixed_size_augmentation(merged, {**file_cfg, **given}, say)
            stem = merged.get("model_args", {}).get("hybrid")
            if stem and "hybrid" not in {**file_cfg.get("model_args", {}), **src.model_args}:
                raise ValueError(f"--naflex: configs/{name}.yaml, the recipe for these images, gives "
                                 f"{merged.get('model')} a CNN stem (hybrid={stem!r}), whose patches are cut from its "
                                 "feature map, not the image: NaFlex needs a plain ViT: --hybrid none with a "
                                 "--patch-size for the pixels, or a --model of your own")
    for layer in (saved, file_cfg, given, {"model_args": src.model_args}):
        merged = lay_over(merged, layer)  # a --config or flag changing the depth keeps the recipe's width
    if saved and merged.get("semi") == "auto" and "semi" in saved:  # (the same command again, with --resume)
        merged["semi"], merged["unlabeled"] = saved["semi"], saved.get("unlabeled")  # decided at the run's start
    if not saved:
        _one_learning_rate(merged, {**file_cfg, **given}, say)
    merged.setdefault("cache_dir", default_cache_dir())
    if merged.get("init") and "model" not in given and "model" not in file_cfg and not saved:
        merged["model"] = None  # the weights say the architecture: config.yaml named the default preset instead
    if (saved or "batch_size" in given or "batch_size" in file_cfg) and "gpu_batch" not in given:
        merged["gpu_batch"] = False  # the batch the user (or the run being resumed) chose stays
    if merged.get("tiers") and "tiers" not in given and "tiers" not in file_cfg:
        merged["tiers"] = _without_users_keys(merged["tiers"], {**file_cfg, **given},
                                              {**file_cfg.get("model_args", {}), **src.model_args})
    if not saved:
        _for_fixmatch(merged, {**file_cfg, **given}, say)
    _epochs_within_max(merged, {**file_cfg, **given}, say)
    if init and not saved and data is not None:
        n_train = len(data.with_train_fraction(merged.get("train_fraction", 1.0),
                                                  holdout=merged.get("holdout", 0.0)).train)  # what the run trains on
        _fit_accumulation(merged, n_train, "grad_accum" in given or "grad_accum" in file_cfg, say)
    return TrainConfig.from_dict(merged, source="train config"), data, name


def _for_fixmatch(merged: dict[str, Any], users: dict[str, Any], say: Callable[[str], None]) -> None:
    """``--semi fixmatch`` trains without the recipe's label smoothing (FixMatch's own recipe has none), unless the
    user set it: smoothing 0.1 over CIFAR-10's 10 classes trains the softmax towards 0.91 at most, under the 0.95 a
    pseudo-label needs, and a 30-minute run at 10% of the labels found 0% of them confident in 12 epochs out of 12
    (AVX512-BF16 EPYC, 2026-12-05): FixMatch was a slower supervised run."""
    if merged.get("semi") != "fixmatch" or not merged.get("smoothing") or "smoothing" in users:
        return
    say(f"--semi fixmatch: no label smoothing (the recipe's {merged['smoothing']:g} caps the softmax a "
        "pseudo-label's confidence is read from: 0.1 over 10 classes at 0.91, under FixMatch's 0.95; FixMatch "
        "trains without it; --smoothing to set one)")
    merged["smoothing"] = 0.0
    if merged.get("tiers"):
        merged["tiers"] = _without_users_keys(merged["tiers"], {"smoothing": 0.0}, {})


def _epochs_within_max(merged: dict[str, Any], users: dict[str, Any], say: Callable[[str], None]) -> None:
    """``max_epochs`` below ``epochs``: the recipe's epochs are capped there, and said (``--max-epochs 1`` on digits'
    40 epochs was silently not used, and the run trained 21 epochs); with both given by the user, refused."""
    top, epochs = merged.get("max_epochs"), merged.get("epochs")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1 or epochs is None or top >= epochs:
        return  # (a max_epochs that is no count at all is the config's check to name)
    if "epochs" in users:
        raise ValueError(f"--max-epochs {top} is below --epochs {epochs}: max_epochs is the most a --time-limit may "
                         "grow the schedule to; give --epochs N alone to train N epochs")
    warmup = merged.get("warmup_epochs") or 0
    merged.update(epochs=top, warmup_epochs=warmup * top / epochs)
    say(f"epochs: the recipe's {epochs} capped at --max-epochs {top} (its warmup in proportion)")


SELF_SUPERVISED_LAYER_DECAY = 0.75  # MAE's fine-tuning takes 0.65-0.75 (its code: 0.65 for ViT-B, 0.75 for ViT-L
# and ViT-H); the self-supervision claim and its pages use 0.75 for the small encoders trained here
# MAE's fine-tuning regularisation (He et al., Table 9: MixUp 0.8, CutMix 1.0, drop path 0.1; RandAugment and random
# erasing left out: per-image PIL work the step waits for on a small machine). On CIFAR-10's 10% one pre-training
# fine-tuned 66.97% without it and 68.08% with it (results/self-supervision-hybrid.csv). Under FEW_EPOCHS epochs the
# mixing is left out: the recipes' few-epoch boundary (configs/cifar10.yaml), where it costs more than it gives.
FINETUNE_MIXING = {"mixup": 0.8, "cutmix": 1.0}
FINETUNE_DROP_PATH = 0.1
FEW_EPOCHS = 20


def _pretrained_by_vitkit(init: str) -> bool:
    """Whether ``--init`` is a self-supervised checkpoint of vitkit pretrain's (ssl.json beside its encoder)."""
    from ..model.ssl import SSL_CONFIG  # (the model layer's name for the file)

    return Path(init).is_dir() and (Path(init) / SSL_CONFIG).is_file()


def _for_self_supervised_encoder(merged: dict[str, Any], init: str, recipe: str, users: dict[str, Any],
                                 say: Callable[[str], None]) -> None:
    """``--init`` of a pre-trained encoder: the dataset recipe's augmentation, schedule and batch with AdamW, layer
    decay and MAE's regularisation (MixUp, CutMix, drop path), as MAE fine-tunes; the recipe's model settings and
    tiers are the scratch model's, not the encoder's, and are left out (the architecture is the weights'), and a
    budget of few epochs fine-tunes without the mixing."""
    merged["model_args"] = {"drop_path_rate": FINETUNE_DROP_PATH}  # the user's --drop-path is laid over it
    merged["tiers"] = [{"below": FEW_EPOCHS, **{k: 0.0 for k in FINETUNE_MIXING}}]
    if merged.get("opt") != "adamw" and "opt" not in users:
        merged["opt"] = "adamw"
    if "layer_decay" not in users:
        merged["layer_decay"] = SELF_SUPERVISED_LAYER_DECAY
    merged.update({k: v for k, v in FINETUNE_MIXING.items() if k not in users})
    say(f"--init {init}: a self-supervised encoder, fine-tuned as MAE's are: configs/{recipe}.yaml's augmentation, "
        f"schedule and batch, AdamW, layer decay {merged.get('layer_decay')}, MixUp {FINETUNE_MIXING['mixup']}, "
        f"CutMix {FINETUNE_MIXING['cutmix']} (left out where the budget buys under {FEW_EPOCHS} epochs), drop path "
        f"{FINETUNE_DROP_PATH:g} (flags override; finetune.yaml is for supervised weights)")


def _one_learning_rate(merged: dict[str, Any], users: dict[str, Any], say: Callable[[str], None]) -> None:
    """``--lr`` against a recipe's ``blr`` (the pre-training recipes' learning rate per 256 images): the user's lr
    is the run's, said in a line (the blr, applied after planning, replaced it without a word); both given is
    refused, as two answers to one question."""
    if "lr" not in users or merged.get("blr") is None:
        return
    if "blr" in users:
        raise ValueError(f"--lr {users['lr']} and --blr {users['blr']} both set the learning rate (lr = blr x the "
                         "global batch / 256): give one")
    say(f"--lr {users['lr']}: the learning rate as given, for any batch (the recipe's blr {merged['blr']:g} per 256 "
        "images is not used)")
    merged["blr"] = None


def _shipped_recipe(name: str) -> dict[str, Any]:
    """``--recipe NAME``: configs/NAME.yaml, or an error listing the shipped recipes."""
    if name not in list_recipes():
        raise ValueError(f"--recipe {name}: no such shipped recipe; the recipes: {', '.join(list_recipes())}")
    return read_recipe(name)


MIN_GRID = 7  # pre-training cuts patches so the grid has at least this many a side (MAE's encoder sees a quarter)


def _for_pretraining(merged: dict[str, Any], objective: str, users_args: dict[str, Any], data: DataSplits | None,
                     recipe: str, users: dict[str, Any], say: Callable[[str], None], init: bool = False) -> None:
    """``vitkit pretrain``: the dataset recipe's model under configs/pretrain-<method>.yaml's optimisation, its tiers
    (for supervised training's short budgets) left out: a hybrid with a conv: stem as it is (the stem runs masked,
    model/masked_stem.py), so that ``vitkit train --init`` fine-tunes the model the recipe trains; a plain ViT (or one
    whose stem has no masked form) with patches small enough for a grid of at least ``MIN_GRID`` a side (2 pixels at
    least). From weights (``init``), their own architecture."""
    merged.update({k: v for k, v in read_recipe(f"pretrain-{objective}").items() if k != "dataset"})
    merged["tiers"] = None
    args = {} if init else dict(merged.get("model_args", {}))
    said = []
    stem = args.get("hybrid") if "hybrid" not in users_args else None
    if stem and stem.startswith("conv:"):  # the recipe's own model, pre-trained: its stem runs masked, layer by layer
        how = "run on each visible cell alone" if objective == "mae" else "masked at every layer"
        said.append(f"configs/{recipe}.yaml's hybrid, its CNN stem {stem} {how} (the hidden patches' pixels reach "
                    "nothing)")
    elif stem:
        said.append(f"without configs/{recipe}.yaml's CNN stem ({args.pop('hybrid')}: masked pre-training knows the "
                    "conv: stems' layers, not this one's)")
    size = users_args.get("img_size", args.get("img_size")) or (data.img_size if data is not None else None)
    if users_args.get("hybrid", args.get("hybrid")) not in (None, "", "none"):
        size = None  # a hybrid keeps its patches (of the feature map): the model fine-tuned is this one
    users_patch = _own_patch(users.get("model"), size)
    if users_patch is not None and "patch_size" not in users_args:  # a --model of the user's: its own patches
        args["patch_size"] = users_patch
    elif size is not None and "patch_size" not in users_args:
        h, w = to_2tuple(size)
        fits = [p for p in range(2, min(h, w) + 1) if h % p == 0 and w % p == 0 and min(h, w) // p >= MIN_GRID]
        patch = max(fits) if fits else 2 if h % 2 == 0 and w % 2 == 0 else 1
        if args.get("patch_size") != patch:
            said.append(f"patches of {patch} ({h // patch}x{w // patch} a grid)")
            args["patch_size"] = patch
    merged["model_args"] = args
    if data is not None and "batch_size" not in users:  # a small folder: at least 8 steps an epoch (the learning
        n = len(data.train)  # rate follows the batch: blr)
        batch = merged.get("batch_size", 256)
        while batch > 8 and n // batch < 8:
            batch //= 2
        if batch != merged.get("batch_size"):
            said.append(f"batch {batch} ({n} training images: 8 steps an epoch at least)")
            merged["batch_size"] = batch
    if said:
        say(f"pre-training ({objective}): {merged.get('model')}, " + ", ".join(said))


def _own_patch(model: str | None, size: Any) -> int | None:
    """The patch size of the user's ``--model`` where it tiles ``size`` (None: no model of the user's, or it does
    not tile, and the pre-training chooses one)."""
    if not model or size is None:
        return None
    patch = to_2tuple(get_config(model).patch_size)[0]
    return patch if all(s % patch == 0 for s in to_2tuple(size)) else None


def _for_users_model(merged: dict[str, Any], model: str, users_args: dict[str, Any], recipe: str,
                     say: Callable[[str], None]) -> None:
    """A ``--model`` other than the recipe's is that model: the recipe's settings for its own model (width, depth,
    heads, a CNN stem; its tiers' too) are left out, with a line. (They were laid over any --model: ``--model
    vit_small_patch16_224`` on a folder trained a ViT-S with patches of 8, on CIFAR-10 one of width 128 behind a
    convolutional stem.) The recipe's image size is the data's and stays; its patch size stays only where the
    model's own does not tile that size."""
    ours = dict(merged.get("model_args", {}))
    keep = {"img_size": ours["img_size"]} if "img_size" in ours else {}
    own_patch = get_config(model).patch_size
    size = users_args.get("img_size", keep.get("img_size"))
    if "patch_size" in ours and size is not None and any(s % own_patch for s in to_2tuple(size)):
        keep["patch_size"] = ours["patch_size"]
    left_out = {k: v for k, v in ours.items() if k not in keep and k not in users_args}
    merged["model_args"] = keep
    if merged.get("tiers"):
        merged["tiers"] = [{k: v for k, v in t.items() if k != "model_args"} for t in merged["tiers"]]
    if left_out or "patch_size" in keep:
        said = ", ".join(f"{k} {v}" for k, v in left_out.items())
        say(f"--model {model}: configs/{recipe}.yaml's settings for its own model ({merged.get('model')})"
            + (f" are left out: {said}" if said else "")
            + (f"; its patch size {keep['patch_size']} is kept, since {model}'s {own_patch} does not tile "
               f"{size} px (--patch-size to choose)" if "patch_size" in keep else ""))


def _without_fixed_size_augmentation(merged: dict[str, Any], users: dict[str, Any], say: Callable[[str], None]
                                     ) -> None:
    """--naflex: the recipe's augmentations that cut fixed-size image batches are left out, with a line saying so
    (the user's own are refused by TrainConfig)."""
    dropped = [f"{k} {merged.pop(k)}" for k, off in NAFLEX_REFUSES.items()
               if k not in users and merged.get(k) not in (off, None, "none")]
    if dropped:
        say(f"--naflex: without the recipe's {', '.join(dropped)} (they work on fixed-size image batches; NaFlex "
            "batches are patches, flipped as images)")


def _check_same_model(saved: dict[str, Any], users: dict[str, Any], users_model: dict[str, Any], run: str) -> None:
    """A resume continues the run's own model on its own data: a --model, --init, model flag or --data-dir that
    differs would relabel the run without changing its weights (another folder's classes trained onto its head)."""
    def same(a: Any, b: Any) -> bool:
        return (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)

    was, now = saved.get("objective") or "classify", users.get("objective")
    if now is not None and was != now:  # what the run is, and the command that resumes it (its module and checkpoint are that one's)
        what = {"classify": "a supervised run (vitkit train)", "mae": "an MAE pre-training (vitkit pretrain --method "
                "mae)", "mpp": "an MPP pre-training (vitkit pretrain --method mpp)"}
        again = "vitkit train" if was == "classify" else f"vitkit pretrain --method {was}"
        raise ValueError(f"--resume {run}: it is {what.get(was, was)}, not {what.get(now, now)}: resume it with "
                         f"`{again} --resume {run}`" + ("; to fine-tune its encoder, `vitkit train --init "
                                                        f"{run}/best`" if was != "classify" else ""))
    changed = [f"{k} {saved.get(k)!r} -> {users[k]!r}" for k in ("model", "init", "dataset")
               if k in users and users[k] != saved.get(k)]
    # another --data-dir is the run's data moved (the trainer checks its classes are the run's: its head's)
    if users.get("data_dir") is None and saved.get("data_dir") and not Path(saved["data_dir"]).expanduser().exists():
        raise FileNotFoundError(f"--resume {run}: the run's data, {saved['data_dir']}, is not there any more; if it "
                                "moved, give --data-dir where it is now (the same classes: the run's head is "
                                "theirs)")

    changed += [f"{k} {saved.get('model_args', {}).get(k)!r} -> {v!r}" for k, v in users_model.items()
                if not same(v, saved.get("model_args", {}).get(k))]
    if changed:
        raise ValueError(f"--resume {run} continues that run's model, but the flags or --config change it: "
                         f"{'; '.join(changed)}. Start a new run (another --output) to train another model")


def _without_users_keys(tiers: list[dict[str, Any]], users: dict[str, Any], users_model: dict[str, Any]
                        ) -> list[dict[str, Any]] | None:
    """The recipe's tiers without what the user's config file or flags set; None if no tier has anything left."""
    out = []
    for tier in tiers:
        t = {k: v for k, v in tier.items() if k not in users}
        if isinstance(t.get("model_args"), dict):
            t["model_args"] = {k: v for k, v in t["model_args"].items() if k not in users_model}
            if not t["model_args"]:
                del t["model_args"]
        out.append(t)
    return out if any(set(t) - set(TIER_BOUNDS) for t in out) else None


def _fit_accumulation(merged: dict[str, Any], n_train: int, user_set: bool, say: Callable[[str], None]) -> None:
    """The recipe's batch of 512 by accumulation, cut on a small dataset so an epoch keeps 8 optimiser steps."""
    batch, accum = merged.get("batch_size", 32), merged.get("grad_accum", 1)
    fitted = max(1, min(accum, n_train // (8 * batch)))
    if fitted != accum and not user_set:
        merged["grad_accum"] = fitted
        say(f"batch {batch} x {fitted} accumulated = {batch * fitted} (not {batch * accum}): {n_train} training "
            "images would give fewer than 8 optimiser steps an epoch")
