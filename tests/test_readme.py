"""The README's tour runs as written, block after block, in one folder (issue 82: a tour whose commands fail in
order is worse than none).

Each ```bash block runs in bash in a fresh folder holding the team's ``ants-bees.zip`` and ``cifar10-jpg.zip``
(../shared/data) and this environment's ``vitkit`` on PATH; each ```python block in one namespace; ```console
blocks (a download, an apt-get) are shown, not run. Pretrained weights are timm's own saves of random weights in a
Hugging Face Hub cache (the layout huggingface_hub reads), offline. The commands are the README's, word for word;
only flags that make a run shorter are added (``SHORTER``), never another command, and ``vitkit serve`` is started,
asked for its page, and stopped with SIGTERM as a user's Ctrl-C or service manager would. The first block is
README command 1: its install is what CI's own fresh environment is; its ``vitkit train`` runs here, and command 2
(the suite) is this run.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, serve_then_stop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
from pages import fences  # noqa: E402  the site's own reading of a page

README = ROOT / "README.md"
SHARED_DATA = [ROOT.parent / "shared" / "data", Path("/work/shared/data")]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
HUB = ["vit_base_patch16_224.augreg2_in21k_ft_in1k", "vit_small_patch14_reg4_dinov2.lvd142m"]

# Flags added to a README command so that it is a short run of the same thing: (what the command holds, the flags).
# The first that matches is taken. Training keeps its --time-limit (the planner and the budget run as a user's
# would) and is capped at one epoch (of a small share of the larger datasets).
SHORTER = [
    ("calibrate", "--train-fraction 0.02"),
    ("bench", "--repeats 1 --no-compile --no-int8 --no-train --dtypes fp32"),  # (bf16 is emulated on some CPUs)
    ("train --init vit_base", "--train-fraction 0.05 -b 4 --epochs 1 --max-epochs 1 --eval-batch-size 16"),
    ("train --init vit_small", "--train-fraction 0.05 -b 4 --epochs 1 --max-epochs 1 --eval-batch-size 16 "
                               "--img-size 70"),
    ("fashion-mnist --time-limit", "--train-fraction 0.02 --epochs 1 --max-epochs 1"),
    ("--time-limit", "--epochs 1 --max-epochs 1"),  # (a budget's schedule grows up to --max-epochs: both cap it)
    ("vitkit train", "--epochs 2"),
    ("probe", "--epochs 2"),
]


def shorter(line: str) -> str:
    """``line`` (one command of a block) with SHORTER's flags added where it names a vitkit command."""
    if not re.search(r"\bvitkit\b", line) or line.lstrip().startswith(("for ", "done")):
        return line
    code, _, comment = line.partition("  #")
    for holds, flags in SHORTER:
        if holds in code:
            return f"{code.rstrip()} {flags}" + (f"  #{comment}" if comment else "")
    return line


def commands(code: str) -> str:
    """A bash block with its continued lines joined, each command made shorter."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return "\n".join(shorter(line) for line in joined.splitlines())


def serve(command: str, cwd: Path, env: dict) -> str:
    """README's ``vitkit serve``, on a free port, asked for its page and stopped with SIGTERM: what it printed."""
    port = free_port()
    code, out = serve_then_stop(shlex.split(command.replace("--port 7860", f"--port {port}")), port, cwd, env)
    assert code == 0, f"SIGTERM ended serve with {code}:\n{out[-3000:]}"
    return out


def test_commands_are_shortened_by_flags_only() -> None:
    line = "vitkit train --dataset fashion-mnist --time-limit 5 --output runs/fmnist  # a comment"
    assert shorter(line) == ("vitkit train --dataset fashion-mnist --time-limit 5 --output runs/fmnist "
                             "--train-fraction 0.02 --epochs 1 --max-epochs 1  # a comment")
    assert shorter("unzip -q ants-bees.zip") == "unzip -q ants-bees.zip"
    code = "vitkit train --init vit_base_patch16_224.augreg2_in21k_ft_in1k --dataset folder \\\n    --output runs/a\n"
    assert commands(code).startswith("vitkit train --init vit_base_patch16_224.augreg2_in21k_ft_in1k --dataset "
                                     "folder --output runs/a --train-fraction 0.05")


def test_the_readme_says_nothing_it_does_not_run() -> None:
    """Every block is run below or shown as console; the two install commands open it; it stays a guide."""
    blocks = fences(README.read_text())
    assert {b.lang for b in blocks} <= {"bash", "python", "console"}, {b.lang for b in blocks}
    first = blocks[0].code.splitlines()
    assert first[0].endswith("pip install -e . && vitkit train") and first[1].endswith("python -m pytest")
    assert len(README.read_text().splitlines()) <= 200
    for b in blocks:
        code = "\n".join(line.partition("  #")[0] for line in b.code.splitlines())  # the comments may say {a,b}
        assert not re.search(r"\{\w[\w-]*,", code), f"README.md:{b.line}: a {{a,b}} choice is not a command"
        assert "[--" not in code, f"README.md:{b.line}: an [optional] flag is not a command"


@pytest.mark.long
def test_the_readme_tour_runs_in_order(tmp_path: Path) -> None:
    for name in ("ants-bees.zip", "cifar10-jpg.zip"):
        found = next((d / name for d in SHARED_DATA if (d / name).is_file()), None)
        if found is None:
            pytest.skip(f"the README's tour reads {name}, which is not in ../shared/data here")
        (tmp_path / name).symlink_to(found)
    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("the README's tour reads Fashion-MNIST: apt-get install dataset-fashion-mnist")
    from test_after_paper import _hub_cache  # tests/ is on sys.path (pytest's rootdir conftest)

    (tmp_path / "hub").mkdir()
    hf = _hub_cache(tmp_path / "hub", HUB)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MPLBACKEND="Agg", HF_HOME=str(hf), HF_HUB_OFFLINE="1")
    blocks = [b for b in fences(README.read_text()) if b.lang in ("bash", "python")]
    for i, b in enumerate(blocks):
        if b.lang == "python":  # in a process of its own: huggingface_hub read HF_HOME when this one imported it
            done = subprocess.run([sys.executable, "-c", "\n" * (b.line - 1) + b.code], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=1200)
            assert done.returncode == 0, f"README.md:{b.line}: exit {done.returncode}\n{done.stderr[-4000:]}"
            continue
        code = commands(b.code)
        if i == 0:  # README command 1's install is CI's own; its training runs here, command 2 is this suite
            code = shorter("vitkit train")
        if code.lstrip().startswith("vitkit serve"):
            out = serve(code.strip(), tmp_path, env)
            assert "stopped" in out, out[-2000:]
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, f"README.md:{b.line}: exit {done.returncode}\n{code}\n" \
                                     f"{(done.stdout + done.stderr)[-4000:]}"
    assert (tmp_path / "runs" / "mae" / "best").is_dir() and (tmp_path / "recon.png").is_file()
    assert (tmp_path / "why" / "faithfulness.csv").is_file() and (tmp_path / "m8.onnx").is_file()
