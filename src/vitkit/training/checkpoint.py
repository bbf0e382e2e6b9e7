"""Run-folder checkpoints: ``last/`` and ``best/``, each a ``save_pretrained`` folder plus ``train_state.pt``.

A checkpoint is written beside its final name and renamed into place, so a kill mid-save leaves either the old
or the new one, never a broken one. ``train_state.pt`` holds only tensors and plain values and is read with
``weights_only=True``: nothing is unpickled.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.serialization import atomic_write, save_pretrained, torch_load_safely
from ..model.ssl import save_ssl_parts

STATE_NAME = "train_state.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, name: str, model: nn.Module, preprocessing: dict[str, Any],
                    train_state: dict[str, Any] | None = None, started: bool = False) -> Path:
    """``model``, a ViT or a self-supervised module around one (its encoder saved as an ordinary vitkit model, the
    objective's parts beside it), with ``preprocessing`` and the training state. ``started``: the new folder holds
    what the other processes wrote into it already (a sharded run's shards, ``write_new``)."""
    final, new, old = run_dir / name, run_dir / f".{name}.new", run_dir / f".{name}.old"
    if not started:
        prepare_new(new)

    def write() -> None:
        encoder = getattr(model, "encoder", model)
        save_pretrained(encoder, new, **preprocessing)
        if encoder is not model:
            save_ssl_parts(model, new)
        if train_state is not None:
            atomic_write(new / STATE_NAME, lambda p: torch.save(train_state, p))
        _fsync_dir(new)

    write_new(new, name, run_dir, write)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    _fsync_dir(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def prepare_new(new: Path) -> None:
    """The folder a checkpoint is written into before it is renamed into place, emptied of a write that a kill
    cut short."""
    shutil.rmtree(new, ignore_errors=True)


def write_new(new: Path, name: str, run_dir: Path, write: Callable[[], None]) -> None:
    """``write()`` into the checkpoint's new folder; where it fails (a full disk surfaces as OSError, torch's
    "iostream error", safetensors' or DCP's own), the folder goes and an OSError says what to do."""
    try:
        write()
    except Exception as e:  # noqa: BLE001 - see above
        shutil.rmtree(new, ignore_errors=True)
        free = shutil.disk_usage(run_dir).free
        raise OSError(errno.ENOSPC if free < 64 * 1024 * 1024 else errno.EIO,
                      f"could not write the {name}/ checkpoint in {run_dir} ({' '.join(str(e).split())[:120]}); "
                      f"{free / 1e6:.1f} MB free there" + (": no space left on the device" if free < 64 * 1024 * 1024
                                                             else "") +
                      f". The previous {name}/ is kept; free some space, then --resume auto") from None


def recover_checkpoint(run_dir: Path, name: str) -> Path | None:
    """The checkpoint ``name`` if it is complete; after a kill between the two renames, the previous one."""
    final, old = run_dir / name, run_dir / f".{name}.old"
    if not final.exists() and old.exists():
        old.rename(final)
    shutil.rmtree(run_dir / f".{name}.new", ignore_errors=True)
    return final if final.exists() else None


def recover_run(run_dir: Path) -> None:
    """Both checkpoints of a run folder as recover_checkpoint leaves them (a kill between the two renames of a save
    leaves only ``.last.old`` / ``.best.old``): called before anything decides whether the folder holds a run."""
    if Path(run_dir).is_dir():
        for name in ("last", "best"):
            recover_checkpoint(Path(run_dir), name)


def load_train_state(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: nothing to resume from")
    state = torch_load_safely(path)
    missing = sorted({"model", "optimizer", "rng", "epoch", "step"} - set(state if isinstance(state, dict) else ()))
    if missing:
        raise ValueError(f"{path}: not a vitkit training state (missing {missing})")
    counters = {k: state[k] for k in ("epoch", "step", "batch_in_epoch") if k in state}
    bad = {k: v for k, v in counters.items() if type(v) is not int or v < 0}
    loss = state.get("epoch_loss", [0.0, 0])  # older states have none: the stopped epoch's loss then starts anew
    if not (isinstance(loss, list) and len(loss) == 2 and all(isinstance(v, (int, float)) for v in loss)):
        bad["epoch_loss"] = loss
    if bad:
        raise ValueError(f"{path}: not a vitkit training state ({', '.join(f'{k}={v!r}' for k, v in bad.items())}; "
                         "expected counts >= 0 and epoch_loss [loss sum, images])")
    return state
