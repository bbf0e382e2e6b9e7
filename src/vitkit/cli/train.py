"""``vitkit train``: recipe (configs/<dataset>.yaml) < --config FILE < flags, then the Trainer."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .common import add_data_flags, add_model_flags, model_overrides

# flag -> TrainConfig field (type, help); every default is "not given" so layering works
TRAIN_FLAGS: dict[tuple[str, ...], tuple[str, Any, str]] = {
    ("--init",): ("init", str, "fine-tune from weights: a registered NAME.TAG (`vitkit models --pretrained`), a Hub "
                               "id, a URL, a vitkit folder, a timm/HF folder or file, or a JAX .npz; picks the "
                               "paper's fine-tuning recipe (configs/finetune.yaml)"),
    ("--epochs",): ("epochs", int, "epochs"),
    ("--train-fraction",): ("train_fraction", float, "train on this share of the training images (class-balanced, "
                                                     "the same images for every model and seed; learning curves)"),
    ("-b", "--batch-size"): ("batch_size", int, "batch size per process"),
    ("--grad-accum",): ("grad_accum", int, "micro-batches per optimizer step"),
    ("--lr",): ("lr", float, "peak learning rate (for the global batch; not scaled automatically)"),
    ("--min-lr",): ("min_lr", float, "learning rate at the end of the cosine"),
    ("--body-lr-scale",): ("body_lr_scale", float, "LR of all but the head relative to --lr (fine-tuning)"),
    ("--weight-decay",): ("weight_decay", float, "AdamW/SGD weight decay (not on norms, biases, pos/cls)"),
    ("--warmup-epochs",): ("warmup_epochs", float, "linear warmup"),
    ("--opt",): ("opt", str, "adamw | sgd | muon (Muon for the blocks' weight matrices, AdamW for the rest)"),
    ("--momentum",): ("momentum", float, "SGD momentum"),
    ("--smoothing",): ("smoothing", float, "label smoothing"),
    ("--mixup",): ("mixup", float, "MixUp alpha (0 = off)"),
    ("--cutmix",): ("cutmix", float, "CutMix alpha (0 = off)"),
    ("--aa",): ("aa", str, "rand | trivial (RandAugment / TrivialAugmentWide)"),
    ("--crop-padding",): ("crop_padding", int, "random crop with this zero padding"),
    ("--clip-grad",): ("clip_grad", float, "clip the gradient norm"),
    ("--precision",): ("precision", str, "fp32 | bf16 | fp16 (fp16 with GradScaler, CUDA) | auto (bf16 where the "
                                         "device computes in bf16 natively, else fp32; the recipes' choice)"),
    ("--device",): ("device", str, "auto | cpu | cuda | cuda:N | mps"),
    ("--threads",): ("threads", int, "CPU threads (default: measured at the start, the fewest within 10%% of the "
                                     "fastest; logged)"),
    ("--seed",): ("seed", int, "random seed"),
    ("--time-limit",): ("time_limit", float, "minutes of wall time; the LR schedule is planned to end there"),
    ("--output",): ("output", str, "run folder (default runs/<dataset>-<time>)"),
    ("--resume",): ("resume", str, "a run folder, or 'auto' (the --output folder if it has a checkpoint)"),
    ("--model-ema-decay",): ("model_ema_decay", float, "EMA decay"),
    ("--eval-batch-size",): ("eval_batch_size", int, "evaluation batch size"),
    ("--eval-every",): ("eval_every", int, "evaluate every N epochs (the last epoch always)"),
}
BOOL_FLAGS = {"--model-ema": ("model_ema", "keep an EMA of the weights (evaluated and saved)"),
              "--hflip": ("hflip", "random horizontal flips"),
              "--muon-stem": ("muon_stem", "with --opt muon: Muon for a hybrid's CNN stem filters too"),
              "--muon-embed": ("muon_embed", "with --opt muon: Muon for the patch embedding's projection too"),
              "--freeze-body": ("freeze_body", "with --init: train the head alone (a linear probe)")}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_flags(p)
    add_model_flags(p)
    g = p.add_argument_group("training")
    for flags, (dest, typ, help_) in TRAIN_FLAGS.items():
        g.add_argument(*flags, dest=dest, type=typ, default=argparse.SUPPRESS, help=help_)
    for flag, (dest, help_) in BOOL_FLAGS.items():
        g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
    g.add_argument("--compile", dest="compile", nargs="?", const=True, type=_compile_value, default=argparse.SUPPRESS,
                   metavar="auto", help="torch.compile the model; --compile auto: where it pays on this device and "
                                        "budget (the recipes' choice; the log says which); --no-compile: never")
    g.add_argument("--no-compile", dest="compile", action="store_false", default=argparse.SUPPRESS)
    g.add_argument("--no-few-epochs", dest="few_epochs", action="store_const", const=None, default=argparse.SUPPRESS,
                   help="with --time-limit: keep the recipe's model even where the budget buys few epochs of it (the "
                        "recipe's few_epochs settings are for slower CPUs)")
    g.add_argument("--config", default=None, help="YAML file of TrainConfig keys (flags override it)")


def _compile_value(text: str) -> bool | str:
    value = {"auto": "auto", "true": True, "on": True, "false": False, "off": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")
    return value


def resolve_config(args: argparse.Namespace) -> tuple["TrainConfig", Any]:  # noqa: F821
    """Layer the sources; for ``--dataset folder`` the recipe is chosen from the data itself."""
    from ..data.datasets import default_cache_dir, load_dataset
    from ..training.checkpoint import recover_run
    from ..training.config import TrainConfig, lay_over, read_yaml, safe_yaml
    from ..training.recipes import choose_recipe, flips_change_labels
    from ..interop.pretrained import init_image_size

    given = {k: v for k, v in vars(args).items()
             if not k.startswith(("model__", "_")) and k not in ("command", "config")}
    file_cfg = read_yaml(args.config) if args.config else {}
    resume = given.get("resume") or file_cfg.get("resume")
    saved: dict[str, Any] = {}
    if resume:
        run_dir = Path(resume if resume != "auto" else (given.get("output") or file_cfg.get("output") or ""))
        recover_run(run_dir)  # a save killed between its two renames left .last.old: that is last/ again
        if resume == "auto" and not (run_dir / "last").exists():
            given.pop("resume", None), file_cfg.pop("resume", None)  # nothing to resume: a fresh run
        elif (run_dir / "config.yaml").is_file():
            saved = safe_yaml(run_dir / "config.yaml")
            given["resume"] = str(run_dir)
            given.setdefault("output", str(run_dir))
        else:
            raise FileNotFoundError(f"--resume {resume}: {run_dir / 'config.yaml'} not found")
    dataset = given.get("dataset") or file_cfg.get("dataset") or saved.get("dataset") or "digits"
    merged: dict[str, Any] = {"dataset": dataset}
    time_limit = given.get("time_limit") or file_cfg.get("time_limit")  # recipes hold settings for short budgets
    init = given.get("init") or file_cfg.get("init")
    data = None
    if not saved:
        if init:  # fine-tuning: held at the weights' resolution, so nothing is lost to a smaller copy
            size = model_overrides(args).get("img_size") or init_image_size(init)
            merged["folder_max_side"] = max(size) if isinstance(size, tuple) else size
        if dataset == "folder":
            data_dir = given.get("data_dir") or file_cfg.get("data_dir")
            probe = {**given, **file_cfg}
            data = load_dataset("folder", data_dir, False, probe.get("skip_bad_images", False),
                                probe.get("cache_dir") or default_cache_dir(), progress=_progress(),
                                max_side=merged.get("folder_max_side", 128))
            name = "finetune" if init else choose_recipe(data)
            print(f"recipe for this folder: configs/{name}.yaml ({data.describe()})")
        else:
            name = "finetune" if init else dataset
        if init:
            print(f"--init {init}: the paper's fine-tuning recipe, configs/finetune.yaml (SGD momentum 0.9, no "
                  "weight decay, warmup + cosine, gradient clipping at 1, new zero head, position embeddings "
                  "resampled to the training size; a --config file or flags override it)")
        short = _recipe_for_budget(name, time_limit, {**file_cfg, **given})
        merged.update({k: v for k, v in short.items() if k != "dataset"})
        if data is not None and merged.get("hflip") and flips_change_labels(data):
            merged["hflip"] = False
            if "hflip" not in given and "hflip" not in file_cfg:
                print("no horizontal flips: small grayscale images are often digits or characters, which a flip "
                      "changes (--hflip to flip anyway)")
    for layer in (saved, file_cfg, given, {"model_args": model_overrides(args)}):
        merged = lay_over(merged, layer)  # a --config or flag changing the depth keeps the recipe's width
    merged.setdefault("cache_dir", default_cache_dir())
    if merged.get("few_epochs") and "few_epochs" not in given and "few_epochs" not in file_cfg:
        merged["few_epochs"] = _without_users_keys(merged["few_epochs"], {**file_cfg, **given},
                                                   {**file_cfg.get("model_args", {}), **model_overrides(args)})
    if init and not saved and data is not None:
        _fit_accumulation(merged, len(data.train), "grad_accum" in given or "grad_accum" in file_cfg)
    return TrainConfig.from_dict(merged, source="train config"), data


def _without_users_keys(few: dict[str, Any], users: dict[str, Any], users_model: dict[str, Any]) -> dict | None:
    """The recipe's ``few_epochs`` section without what the user's config file or flags set (those win here too);
    None if nothing but its ``below`` is left."""
    few = {k: v for k, v in few.items() if k not in users}
    if "model_args" in few:
        few["model_args"] = {k: v for k, v in few["model_args"].items() if k not in users_model}
        if not few["model_args"]:
            del few["model_args"]
    return few if set(few) - {"below"} else None


def _fit_accumulation(merged: dict[str, Any], n_train: int, user_set: bool) -> None:
    """The recipe's batch of 512 by accumulation, cut on a small dataset so an epoch keeps 8 optimiser steps."""
    batch, accum = merged.get("batch_size", 32), merged.get("grad_accum", 1)
    fitted = max(1, min(accum, n_train // (8 * batch)))
    if fitted != accum and not user_set:
        merged["grad_accum"] = fitted
        print(f"batch {batch} x {fitted} accumulated = {batch * fitted} (not {batch * accum}): {n_train} training "
              "images would give fewer than 8 optimiser steps an epoch")


def _recipe_for_budget(name: str, time_limit: float | None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """configs/<name>.yaml with its settings for ``time_limit`` minutes, saying what the budget changed. The
    precision and device of ``settings`` (the user's config file and flags) over the recipe's decide whether the run
    computes in fp32 on a CPU, and so whether the budget's ``cpu_fp32`` section applies."""
    from ..training.config import TrainConfig, describe_changes, for_budget, read_recipe, trains_in_fp32_on_cpu

    written = read_recipe(name)
    full, plain = for_budget(written, None), for_budget(written, time_limit)
    defaults = TrainConfig().to_dict()  # a key the recipe leaves to the default (eval_every 1) says so
    run = {**defaults, **full, **(settings or {})}
    short = for_budget(written, time_limit, trains_in_fp32_on_cpu(run["precision"], run["device"]))
    changed = describe_changes({**defaults, **full}, short)
    if changed:
        budget = f" for --time-limit {time_limit:g}" if time_limit is not None else ""
        where = " in fp32 on this CPU" if short != plain else ""
        print(f"recipe configs/{name}.yaml{budget}{where}: {', '.join(changed)}")
    return short


def _progress():  # type: ignore[no-untyped-def]
    from functools import partial

    from tqdm import tqdm

    return partial(tqdm, mininterval=1.0, leave=False)


def _default_output(args: argparse.Namespace, dataset: str | None = None) -> str:
    """runs/<dataset>-<time>; under torchrun runs/<dataset>-<run id>, the same after a restart."""
    dataset = dataset or getattr(args, "dataset", None) or "digits"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    suffix = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{dataset}-{suffix}")


def _check_output(cfg) -> None:  # type: ignore[no-untyped-def]
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output {out} is a file, not a folder; choose another --output (nothing was "
                              "overwritten)")
    if not cfg.resume and out.exists() and any((out / n).exists() for n in ("last", "best", "metrics.jsonl")):
        raise FileExistsError(f"{out} already holds a run; use --resume auto to continue it, or another --output "
                              "(nothing was overwritten)")


def run(args: argparse.Namespace) -> int:
    start = getattr(args, "_started", None) or time.time()  # --time-limit counts from the process start (cli.main)
    import torch.distributed as dist

    from ..runtime.distributed import (destroy_process_group, init_distributed, launched_distributed,
                                       rank_and_world, restart_count)
    from ..training.build import build_data
    from ..training.trainer import Trainer, TrainingDiverged

    distributed = launched_distributed()
    if distributed and not dist.is_initialized():
        init_distributed()
    rank = rank_and_world()[0]
    if restart_count() > 0 and not getattr(args, "resume", None):
        args.resume = "auto"  # torchrun restarted the group after a failure: continue from last/
        if not getattr(args, "output", None):
            args.output = _default_output(args)
    if distributed and rank != 0:
        dist.barrier()  # rank 0 decodes (and caches) the dataset first; the others then read the cache
    cfg, data = resolve_config(args)
    if data is None:
        data = build_data(cfg)
    if distributed and rank == 0:
        dist.barrier()
    if cfg.output is None:
        cfg.output = _default_output(args, cfg.dataset)
        if distributed:  # every rank must agree on the folder
            obj = [cfg.output]
            dist.broadcast_object_list(obj, src=0)
            cfg.output = obj[0]
    try:
        _check_output(cfg)
    except FileExistsError as e:
        print(f"vitkit train: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    trainer = Trainer(cfg, data=data, start_time=start, progress=sys.stderr.isatty(),
                      log=lambda s: print(s, flush=True))
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if received:  # a second signal: stop now
            raise KeyboardInterrupt
        received.append(signum)
        print(f"\nsignal {signum}: finishing this step, saving last/ and exiting", file=sys.stderr)
        trainer.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = trainer.fit()
        if dist.is_initialized():
            dist.barrier()  # rank 0 may still be writing; a rank tearing down early can abort the others
    except TrainingDiverged as e:
        print(f"vitkit train: error: {e}", file=sys.stderr)
        return 3
    finally:
        for sig, handler in previous.items():  # on_signal holds the trainer: let both go
            signal.signal(sig, handler)
        del trainer
        if dist.is_initialized():
            destroy_process_group()
    if result.stopped_early:
        return 128 + (received[0] if received else signal.SIGTERM)
    if rank == 0:
        print(f"final: val_top1={result.val_top1:.2f} epochs={result.epochs} elapsed_s={result.elapsed_s:.1f}")
    return 0
