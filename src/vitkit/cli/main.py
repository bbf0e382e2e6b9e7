"""``vitkit <command>``: each command lives in its own module with ``add_parser`` and ``run``."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path

from .. import __version__

COMMANDS = {
    "train": ("train", "train or fine-tune a ViT"),
    "pretrain": ("pretrain", "learn from images alone, no labels: the paper's masked patch prediction (§4.6) or MAE"),
    "eval": ("evaluate", "evaluate a checkpoint: top-1/top-5, loss, per-class accuracy, confusion matrix"),
    "probe": ("probe", "how good an encoder's frozen features are: a linear probe and k-NN on labelled images"),
    "predict": ("predict", "top-k classes for image files"),
    "summary": ("summary", "layer table and parameters (torchinfo), forward GFLOP per image"),
    "inspect": ("inspect_cmd", "attention maps, rollout, attention distance, position embeddings, filters, features, "
                               "explanations, a self-supervised checkpoint's reconstructions"),
    "import": ("import_cmd", "convert timm / Hugging Face / JAX weights into a vitkit folder"),
    "export": ("export_cmd", "write a checkpoint as safetensors, ONNX, timm, Hugging Face or the official JAX .npz"),
    "push": ("push", "put a run's weights on the Hugging Face Hub with a model card (loadable by vitkit, timm, "
                     "transformers)"),
    "serve": ("serve", "browser demo: upload an image, see top-5 and the attention overlay"),
    "models": ("models_cmd", "list the model presets, or with --pretrained the pretrained weights vitkit can load"),
    "reproduce": ("reproduce", "the paper's claims at laptop scale: data size, position embeddings, transfer, "
                               "patch size, self-supervision"),
    "shard": ("shard_cmd", "write a folder or zip of images as WebDataset shards (--dataset shards reads them)"),
    "tune": ("tune_cmd", "hyper-parameter search on Optuna: each trial a `vitkit train` run, validated on held-out "
                         "training images, pruned by the median; the study in a database, resumable and shared"),
    "calibrate": ("calibrate", "time the candidates for every `auto` setting on this machine, print the plan, refresh "
                               "the cache"),
    "bench": ("bench", "throughput against timm / Hugging Face / torchvision, and the machine's ceiling"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only``, the flags of that command alone, ``""`` none (the others' modules are
    not imported: ``vitkit train --help`` answers without importing torch or the other commands)."""
    p = argparse.ArgumentParser(prog="vitkit", description="The Vision Transformer of 'An Image is Worth 16x16 "
                                "Words', and what it takes to use one. `vitkit COMMAND -h` for a command's flags.")
    p.add_argument("--version", action="version", version=f"vitkit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if only is None or name == only:
            mod = importlib.import_module(f"vitkit.cli.{module}")
            mod.add_parser(sp)
            sp.set_defaults(_run=mod.run)
    return p


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not a flag), or None."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def process_start_time() -> float:
    """The wall-clock time this process started (Linux; elsewhere: when ``vitkit`` was imported), so that
    ``vitkit train --time-limit`` counts Python's and torch's start-up (≈2.5 s) as part of the command's wall time.

    /proc's start time is the fork, not the exec: a process that became ``vitkit`` late (``bash -c '...; vitkit
    train'`` runs its last command in place of the shell, as does ``exec`` in a script) started long before Python
    did. Python gets from its start to ``import vitkit`` in well under a second, so a start time earlier than that
    is a fork's, and the import time (torch's import still counted) is used instead."""
    from .. import _IMPORT_TIME

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
        started = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORT_TIME
    return started if _IMPORT_TIME - started < 1.0 else _IMPORT_TIME


