"""``vitkit train``: flags in, the planner (training/plan.py) decides the run, the Trainer trains it; signals,
torchrun and exit codes are handled here."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from .common import add_data_flags, add_model_flags, model_overrides, positive_int, whole_number

# flag -> TrainConfig field (type, help); every default is "not given" so layering works
TRAIN_FLAGS: dict[tuple[str, ...], tuple[str, Any, str]] = {
    ("--recipe",): ("recipe", str, "a shipped recipe by name (src/vitkit/configs/NAME.yaml; a name not shipped "
                                   "lists them) instead of the one the dataset or its images call for, e.g. "
                                   "imagenet-vit-s16 for ImageNet shards"),
    ("--init",): ("init", str, "fine-tune from weights: a registered NAME.TAG (`vitkit models --pretrained`), a Hub "
                               "id, a URL, a vitkit folder, a timm/HF folder or file, or a JAX .npz; picks the "
                               "paper's fine-tuning recipe (configs/finetune.yaml), or for a `vitkit pretrain` "
                               "checkpoint the dataset's recipe with AdamW, layer decay 0.75, MixUp, CutMix and "
                               "drop path (MAE's way)"),
    ("--epochs",): ("epochs", int, "epochs"),
    ("--train-fraction",): ("train_fraction", float, "train on this share of the training images (class-balanced, "
                                                     "the same images for every model and seed; learning curves)"),
    ("--holdout",): ("holdout", float, "validate on this class-balanced share of the training images (after "
                                       "--train-fraction) instead of the dataset's val/test split, which is then "
                                       "not read: for choosing settings without the test set"),
    ("--semi",): ("semi", str, "learn from the images without labels too (the training images --train-fraction "
                              "leaves out, --unlabeled's, and the labelled ones): joint (MAE's loss beside the "
                              "classifier's; Das et al. 2024) or fixmatch (confident pseudo-labels of weakly "
                              "augmented images train their strongly augmented views; Sohn et al. 2020), or auto (the "
                              "one measured best at this --time-limit and label fraction on this device type, or "
                              "neither where neither beat the default: results/semi-supervised.csv)"),
    ("--unlabeled",): ("unlabeled", str, "--semi: a folder or zip of more images without labels (class folders "
                                         "ignored; of a train/ and test/ layout, train/ alone)"),
    ("--semi-weight",): ("semi_weight", float, "--semi: the unlabelled loss's weight beside the cross-entropy (joint "
                                               "0.5, fixmatch 1)"),
    ("--semi-threshold",): ("semi_threshold", float, "--semi fixmatch: the softmax a pseudo-label needs (0.95)"),
    ("--unlabeled-ratio",): ("unlabeled_ratio", int, "--semi: unlabelled images a step per labelled one (1)"),
    ("-b", "--batch-size"): ("batch_size", int, "batch size per process"),
    ("--grad-accum",): ("grad_accum", int, "micro-batches per optimizer step"),
    ("--lr",): ("lr", float, "peak learning rate (for the global batch; not scaled automatically)"),
    ("--min-lr",): ("min_lr", float, "learning rate at the end of the cosine"),
    ("--body-lr-scale",): ("body_lr_scale", float, "LR of all but the head relative to --lr (fine-tuning)"),
    ("--layer-decay",): ("layer_decay", float, "fine-tuning: block i's LR times DECAY^(depth - i), the embeddings' "
                                               "DECAY^(depth + 1) (MAE's code: 0.65 for ViT-B, 0.75 for ViT-L/H; "
                                               "0.75 for a `vitkit pretrain` encoder by default)"),
    ("--adam-beta2",): ("adam_beta2", float, "AdamW's second-moment decay (0.999; MAE pre-trains with 0.95)"),
    ("--weight-decay",): ("weight_decay", float, "AdamW/SGD weight decay (not on norms, biases, pos/cls)"),
    ("--warmup-epochs",): ("warmup_epochs", float, "linear warmup"),
    ("--opt",): ("opt", str, "adamw | sgd | muon (Muon for the blocks' weight matrices, AdamW for the rest)"),
    ("--momentum",): ("momentum", float, "SGD momentum"),
    ("--smoothing",): ("smoothing", float, "label smoothing"),
    ("--mixup",): ("mixup", float, "MixUp alpha (0 = off)"),
    ("--cutmix",): ("cutmix", float, "CutMix alpha (0 = off)"),
    ("--aa",): ("aa", str, "rand | trivial (RandAugment / TrivialAugmentWide)"),
    ("--aa-magnitude",): ("aa_magnitude", int, "RandAugment's strength out of 10 (10: big_vision's randaug(2, 10), "
                                                 "timm's rand-m10; default torchvision's, about 3)"),
    ("--crop-padding",): ("crop_padding", int, "random crop with this zero padding"),
    ("--crop-pct",): ("crop_pct", float, "photos: evaluate on the centre img_size crop of the image resized to "
                                         "img_size / CROP_PCT on its short side (0.875: 224 of 256)"),
    ("--inception-crop",): ("inception_crop", float, "photos, streamed: each training image a random crop of at "
                                                     "least this share of its area, aspect 3/4 to 4/3, resized to "
                                                     "img_size (0.05: big_vision's, 0.08: torchvision's)"),
    ("--clip-grad",): ("clip_grad", float, "clip the gradient norm at this value (0: no clipping)"),
    ("--precision",): ("precision", str, "fp32 | bf16 | fp16 (fp16 with GradScaler, CUDA) | tf32 (fp32 with TF32 "
                                         "matmuls, CUDA) | auto (the fastest of these here, timed on this run's "
                                         "step; the recipes' choice)"),
    ("--attention",): ("attention", str, "sdpa | exact | auto (the faster, timed here)"),
    ("--device",): ("device", str, "auto | cpu | cuda | cuda:N | mps"),
    ("--threads",): ("threads", int, "CPU threads (default: measured at the start, the fewest within 10%% of the "
                                     "fastest; logged)"),
    ("--seed",): ("seed", int, "random seed"),
    ("--time-limit",): ("time_limit", float, "minutes of wall time; the LR schedule is planned to end there"),
    ("--folder-max-side",): ("folder_max_side", int, "--dataset folder: photos held in memory at up to this many "
                                                     "pixels a side (default 128, or the --img-size the model reads "
                                                     "where larger)"),
    ("--data-mode",): ("data_mode", str, "--dataset folder, shards or hf: memory (decoded once, the fastest) | "
                                         "stream (read from the files by DataLoader workers, for data larger than "
                                         "memory) | auto (streams what would not fit in the memory this process may "
                                         "use)"),
    ("--workers",): ("workers", whole_number, "streaming: DataLoader worker processes (default: measured on the "
                                              "run's step)"),
    ("--decode",): ("decode", str, "streaming: where JPEGs are decoded and cut: workers (PIL, in the DataLoader "
                                   "workers) | device (the batch at once on the training device: nvJPEG on a GPU) | "
                                   "auto (the device on a GPU where it is faster, the workers on a CPU)"),
    ("--max-tokens",): ("max_tokens", int, "with --naflex: the most patches an image is resized to (default: the "
                                           "model's own grid at its --img-size, the budget a fixed-size run spends)"),
    ("--max-epochs",): ("max_epochs", int, "with --time-limit: a budget that buys more than --epochs grows the "
                                           "schedule up to this many epochs (default: the recipe's; most keep "
                                           "their epochs)"),
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
              "--naflex": ("naflex", "NaFlex (SigLIP 2): every image at its own aspect ratio, resized to fit "
                                     "--max-tokens patches, batches padded with an attention mask; streams the files"),
              "--freeze-body": ("freeze_body", "with --init: train the head alone (a linear probe)"),
              "--grad-checkpointing": ("grad_checkpointing", "activation checkpointing: each block's activations "
                                                             "rebuilt in the backward pass instead of kept (less "
                                                             "memory, one more forward of each block; timm's "
                                                             "set_grad_checkpointing)"),
              "--gpu-batch": ("gpu_batch", "on a CUDA GPU, choose the batch from the measured step and free memory "
                                           "(the LR scaled with it; the default unless -b/--batch-size is given)")}
AUTO_BOOL_FLAGS = {"--compile": ("compile", "torch.compile the model; auto: where the budget repays the compile time "
                                            "measured here (the recipes' choice; the plan says why); "
                                            "reduce-overhead: with CUDA graphs (on a GPU auto times it too)"),
                   "--channels-last": ("channels_last", "conv weights channels-last; auto: timed here"),
                   "--shard": ("shard", "with several processes (torchrun): FSDP2, each process holding 1/world of "
                                        "the weights, gradients and optimizer state; auto: where a DDP replica "
                                        "would take over half a process's memory")}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_flags(p)
    add_model_flags(p)
    g = p.add_argument_group("training")
    for flags, (dest, typ, help_) in TRAIN_FLAGS.items():
        g.add_argument(*flags, dest=dest, type=typ, default=argparse.SUPPRESS, help=help_)
    for flag, (dest, help_) in BOOL_FLAGS.items():
        g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
    for flag, (dest, help_) in AUTO_BOOL_FLAGS.items():
        g.add_argument(flag, dest=dest, nargs="?", const=True, type=_auto_bool, default=argparse.SUPPRESS,
                       metavar="auto", help=help_)
        g.add_argument("--no-" + flag[2:], dest=dest, action="store_false", default=argparse.SUPPRESS)
    g.add_argument("--no-tiers", dest="tiers", action="store_const", const=None, default=argparse.SUPPRESS,
                   help="with --time-limit: keep the recipe's own settings whatever the budget buys (its tiers are "
                        "for budgets that buy few epochs)")
    g.add_argument("--config", default=None, help="YAML file of TrainConfig keys (flags override it)")
    g.add_argument("--estimate", dest="_estimate", nargs="?", const=0, type=positive_int, default=None,
                   metavar="IMAGES", help="plan the run, then time its step on the files streamed against the same "
                                          "step on images in memory, and print the hours its epochs take over the "
                                          "training images (or IMAGES an epoch: 1281167 for ImageNet-1k from a "
                                          "sample of its shards); trains nothing")
    g.add_argument("--nproc-per-node", dest="_nproc_per_node", type=positive_int, default=None, metavar="N",
                   help="train on N processes on this machine (DDP: one per GPU, or CPU processes with gloo), started "
                        "here as `torchrun --standalone --nproc-per-node N -m vitkit train ...` would; checked "
                        "before any process starts")


def _estimate(cfg: Any, data: Any, recipe: str | None, say: Any, start: float, distributed: bool, images: int) -> int:
    """``--estimate``: the planned run's streamed step, the same step in memory, and its hours (bench/stream.py)."""
    from ..bench.stream import report, stream_cost
    from ..training.plan import make_plan

    if distributed:
        print("vitkit train: error: --estimate times one process; run it without torchrun (it projects to 8)",
              file=sys.stderr)
        return 2
    cfg, the_plan = make_plan(cfg, data, recipe, say, start)
    report(stream_cost(cfg, data, the_plan), cfg.epochs, images, say)
    return 0


