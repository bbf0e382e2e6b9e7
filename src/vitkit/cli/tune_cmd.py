"""``vitkit tune``: hyper-parameter search on Optuna. Every trial is a normal ``vitkit train`` run (its own folder,
``OUTPUT/trial-NNN``, the planner, the budget, resumable); its validation top-1 on held-out *training* images
(``--holdout``, 0.1 unless given: never the test split) is reported each epoch, so a trial below the median of the
others at the same epoch stops early (Optuna's MedianPruner). The sampler is TPE.

The study lives in a database (SQLite in ``OUTPUT/study.db`` by default; ``--storage`` takes any URL Optuna's
RDBStorage takes, e.g. PostgreSQL), so the same command run again continues a stopped study, and several
processes or machines given the same ``--storage`` and ``--study`` share one (trials of a process that was killed
are failed after 3 minutes without its heartbeat, and run again once)."""
from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

from . import train as train_cmd

HOLDOUT = 0.1
# around the run's own values: a quarter to four times its learning rate, a fifth to five times its weight decay
DEFAULT_SPACE = ("lr=x0.25..x4:log", "weight_decay=x0.2..x5:log")


def add_parser(p: argparse.ArgumentParser) -> None:
    train_cmd.add_parser(p)  # every `vitkit train` flag sets every trial
    g = p.add_argument_group("search")
    g.add_argument("--trials", dest="_trials", type=train_cmd.positive_int, default=20,
                   help="finished trials (completed or pruned) the study should have; run again with more to extend it")
    g.add_argument("--space", dest="_space", action="append", default=None, metavar="SPEC",
                   help="a setting to search, repeatable: NAME=LOW..HIGH[:log], NAME=xLOW..xHIGH[:log] (multiples "
                        "of the run's own value) or NAME=A|B|C; default: " + " ".join(DEFAULT_SPACE))
    g.add_argument("--timeout", dest="_timeout", type=float, default=None, metavar="MIN",
                   help="start no trial after MIN minutes (the one running finishes); with --time-limit per trial, "
                        "the whole search fits about MIN + one trial")
    g.add_argument("--study", dest="_study", default="vitkit", help="the study's name in the storage")
    g.add_argument("--storage", dest="_storage", default=None, metavar="URL",
                   help="where the study lives: any database URL Optuna takes (sqlite:///path.db, "
                        "postgresql://...); default sqlite:///OUTPUT/study.db")
    g.add_argument("--sampler", dest="_sampler", choices=("tpe", "random"), default="tpe",
                   help="how trials are drawn: TPE (the default) or uniformly at random")
    g.add_argument("--prune", dest="_prune", action=argparse.BooleanOptionalAction, default=True,
                   help="stop a trial whose validation top-1 is below the median of the others' at the same epoch "
                        "(from epoch 2, once 3 trials have finished)")


def _refusals(args: argparse.Namespace) -> str | None:
    if getattr(args, "_nproc_per_node", None):
        return ("--nproc-per-node: a study's trials run one by one in this process; to use more processes or "
                "machines, start `vitkit tune` once per process with the same --storage and --study")
    if getattr(args, "resume", None):
        return "--resume: run the same `vitkit tune` command again to continue its study"
    if getattr(args, "_estimate", None) is not None:
        return "--estimate: estimate one run with `vitkit train --estimate`"
    if getattr(args, "_timeout", None) is not None and not args._timeout > 0:
        return f"--timeout {args._timeout:g}: minutes, more than 0"
    if getattr(args, "holdout", None) == 0:
        return ("--holdout 0 would choose the settings on the test split; tune validates on held-out training "
                "images (--holdout 0.1 by default)")
    return None


