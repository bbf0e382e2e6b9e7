"""``vitkit reproduce CLAIM [--data-dir D] [--target-dir D] [--budget-min N] [--quick] [--out DIR]``."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path


def add_parser(p: argparse.ArgumentParser) -> None:
    from ..reproduce import CLAIMS

    p.add_argument("claim", choices=list(CLAIMS), help="; ".join(f"{c.name}: {c.title}" for c in CLAIMS.values()))
    p.add_argument("--data-dir", default=None,
                   help="CIFAR-10 as an ImageFolder folder or zip (train/ and test/, e.g. cifar10-jpg.zip) or "
                        "torchvision's cifar-10-batches-py folder; with --dataset fashion-mnist its IDX files")
    p.add_argument("--dataset", choices=("cifar10", "fashion-mnist"), default="cifar10",
                   help="the data of data-size, posemb and patch-size (transfer pre-trains on CIFAR-10)")
    p.add_argument("--target-dir", default=None, help="transfer: the small dataset fine-tuned on (ImageFolder "
                                                      "folder or zip with train/ and val/, e.g. ants-bees.zip)")
    p.add_argument("--budget-min", type=float, default=None,
                   help="wall-clock minutes per run (default: the claim's: about an hour in all on 2 CPU cores for "
                        "data-size, posemb, transfer and patch-size, whose pre-training gets 5 of them; about 8 hours "
                        "for self-supervision, 30 minutes a comparison: the recipe's hybrid pre-trained by MAE (2 "
                        "seeds) and MPP against the default at 1%%, 10%% and 100%% of the labels, ~280 minutes, and "
                        "the plain ViT's runs, 190-230)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny slice of the data, narrow models, one epoch a run: checks the machinery, says "
                        "nothing about the claim (about a minute for the claims of a few runs; self-supervision has "
                        "27 runs, ~10 minutes on 2 CPU cores: --runs PREFIXES for fewer)")
    p.add_argument("--out", default=None, help="results folder (default results/<claim>[-quick]); a sweep that was "
                                               "stopped continues there")
    p.add_argument("--runs", default=None, metavar="PREFIXES",
                   help="only the runs whose names begin with one of these, joined by commas (e.g. hybrid-pretrain-"
                        "mae-seed0,default-10pct-seed0,hybrid-mae-10pct-seed0: the 10%% comparison of one seed, an "
                        "hour): a part of a claim in less time; the others can be added later with the same "
                        "--out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def data_settings(dataset: str, data_dir: str | None) -> dict[str, str]:
    """The training settings of the claim's data; a clear error when it is not where it was said to be."""
    if dataset == "fashion-mnist":
        return {"dataset": "fashion-mnist", **({"data_dir": data_dir} if data_dir else {})}
    if not data_dir:
        raise ValueError("CIFAR-10 is needed: give --data-dir (an ImageFolder folder or zip with train/ and test/, "
                         "such as cifar10-jpg.zip, or a folder holding torchvision's cifar-10-batches-py)")
    path = Path(data_dir)
    if not path.exists():
        raise FileNotFoundError(f"--data-dir {data_dir} not found")
    if (path / "cifar-10-batches-py").is_dir():
        return {"dataset": "cifar10", "data_dir": data_dir}
    return {"dataset": "folder", "data_dir": data_dir}


def run(args: argparse.Namespace) -> int:
    from ..reproduce import CLAIMS, Setup
    from ..reproduce.report import figure, summary
    from ..reproduce.sweep import SweepError, sweep
    from ..runtime.cpu import cpu_kind
    from ..runtime.threads import cores_text

    claim = CLAIMS[args.claim]
    if args.budget_min is not None and args.budget_min <= 0:
        print(f"vitkit reproduce: error: --budget-min must be more than 0, got {args.budget_min:g}", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/{claim.name}{'-quick' if args.quick else ''}")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    target = None
    if claim.name == "transfer":
        if not args.target_dir:
            raise ValueError("transfer needs --target-dir: the small dataset to fine-tune on (an ImageFolder folder "
                             "or zip with train/ and val/, such as ants-bees.zip)")
        if not Path(args.target_dir).exists():
            raise FileNotFoundError(f"--target-dir {args.target_dir} not found")
        target = {"dataset": "folder", "data_dir": args.target_dir}
    dataset = "cifar10" if claim.name == "transfer" else args.dataset
    budget = args.budget_min or claim.budget_min
    setup = Setup(data_settings(dataset, args.data_dir), dataset, budget, args.quick, target, out)
    runs = every = claim.runs(setup)
    if args.runs:
        wanted = tuple(p.strip() for p in args.runs.split(",") if p.strip())
        chosen = [r for r in runs if r.id.startswith(wanted)]
        if not chosen:
            raise ValueError(f"--runs {args.runs}: none of {claim.name}'s runs begins so ({', '.join(r.id for r in runs)})")
        runs = chosen
    out.mkdir(parents=True, exist_ok=True)
    command = "vitkit " + shlex.join(["reproduce", *sys.argv[2:]]) if sys.argv[1:2] == ["reproduce"] else \
        f"vitkit reproduce {claim.name}"
    print(f"{claim.name}: {len(runs)} runs" + ("" if args.quick else f" of {budget:g} min") + f" -> {out}; "
          f"machine: {cpu_kind()}", flush=True)
    start = time.time()
    common = {"claim": claim.name, "dataset": dataset, "held_equal": claim.held_equal, "cpu": cpu_kind(),
              "cores": cores_text(), "quick": args.quick}
    try:
        rows = sweep(runs, out, common, progress=not args.no_progress and sys.stderr.isatty())
    except SweepError as e:
        print(f"vitkit reproduce: error: {e} (the runs before it are kept: run the same command again to continue)",
              file=sys.stderr)
        return 1
    figure(claim, rows, out / "figure.png", args.quick)
    done = {r["run"] for r in rows}
    (out / "summary.md").write_text(summary(claim, rows, time.time() - start, args.quick, budget, command,
                                            [r.id for r in every if r.id not in done]))
    print(f"wrote {out / 'results.csv'}, {out / 'figure.png'}, {out / 'summary.md'}")
    print(claim.verdict(rows))
    return 0