def main(argv: list[str] | None = None, early: list[int] | None = None) -> int:
    """``vitkit ...``; ``early``: SIGINTs already caught by ``python -m vitkit`` before this module was imported.

    Ctrl-C: during start-up (parsing, importing torch) the signal is only noted, and the command then ends quietly
    with 130 before any work begins (an exception raised inside torch's C++ imports aborts the process: "terminate
    called after throwing an instance of 'pybind11::error_already_set'"); after it, it interrupts the work, which
    ends in one line and 130 (or training's own handler stops the run and saves it)."""
    # the `vitkit` command itself (no argv) is the whole process; a call from Python starts its clock now
    started = process_start_time() if argv is None else time.time()
    interrupted: list[int] = list(early or [])
    previous = signal.getsignal(signal.SIGINT)
    ours = previous is signal.default_int_handler or (early is not None and previous is not signal.SIG_IGN)
    # (not where SIGINT is ignored: nohup)
    raising = [False]

    def on_interrupt(signum: int, frame: object) -> None:
        interrupted.append(signum)
        if raising[0]:
            raise KeyboardInterrupt

    if ours:
        signal.signal(signal.SIGINT, on_interrupt)
    command = command_of(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv, started)
        if isinstance(args, int):  # nothing to run (help)
            return args
        if getattr(args, "_run", None):
            import torch  # noqa: F401 - imported here, where a Ctrl-C cannot interrupt its C++ half-way
            import torch.distributed  # noqa: F401 - (its import was where the aborts happened)
        if interrupted:  # before any work began: one line, nothing done
            print(f"\n{' '.join(filter(None, ('vitkit', command)))}: interrupted before it began (nothing was done)",
                  file=sys.stderr)
            return 130
        raising[0] = True
        code = _main(args)
        if interrupted:  # a Ctrl-C that something below swallowed: the command still ends as interrupted
            raise KeyboardInterrupt
        return code
    except BaseException as e:  # noqa: BLE001 - an interrupted import fails in other ways (numpy's: AttributeError)
        if not (isinstance(e, KeyboardInterrupt) or interrupted):
            raise
        # Ctrl-C outside training's own handler (planning, decoding, calibrate, ...)
        raising[0] = False
        print(f"\n{' '.join(filter(None, ('vitkit', command)))}: interrupted (nothing half-written: files and caches "
              "are written whole or not at all)", file=sys.stderr)
        return 130
    finally:
        raising[0] = False  # a late signal while this returns is noted, not raised into the interpreter's exit
        if ours and argv is not None:  # a call from Python: its own handler again
            signal.signal(signal.SIGINT, signal.default_int_handler)
        elif ours:  # the whole process: a Ctrl-C while it exits (a terminal's, passed on again by a launcher)
            signal.signal(signal.SIGINT, _exit_as_interrupted)  # ends it with 130, not -2 and a traceback


def _exit_as_interrupted(signum: int, frame: object) -> None:
    """A SIGINT after the command ended, while the interpreter exits: Python's own handler would raise a
    KeyboardInterrupt into its shutdown and end the process by SIGINT (exit -2, 2 of 11 runs of a Ctrl-C ~2 s in).
    What was printed is flushed; the exit is 130, as for any Ctrl-C."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # (closed, or flushing already: a reentrant call)
            pass
    os._exit(130)


def _parse(argv: list[str] | None, started: float) -> argparse.Namespace | int:
    """The parsed command line, or the exit code where there is nothing to run (help)."""
    parser = build_parser(command_of(sys.argv[1:] if argv is None else argv) or "")
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "images", None), list) and not any(a.startswith("-") for a in extra):
        args.images += extra  # image files after a flag (`inspect explain --checkpoint DIR a.jpg b.jpg`): argparse
        # gives a positional only the first run of positionals
    elif extra:
        parser.parse_args(argv)  # argparse's own message for what it did not recognise (exits 2)
    args._started = started
    args._argv = list(argv) if argv is not None else sys.argv[1:]  # `train --nproc-per-node` starts it again
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return args


def _main(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `vitkit predict ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error as Python flushes)
        return 141
    except (ValueError, OSError) as e:  # bad input: a message naming it, never a traceback
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 2