def _storage(url: str) -> Any:
    import warnings

    import optuna
    from optuna import storages

    # a trial whose process died is failed after grace_period without its heartbeat, and drawn again once (the
    # callback's name changed in Optuna 4.9)
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # (heartbeats: "experimental")
                if hasattr(storages, "RetryHeartbeatStaleTrialCallback"):
                    retry = {"heartbeat_stale_trial_callback": storages.RetryHeartbeatStaleTrialCallback(max_retry=1)}
                else:
                    retry = {"failed_trial_callback": storages.RetryFailedTrialCallback(max_retry=1)}
                return storages.RDBStorage(url, heartbeat_interval=60, grace_period=180, **retry)
        except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors (no such dialect, a file it cannot open) too
            if not isinstance(e, (ImportError, ValueError, optuna.exceptions.OptunaError)) \
                    and not type(e).__module__.startswith("sqlalchemy"):
                raise
            # processes started together on a new database create its tables at once: one wins, the others
            # find them half made (IntegrityError, "table ... already exists") or locked; a moment later they are there
            racing = type(e).__name__ == "IntegrityError" or "locked" in str(e) or "already exists" in str(e)
            if racing and attempt < 5:
                time.sleep(0.5 * 2 ** attempt)
                continue
            why = str(e).splitlines()[0]
            raise ValueError(f"--storage {url}: Optuna cannot open it ({type(e).__name__}: {why})") from None
    raise AssertionError("unreachable")


def _flag(name: str, value: Any) -> str:
    return f"--{name.replace('_', '-')} {value:.4g}" if isinstance(value, float) else f"--{name.replace('_', '-')} " \
                                                                                        f"{value}"


def run(args: argparse.Namespace) -> int:
    import sys

    if refused := _refusals(args):
        print(f"vitkit tune: error: {refused}", file=sys.stderr)
        return 2
    try:
        import optuna
    except ImportError:
        raise ValueError("vitkit tune needs Optuna: pip install 'vitkit[tune]'") from None
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    from ..training.sources import resolve
    from ..training.study import parse_space, suggest

    dims = parse_space(args._space or DEFAULT_SPACE)
    if not hasattr(args, "holdout"):
        args.holdout = HOLDOUT
    base, _, _ = resolve(train_cmd.sources(args), lambda s: None)  # the run's own values (the ranges' xF)
    if not base.holdout:  # (a --config file's holdout: 0)
        print("vitkit tune: error: " + _refusals(argparse.Namespace(holdout=0)), file=sys.stderr)  # type: ignore
        return 2
    if base.objective != "classify":
        raise ValueError("vitkit tune searches classifier training; pre-training has no validation top-1 to rank by")
    for d in dims:
        d.bounds(getattr(base, d.name))  # a range of multiples of nothing: refused before any trial
    out = Path(getattr(args, "output", None) or f"tune-{base.dataset}")
    if out.exists() and any(out.iterdir()) and not (out / "study.db").exists() and args._storage is None \
            and not any(out.glob("trial-*")):
        raise FileExistsError(f"{out} exists and is not a `vitkit tune` folder (no study.db, no trial-*); choose "
                              "another --output (nothing was overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    url = args._storage or f"sqlite:///{(out / 'study.db').resolve()}"
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # (its own lines and tracebacks: each trial says its end)
    seed = getattr(args, "seed", None)
    sampler = (optuna.samplers.TPESampler(seed=seed) if args._sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=seed))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2) if args._prune
              else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=args._study, storage=_storage(url), sampler=sampler, pruner=pruner,
                                direction="maximize", load_if_exists=True)
    space = [d.spec() for d in dims]
    if "space" not in study.user_attrs:
        study.set_user_attr("space", space)
        study.set_user_attr("dataset", base.dataset)
    elif study.user_attrs["space"] != space or study.user_attrs.get("dataset") != base.dataset:
        raise ValueError(f"study {args._study!r} in {url} searched {study.user_attrs.get('dataset')} over "
                         f"{' '.join(study.user_attrs['space'])}; this command asks {base.dataset} over "
                         f"{' '.join(space)}: give another --study (or --output) for a new search")
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    print(f"vitkit tune: study {args._study!r} in {url}: {done} of {args._trials} trials finished; searching "
          f"{' '.join(space)} ({args._sampler}; validated on {base.holdout:g} of the training images held out)",
          flush=True)
    stopped: list[int] = []
    failed: list[str] = []

    def objective(trial: Any) -> float:
        params = suggest(trial, dims, base)
        folder = out / f"trial-{trial.number:03d}"
        trial.set_user_attr("output", str(folder))
        targs = argparse.Namespace(**vars(args))
        for k, v in params.items():
            setattr(targs, k, v)
        targs.output, targs._started = str(folder), time.time()
        seen: list[float] = []
        pruned: list[int] = []

        def on_epoch(trainer: Any, row: dict[str, Any]) -> None:
            if row.get("val_top1") is None:
                return
            seen.append(row["val_top1"])
            trial.report(row["val_top1"], row["epoch"])
            if trial.should_prune():
                pruned.append(row["epoch"])
                trainer.log(f"vitkit tune: trial {trial.number} pruned at epoch {row['epoch']}: validation top-1 "
                            f"{row['val_top1']:.2f}% is below the median of the other trials' there")
                trainer.request_stop()

        print(f"\nvitkit tune: trial {trial.number}: " + " ".join(_flag(k, v) for k, v in params.items())
              + f" -> {folder}", flush=True)
        rc = train_cmd.run(targs, on_epoch=on_epoch)
        if pruned:
            raise optuna.TrialPruned()
        if rc == 3:  # diverged: these settings failed; the study goes on
            print(f"vitkit tune: trial {trial.number} diverged (its settings fail; the study goes on)", flush=True)
            return float("nan")
        if rc in (130, 128 + signal.SIGTERM) or rc < 0:
            stopped.append(rc)
            raise KeyboardInterrupt
        if rc != 0 or not seen:
            failed.append(f"trial {trial.number} did not run (exit {rc}; its error is above); the study stops")
            trial.study.stop()
            return float("nan")  # (failed, without Optuna's traceback of an exception)
        return max(seen)  # what its best/ holds

    try:
        if done < args._trials:
            study.optimize(objective, n_trials=args._trials - done,
                           timeout=args._timeout * 60 if args._timeout else None,
                           callbacks=[MaxTrialsCallback(args._trials, states=finished)])
    except KeyboardInterrupt:
        _summary(study, out, base)
        print(f"vitkit tune: stopped; the same command continues the study ({args._study!r} in {url})",
              file=sys.stderr)
        return stopped[0] if stopped and stopped[0] > 0 else 130
    _summary(study, out, base)
    if failed:
        raise ValueError(failed[0])
    return 0


