"""How a ``--time-limit`` is spent: planning, the time to the first training step, the wall time, the steps it
trained and what they reached, on real data, on a quiet machine and beside a busy loop (issue 79).

Each run is ``vitkit train --time-limit N`` in a fresh process with empty caches (vitkit's and Inductor's, as a
first run's are), the data named below; the neighbour is ``python3 -c 'while 1: pass'`` at normal priority, started
before the run (``busy``) or at its middle (``busy-mid``), or another PyTorch job (a matmul loop on every core) at
``nice -n 19`` started before it (``nice19``), or both (``shared``), ended after it. Rows go to
``results/budget-use.csv`` with the CPU kind::

    python benchmarks/budget_use.py                        # every dataset, 1 and 5 minutes, quiet and busy
    python benchmarks/budget_use.py --only cifar10 --budgets 5 --loads quiet busy

The datasets: scikit-learn's digits, Fashion-MNIST (``/usr/share/datasets/fashion-mnist``), the CIFAR-10 JPEG zip
(``../shared/data/cifar10-jpg.zip``), three of its classes (airplane, automobile, bird: a zip this script writes)
and ants-bees (``../shared/data/ants-bees.zip``). One run is timed at a time; nothing else heavy should run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import append_csv_rows, cpu_label, csv_arg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
THREE = ("airplane", "automobile", "bird")


def three_classes(cifar: Path, out: Path) -> Path:
    """A zip of CIFAR-10's ``THREE`` classes (train and test), from the zip of all ten."""
    dest = out / "cifar3.zip"
    if not dest.exists():
        with zipfile.ZipFile(cifar) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as z:
            for name in src.namelist():
                if any(f"/{c}/" in name for c in THREE):
                    z.writestr(name, src.read(name))
    return dest


def datasets(tmp: Path) -> dict[str, list[str]]:
    cifar = SHARED / "cifar10-jpg.zip"
    return {"digits": ["--dataset", "digits"],
            "fashion-mnist": ["--dataset", "fashion-mnist", "--data-dir", str(FMNIST)],
            "cifar10": ["--dataset", "folder", "--data-dir", str(cifar)],
            "cifar10-3": (["--dataset", "folder", "--data-dir", str(three_classes(cifar, tmp))]
                          if cifar.exists() else []),
            "ants-bees": ["--dataset", "folder", "--data-dir", str(SHARED / "ants-bees.zip")]}


NEIGHBOURS = {"busy": [sys.executable, "-c", "while 1: pass"],
              "nice19": ["nice", "-n", "19", sys.executable, "-c",
                         "import torch\na = torch.randn(1024, 1024)\nwhile 1: a @ a"]}
# the neighbours each load starts before the run (busy-mid: the busy loop at the run's middle); shared: both, as a
# user's machine is (a browser's busy core and another job)
SHARED_BY = {"busy": ["busy"], "nice19": ["nice19"], "shared": ["busy", "nice19"]}


def run(args: list[str], minutes: float, load: str, tmp: Path, logs: Path | None = None) -> dict:
    """One ``vitkit train`` run, timed from its start, beside the neighbour ``load`` asks for; its output and plan.json
    kept at ``logs`` (.log, .plan.json) where given."""
    out, cache = tempfile.mkdtemp(dir=tmp), tempfile.mkdtemp(dir=tmp)
    # (Inductor's own cache too: a compile tried by an earlier run took a few seconds, not a cold one's 30-40)
    env = {**os.environ, "VITKIT_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor")}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "vitkit", "train", *args, "--time-limit", f"{minutes:g}", "--output", out]
    busy = [subprocess.Popen(NEIGHBOURS[n]) for n in SHARED_BY.get(load, [])]
    if "nice19" in SHARED_BY.get(load, []):
        time.sleep(2)  # (its torch import: the run starts beside a job already computing)
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if load == "busy-mid":
        try:
            p.wait(timeout=minutes * 30)
        except subprocess.TimeoutExpired:
            busy = [subprocess.Popen(NEIGHBOURS["busy"])]
    printed, _ = p.communicate()
    wall = time.time() - t0
    for b in busy:
        b.kill()
        b.wait()
    final = next((line for line in reversed(printed.splitlines()) if line.startswith("final:")), "")
    fields = dict(kv.split("=", 1) for kv in final.split()[1:]) if final else {}
    plan = json.loads((Path(out) / "plan.json").read_text()) if (Path(out) / "plan.json").is_file() else {}
    if logs is not None:
        logs.parent.mkdir(parents=True, exist_ok=True)
        logs.with_suffix(".log").write_text(printed)
        logs.with_suffix(".plan.json").write_text(json.dumps(plan, indent=1))
    error = "" if p.returncode == 0 else next((line for line in reversed(printed.splitlines()) if line.strip()), "")
    return {"planning_s": round(plan.get("seconds", 0.0), 1), "first_step_s": plan.get("first_step_s", ""),
            "tuning_excess_s": (plan.get("tuned") or {}).get("excess_s", ""), "wall_s": round(wall, 1),
            "steps": fields.get("steps", ""), "epochs": fields.get("epochs", ""),
            "val_top1": fields.get("val_top1", ""), "chosen": json.dumps(plan.get("chosen", {})),
            "error": error[:200]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="datasets (default: all of them)")
    ap.add_argument("--budgets", nargs="*", type=float, default=[1.0, 5.0], help="minutes")
    ap.add_argument("--loads", nargs="*", default=["quiet", "busy"], choices=["quiet", "busy", "busy-mid", "nice19",
                                                                                 "shared"])
    ap.add_argument("--csv", type=csv_arg, default=str(ROOT / "results" / "budget-use.csv"))
    ap.add_argument("--note", default="", help="a word on the rows (what differs from the usual)")
    ap.add_argument("--logs", type=Path, default=None, help="keep each run's output and plan.json here")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, args in datasets(tmp).items():
            if (a.only and name not in a.only) or not args:
                continue
            for minutes in a.budgets:
                for load in a.loads:
                    row = {"cpu": cpu_label(), "date": time.strftime("%Y-%m-%d"), "commit": commit,
                           "dataset": name, "budget_s": round(minutes * 60), "load": load,
                           **run(args, minutes, load, tmp, a.logs and a.logs / f"{name}-{minutes:g}min-{load}"),
                           "note": a.note}
                    print(json.dumps(row), flush=True)
                    append_csv_rows(a.csv, [row])


if __name__ == "__main__":
    main()