def _estimate_refuses(args: argparse.Namespace) -> str:
    """Why ``--estimate`` cannot run on what the flags name, known before the data is read (it was refused after
    the whole planning table and the decode into memory); with ``--data-mode auto`` the files are streamed, which
    is what it times."""
    from ..data import FILE_DATASETS

    dataset = getattr(args, "dataset", None)
    if dataset is not None and dataset not in FILE_DATASETS:
        return (f"--estimate times a run streamed from image files (--dataset {' or '.join(FILE_DATASETS)}); "
                f"{dataset} is held in memory")
    if getattr(args, "data_mode", "auto") == "memory":
        return ("--estimate times a run streamed from the files against the same step in memory: --data-mode "
                "stream or auto, not memory")
    if dataset in FILE_DATASETS or (dataset is None and getattr(args, "data_dir", None)):
        args.data_mode = "stream"  # (a recipe's own in-memory dataset is refused once it is known, before the plan)
    return ""


def _auto_bool(text: str) -> bool | str:
    value = {"auto": "auto", "true": True, "on": True, "false": False, "off": False,
             "reduce-overhead": "reduce-overhead"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected auto, true or false (--compile: or reduce-overhead), got {text!r}")
    return value


def sources(args: argparse.Namespace) -> "Sources":  # noqa: F821
    """What the command line asked, for the planner."""
    from ..training.plan import Sources

    given = {k: v for k, v in vars(args).items()
             if not k.startswith(("model__", "_")) and k not in ("command", "config")}
    return Sources(given, model_overrides(args), args.config, getattr(args, "_started", None))


def resolve_sources(args: argparse.Namespace, resolve):  # type: ignore[no-untyped-def]
    return resolve(sources(args), lambda s: print(s, flush=True), _progress())


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


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line less ``--nproc-per-node N`` (or ``=N``): what each started process runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


RUN_PARTS = ("best", "metrics.jsonl", "tb", "curves.png", "plan.json", "config.yaml")  # a run's, beside last/


def _check_output(cfg, asked_resume: str | None = None, rank: int = 0) -> None:  # type: ignore[no-untyped-def]
    """The run's folder is new, a run to continue (``cfg.resume``), or refused, nothing overwritten.
    ``asked_resume``: the --resume the user gave, where there was nothing to resume (no last/)."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output {out} is a file, not a folder; choose another --output (nothing was "
                              "overwritten)")
    held = [n for n in ("best", "metrics.jsonl") if (out / n).exists()]
    if not cfg.resume and held and not (out / "last").exists():
        # killed (or out of disk) during its first save of last/, best/ written: nothing to continue from
        if not asked_resume:
            raise FileExistsError(f"{out} holds a run with no last/ checkpoint to continue (its {', '.join(held)}; "
                                  "a run stopped while saving last/): --resume auto starts it over there, its "
                                  "files moved into a folder beside them; or another --output (nothing was "
                                  "overwritten)")
        if rank == 0:
            aside = out / time.strftime("before-restart-%Y%m%d-%H%M%S")
            aside.mkdir()
            moved = [n for n in RUN_PARTS if (out / n).exists()]
            for n in moved:
                (out / n).rename(aside / n)
            print(f"{out} holds no last/ checkpoint to continue (its {', '.join(held)}; a run stopped while saving "
                  f"last/): starting it over there; its {', '.join(moved)} moved to {aside}", flush=True)
        return
    if not cfg.resume and out.exists() and any((out / n).exists() for n in ("last", "best", "metrics.jsonl")):
        raise FileExistsError(f"{out} already holds a run; use --resume auto to continue it, or another --output "
                              "(nothing was overwritten)")
    theirs = [n for n in ("config.yaml", "plan.json", "curves.png") if (out / n).exists()]
    if (out / "plan.json").is_file() and not any((out / n).exists() for n in ("last", "best", "metrics.jsonl")):
        # plan.json is vitkit's alone: a run killed before its first checkpoint (kill -9, out of memory, a full disk)
        print(f"{out} holds a run that stopped before its first checkpoint ({', '.join(theirs)}, no last/): "
              "starting it over there", flush=True)
        return
    if not cfg.resume and theirs:  # e.g. `--config exp1/config.yaml --output exp1`: the user's own file
        raise FileExistsError(f"{out} already has {', '.join(theirs)}, which a run writes: choose another --output "
                              "(nothing was overwritten)")


SAME_STOP_S = 2.0  # a signal this soon after the first is the same stop (a launcher passing a Ctrl-C on)
STOP_GRACE_S = 10.0  # after a stop is asked: this long, plus twice a step, for the step to end and last/ to be saved


def stop_grace_s(batch_seconds: float | None) -> float:
    """How long a stop waits for the step it interrupts: 10 s and two steps' time."""
    return STOP_GRACE_S + 2 * (batch_seconds or 0.0)


def epochs_text(result: Any) -> str:
    """The epochs a run trained, as a fraction where it ended mid-epoch: ``40``, ``0.14``, ``12.5``."""
    epochs = result.epochs_trained if result.epochs_trained is not None else result.epochs
    return f"{epochs:.0f}" if abs(epochs - round(epochs)) < 0.005 else f"{epochs:.2f}"


def _command(args: argparse.Namespace) -> str:
    """The command as the user typed it, for its one-line errors (``vitkit pretrain`` runs this one too)."""
    return "vitkit pretrain" if getattr(args, "objective", "classify") not in (None, "classify") else "vitkit train"


def run(args: argparse.Namespace, on_epoch: Any = None) -> int:
    """``on_epoch(trainer, row)``: called after each epoch with its metrics row (``vitkit tune``)."""
    start = getattr(args, "_started", None) or time.time()  # --time-limit counts from the process start (cli.main)
    import torch.distributed as dist

    from ..runtime.distributed import (destroy_process_group, init_distributed, launched_distributed, local_rank,
                                       rank0_done, rank_and_world, restart_count, wait_for_rank0)
    from ..training.build import build_data
    from ..training.plan import make_plan, resolve
    from ..training.trainer import Trainer, TrainingDiverged

    distributed = launched_distributed()
    if (nproc := getattr(args, "_nproc_per_node", None)) and nproc > 1 and not distributed:
        from ..runtime.distributed import launch

        return launch(nproc, _without_nproc(getattr(args, "_argv", None) or sys.argv[1:]),
                      getattr(args, "device", None) or "auto")
    if distributed and not dist.is_initialized():
        try:
            init_distributed(getattr(args, "device", None) or "auto")
        except ValueError as e:  # every rank finds the same; one of them says it
            if os.environ.get("RANK", "0") == "0":
                print(f"{_command(args)}: error: {e}", file=sys.stderr)
            return 2
    rank = rank_and_world()[0]
    if restart_count() > 0 and not getattr(args, "resume", None):
        args.resume = "auto"  # torchrun restarted the group after a failure: continue from last/
        if not getattr(args, "output", None):
            args.output = _default_output(args)
    if distributed and rank != 0:
        try:
            wait_for_rank0("data")  # rank 0 decodes (and caches) the dataset first; the others then read the cache
        except RuntimeError:  # rank 0 stopped before it (bad flags, data it could not read): it said why
            return 2
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    if getattr(args, "_estimate", None) is not None and (refused := _estimate_refuses(args)):
        print(f"{_command(args)}: error: {refused}", file=sys.stderr)  # before anything is read or decoded
        return 2
    cfg, data, recipe = resolve(sources(args), say, _progress())
    data = data or build_data(cfg)
    if distributed and rank == 0:
        rank0_done("data")
    if getattr(args, "_estimate", None) is not None:
        if not data.streamed:  # (before the planning table)
            print(f"{_command(args)}: error: --estimate times a run streamed from the files; {data.name} is held "
                  "in memory", file=sys.stderr)
            return 2
        return _estimate(cfg, data, recipe, say, start, distributed, args._estimate or len(data.train))
    if cfg.output is None:
        cfg.output = _default_output(args, cfg.dataset)
        if distributed:  # every rank must agree on the folder
            obj = [cfg.output]
            dist.broadcast_object_list(obj, src=0)
            cfg.output = obj[0]
    try:
        _check_output(cfg, getattr(args, "resume", None), rank)
    except FileExistsError as e:
        print(f"{_command(args)}: error: {e}", file=sys.stderr)
        return 2
    from ..runtime.device import resolve_device
    from ..training.semi_choice import choose_semi
    from ..training.trainer import unlabelled_pool
    cfg, semi_note = choose_semi(cfg, resolve_device(cfg.device, local_rank()).type)  # (before its images are read)
    if semi_note:
        say(semi_note)
    pool = unlabelled_pool(cfg, data, data.with_train_fraction(cfg.train_fraction, holdout=cfg.holdout),
                           say if rank == 0 else lambda s: None)  # (--semi: read, or refused, before the plan)
    cfg, the_plan = make_plan(cfg, data, recipe, say, start, in_run=True)
    if semi_note:
        the_plan.notes.append(semi_note)  # (plan.json)
    if rank == 0:
        print("resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    trainer = Trainer(cfg, data=data, start_time=start, progress=sys.stderr.isatty(),
                      log=lambda s: print(s, flush=True), plan_=the_plan, pool=pool, on_epoch=on_epoch)
    final = trainer.objective.final  # the final line's measure: top-1, or a self-supervised objective's own
    received: list[float] = []  # when the stop was asked
    signals: list[int] = []
    timers: list[threading.Timer] = []
    pid = os.getpid()

    def on_signal(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a DataLoader worker, forked with this handler: the training process ends it
            return
        if received and time.monotonic() - received[0] > SAME_STOP_S:  # a second signal: stop now
            raise KeyboardInterrupt
        if received:  # the same stop again: a terminal's Ctrl-C, then the launcher of a multi-process run passing
            return  # it on to its processes
        received.append(time.monotonic())
        signals.append(signum)
        grace = stop_grace_s(trainer.batch_seconds)
        if rank == 0:  # every process of a multi-process run gets a terminal's Ctrl-C: one says it (each did)
            print(f"\nsignal {signum}: finishing this step, saving last/ and exiting (at once on a second signal, or "
                  f"if the step has not ended in {grace:.0f} s)", file=sys.stderr)
        trainer.request_stop()
        # a step that cannot end (waiting for data that never comes) must not hold the process: SIGTERM once hung
        # for 10 minutes in a DataLoader's poll
        timer = threading.Timer(grace, os.kill, (pid, signum))
        timer.daemon = True
        timer.start()
        timers.append(timer)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = trainer.fit()
        if dist.is_initialized():
            dist.barrier()  # rank 0 may still be writing; a rank tearing down early can abort the others
    except TrainingDiverged as e:
        print(f"{_command(args)}: error: {e}", file=sys.stderr)
        return 3
    finally:
        for timer in timers:  # the stop ended in time: no second signal
            timer.cancel()
        for sig, handler in previous.items():  # on_signal holds the trainer: let both go
            signal.signal(sig, handler)
        del trainer
        if dist.is_initialized():
            destroy_process_group()
    if result.stopped_early:
        return 128 + (signals[0] if signals else signal.SIGTERM)
    if rank == 0:
        # (steps= last: a reader of the line's first three keys reads it as before)
        print(f"final: {final(result.val_top1)} epochs={epochs_text(result)} elapsed_s={result.elapsed_s:.1f} "
              f"steps={result.steps}")
    return 0