def _summary(study: Any, out: Path, base: Any) -> None:
    """Every trial in one table, the best one's settings, and best.json."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    print(f"\n{'trial':>5}  {'state':<8} {'val_top1':>8}  settings -> folder")
    for t in trials:
        value = f"{t.value:.2f}" if t.value is not None else (f"{max(t.intermediate_values.values()):.2f}*"
                                                             if t.intermediate_values else "-")
        print(f"{t.number:>5}  {t.state.name.lower():<8} {value:>8}  "
              + " ".join(_flag(k, v) for k, v in t.params.items()) + f" -> {t.user_attrs.get('output', '?')}")
    if not any(t.state == TrialState.COMPLETE for t in trials):
        return
    best = study.best_trial
    flags = " ".join(_flag(k, v) for k, v in best.params.items())
    (out / "best.json").write_text(json.dumps({
        "trial": best.number, "val_top1": best.value, "params": best.params, "output": best.user_attrs.get("output"),
        "validated_on": f"{base.holdout:g} of the training images held out (--holdout)"}, indent=2))
    print(f"best: trial {best.number}, validation top-1 {best.value:.2f}% on held-out training images: {flags} "
          f"({best.user_attrs.get('output')}; written to {out / 'best.json'})\n"
          f"the final model, on every training image and measured on the test split: vitkit train <the same flags> "
          f"{flags} --holdout 0")
