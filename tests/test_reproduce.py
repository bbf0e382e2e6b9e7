"""`vitkit reproduce`: the files a claim writes, resuming a stopped sweep, and the pieces the claims are built from
(class-balanced fractions, the ResNet baseline). Accuracies are never checked: --quick says nothing about a claim."""
from __future__ import annotations

import csv
import shutil

import pytest
import torch
from torchvision.models.resnet import BasicBlock

import vitkit
from vitkit.cli.main import main
from vitkit.data.splits import DataSplits, ImageTensors
from vitkit.model.config import ViTConfig

from helpers import write_digits_folder


@pytest.fixture(scope="module")
def cifar_like(tmp_path_factory):
    """Real digits as 32x32 RGB in CIFAR-10's ImageFolder layout: 500 train and 500 test images."""
    return write_digits_folder(tmp_path_factory.mktemp("c") / "cifar", per_class=50, size=32, val_split="test",
                               mode="RGB")


def _rows(out):
    with (out / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _check_files(out, n_runs):
    rows = _rows(out)
    assert len(rows) == n_runs and len({r["run"] for r in rows}) == n_runs
    for r in rows:
        assert 0 <= float(r["test_top1"]) <= 100 and int(r["epochs"]) == 1 and r["command"].startswith("vitkit train")
        assert float(r["gflop_per_train_image"]) > 0 and r["held_equal"] and r["cpu"]
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "summary.md").read_text()
    for part in ("**The paper.**", "**Ours.**", "**Held equal.**", "**Machine.**", "**Command.**", "| run |"):
        assert part in text
    return rows


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
def test_data_size_quick_writes_csv_figure_summary_and_resumes(cifar_like, tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["reproduce", "data-size", "--quick", "--data-dir", str(cifar_like), "--out", str(out)]) == 0
    rows = _check_files(out, 15)
    assert {r["model"] for r in rows} == {"vit", "hybrid", "resnet"}
    counts = {r["run"]: int(r["train_images"]) for r in rows}
    assert counts["vit-5pct"] <= counts["vit-100pct"] and counts["vit-5pct"] == counts["resnet-5pct"]
    # a sweep stopped after 12 runs: the last three never reached the CSV, one of them had finished training
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows[:12])
    shutil.rmtree(out / "runs" / "vit-50pct")
    shutil.rmtree(out / "runs" / "vit-25pct" / "last")  # cut off before its first checkpoint
    capsys.readouterr()
    assert main(["reproduce", "data-size", "--quick", "--data-dir", str(cifar_like), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "12 of 15 runs already" in said and said.count("test top-1") == 3
    again = _rows(out)
    assert again[:12] == rows[:12]  # finished runs are not repeated
    assert "resumed from" in (out / "runs" / "vit-100pct" / "train.log").read_text()  # trained, not redone
    assert [r["run"] for r in again] == [r["run"] for r in rows]


@pytest.mark.parametrize("claim, n", [("posemb", 9), ("patch-size", 3)])
def test_other_claims_quick(cifar_like, tmp_path, claim, n):
    out = tmp_path / claim
    assert main(["reproduce", claim, "--quick", "--data-dir", str(cifar_like), "--out", str(out)]) == 0
    rows = _check_files(out, n)
    if claim == "posemb":
        assert sorted({r["pos_embed"] for r in rows}) == ["learn", "none", "sincos2d"]
    else:
        gf = [float(r["gflop_per_train_image"]) for r in rows]
        assert gf[0] > gf[1] > gf[2]  # patch 2 > 4 > 8: more tokens, more compute


def test_transfer_quick_fine_tunes_from_the_pretraining(cifar_like, tmp_path):
    target = write_digits_folder(tmp_path / "target", per_class=6, size=32, mode="RGB")
    out = tmp_path / "tr"
    assert main(["reproduce", "transfer", "--quick", "--data-dir", str(cifar_like), "--target-dir", str(target),
                 "--out", str(out)]) == 0
    rows = {r["run"]: r for r in _check_files(out, 5)}
    assert "--init" in rows["finetune"]["command"] and "--freeze-body" in rows["linear-probe"]["command"]
    assert rows["finetune-2x-res"]["resolution"] == "64"
    log = (out / "runs" / "finetune-2x-res" / "train.log").read_text()
    assert "configs/finetune.yaml" in log


def test_self_supervision_quick_pretrains_without_labels_and_fine_tunes_from_it(cifar_like, tmp_path, capsys):
    out = tmp_path / "ss"
    assert main(["reproduce", "self-supervision", "--quick", "--data-dir", str(cifar_like), "--out", str(out),
                 "--runs", "pretrain-mae,scratch-10pct,mae-10pct"]) == 0
    said = capsys.readouterr().out
    rows = {r["run"]: r for r in _rows(out)}
    assert sorted(rows) == ["mae-10pct-seed0", "mae-10pct-seed1", "pretrain-mae", "scratch-10pct-seed0",
                            "scratch-10pct-seed1"]
    pre = rows.pop("pretrain-mae")  # no labels, so no top-1: its own task's loss on the test images
    assert pre["test_top1"] == "" and float(pre["test_loss"]) > 0 and "pretrain-mae: test loss" in said
    assert pre["command"].startswith("vitkit pretrain --method mae")
    assert len({r["train_images"] for r in rows.values()}) == 1  # every labelled run trains on the same images
    for r in rows.values():
        assert 0 <= float(r["test_top1"]) <= 100 and r["command"].startswith("vitkit train")
        assert "--train-fraction" in r["command"] and "--grad-accum 1 --crop-padding" in r["command"]
    tuned = rows["mae-10pct-seed1"]["command"]  # the plain ViT's pair: fine-tuned as its scratch run trains, unmixed
    assert f"--init {out / 'runs' / 'pretrain-mae' / 'last'} --layer-decay 0.75 --mixup 0 --cutmix 0" in tuned
    assert "--drop-path 0.0" in tuned
    assert "--init" not in rows["scratch-10pct-seed1"]["command"]
    text = (out / "summary.md").read_text()
    assert "per comparison" in text and "10% of the labels: from scratch" in text
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
def test_self_supervision_sets_the_recipes_hybrid_pre_trained_against_the_default(cifar_like, tmp_path, capsys):
    """Issue 66: the comparison a user faces. The default is `vitkit train` with nothing but the data, the share,
    the seed and the time; each seed pre-trains its own encoder (the recipe's hybrid), fine-tuned by --init alone."""
    out = tmp_path / "ss"
    assert main(["reproduce", "self-supervision", "--quick", "--data-dir", str(cifar_like), "--out", str(out),
                 "--runs", "hybrid-pretrain-mae,default-10pct,hybrid-mae-10pct"]) == 0
    said = capsys.readouterr().out
    rows = {r["run"]: r for r in _rows(out)}
    assert sorted(rows) == ["default-10pct-seed0", "default-10pct-seed1", "hybrid-mae-10pct-seed0",
                            "hybrid-mae-10pct-seed1", "hybrid-pretrain-mae-seed0", "hybrid-pretrain-mae-seed1"]
    # the default is its own control now (configs/cifar10.yaml's tier above 50): no control run
    assert main(["reproduce", "self-supervision", "--quick", "--data-dir", str(cifar_like), "--out", str(out),
                 "--runs", "control-10pct-seed0"]) == 2 and "none of self-supervision's runs" in capsys.readouterr().err
    assert "MixUp 0.8, CutMix 1.0" in (out / "runs" / "hybrid-mae-10pct-seed0" / "train.log").read_text()
    for seed in (0, 1):
        tuned = rows[f"hybrid-mae-10pct-seed{seed}"]["command"]
        assert f"--init {out / 'runs' / f'hybrid-pretrain-mae-seed{seed}' / 'last'}" in tuned
        assert "--layer-decay" not in tuned and "--opt" not in tuned  # --init picks MAE's fine-tuning by itself
        default = rows[f"default-10pct-seed{seed}"]["command"]
        assert "--init" not in default and "--lr" not in default and "--model" not in default
        assert "--hybrid" not in rows[f"hybrid-pretrain-mae-seed{seed}"]["command"]  # the recipe's own model
    log = (out / "runs" / "hybrid-pretrain-mae-seed0" / "train.log").read_text()
    assert "its CNN stem conv:64,64,M,128,128,M run on each visible cell alone" in log
    assert "fine-tuned as MAE's are" in (out / "runs" / "hybrid-mae-10pct-seed1" / "train.log").read_text()
    assert vitkit.load(str(out / "runs" / "hybrid-mae-10pct-seed0" / "best")).config.hybrid == "conv:64,64,M,128,128,M"
    text = (out / "summary.md").read_text()
    assert "against what `vitkit train` gives by default" in text and "10% of the labels: the default" in text
    assert "the default with the fine-tuning's regularisation and no pre-training" not in text  # (no control run)


def test_missing_data_is_a_message(tmp_path, capsys):
    assert main(["reproduce", "posemb", "--quick", "--out", str(tmp_path / "o")]) == 2
    assert "give --data-dir" in capsys.readouterr().err
    assert main(["reproduce", "transfer", "--quick", "--data-dir", str(tmp_path)]) == 2
    assert "--target-dir" in capsys.readouterr().err
    assert main(["reproduce", "posemb", "--data-dir", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


def test_train_fractions_are_class_balanced_nested_and_fixed():
    labels = torch.arange(10).repeat_interleave(100)[torch.randperm(1000, generator=torch.Generator().manual_seed(3))]
    i = torch.arange(1000)
    images = torch.zeros(1000, 1, 2, 2, dtype=torch.uint8)
    images[:, 0, 0, 0], images[:, 0, 0, 1] = (i // 256).to(torch.uint8), (i % 256).to(torch.uint8)  # each one named
    val = ImageTensors(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))
    data = DataSplits("t", ImageTensors(images, labels), val, [str(c) for c in range(10)])

    def ids(d: DataSplits) -> set[int]:
        return set((d.train.images[:, 0, 0, 0].long() * 256 + d.train.images[:, 0, 0, 1].long()).tolist())

    small, large = data.with_train_fraction(0.05), data.with_train_fraction(0.25)
    assert torch.bincount(small.train.labels).tolist() == [5] * 10
    assert torch.bincount(large.train.labels).tolist() == [25] * 10
    assert all(int(labels[k]) == int(c) for k, c in zip(sorted(ids(small)), small.train.labels))  # labels kept
    assert ids(small) <= ids(large) and ids(data.with_train_fraction(0.05)) == ids(small)
    assert data.with_train_fraction(1.0) is data


def test_the_resnet_baseline_is_torchvision_basic_blocks_with_no_transformer_layer():
    c = ViTConfig(img_size=32, patch_size=1, embed_dim=64, depth=0, num_heads=4, pool="gap", pos_embed="none",
                  hybrid="conv:16,R16,M,R32", num_classes=10)
    m = vitkit.VisionTransformer(c)
    blocks = [b for b in m.modules() if isinstance(b, BasicBlock)]
    assert len(blocks) == 2 and len(m.blocks) == 0
    ref = BasicBlock(16, 32, downsample=torch.nn.Sequential(torch.nn.Conv2d(16, 32, 1, bias=False),
                                                          torch.nn.BatchNorm2d(32)))
    assert sum(p.numel() for p in blocks[1].parameters()) == sum(p.numel() for p in ref.parameters())
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="0 only with a hybrid stem"):
        ViTConfig(depth=0)
    assert ViTConfig(hybrid="none").hybrid is None


def test_a_truncated_zip_or_a_foreign_results_csv_is_a_message(cifar_like, tmp_path, capsys):
    import zipfile

    whole = tmp_path / "c.zip"
    with zipfile.ZipFile(whole, "w") as z:
        for f in sorted(cifar_like.rglob("*.png"))[:50]:
            z.write(f, f.relative_to(cifar_like))
    cut = tmp_path / "cut.zip"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main(["reproduce", "posemb", "--quick", "--data-dir", str(cut), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "run none-seed0 failed" in err and "not a readable zip" in err and "Traceback" not in err
    assert main(["train", "--dataset", "folder", "--data-dir", str(cut), "--output", str(tmp_path / "t")]) == 2
    assert "not a readable zip" in capsys.readouterr().err
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "results.csv").write_text("name,score\nx,1\n")
    assert main(["reproduce", "posemb", "--quick", "--data-dir", str(cifar_like), "--out", str(foreign)]) == 2
    assert "not a results.csv of vitkit reproduce" in capsys.readouterr().err
    assert (foreign / "results.csv").read_text() == "name,score\nx,1\n"  # left as it was


def test_each_runs_command_is_the_vitkit_train_command_of_its_settings_and_no_cli_is_imported(tmp_path):
    import ast
    import shlex
    from pathlib import Path

    from vitkit.cli.main import build_parser
    from vitkit.cli.train import sources
    from vitkit.reproduce import CLAIMS, Setup

    setup = Setup({"dataset": "folder", "data_dir": "c.zip"}, "cifar10", 3.5, False,
                  {"dataset": "folder", "data_dir": "t.zip"}, tmp_path)
    for claim in CLAIMS.values():
        for run in claim.runs(setup):
            src = sources(build_parser().parse_args(shlex.split(run.command())[1:]))
            want = run.train_settings()
            assert src.given == {k: v for k, v in want.items() if k != "model_args"}, run.id
            assert src.model_args == want.get("model_args", {}), run.id
    package = Path(vitkit.__file__).parent / "reproduce"
    for f in package.glob("*.py"):  # the sweep calls the library (planner, Trainer) and gets results back
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "cli" not in (node.module or "").split("."), f"{f.name} imports {node.module}"


@pytest.mark.long
def test_self_supervision_sets_both_semi_supervised_arms_against_the_default(cifar_like, tmp_path, capsys):
    """Issue 83: the claim gains the two one-run arms, each the default's command with --semi, the same labels, the
    same total time, two seeds at the judged share; the verdict compares each with the default."""
    out = tmp_path / "ss"
    assert main(["reproduce", "self-supervision", "--quick", "--data-dir", str(cifar_like), "--out", str(out),
                 "--runs", "default-10pct,joint-10pct,fixmatch-10pct"]) == 0
    rows = {r["run"]: r for r in _rows(out)}
    assert sorted(rows) == [f"{arm}-10pct-seed{s}" for arm in ("default", "fixmatch", "joint") for s in (0, 1)]
    for s in (0, 1):
        default = rows[f"default-10pct-seed{s}"]["command"]
        for arm in ("joint", "fixmatch"):
            assert rows[f"{arm}-10pct-seed{s}"]["command"] == default.replace(" --seed", f" --semi {arm} --seed") \
                or rows[f"{arm}-10pct-seed{s}"]["command"] == f"{default} --semi {arm}", (default, arm)
            assert rows[f"{arm}-10pct-seed{s}"]["train_images"] == rows[f"default-10pct-seed{s}"]["train_images"]
    text = (out / "summary.md").read_text()
    assert "--semi joint (MAE's loss beside the labels)" in text and "--semi fixmatch (confident pseudo-labels)" in text
    assert "over the default; 2 seeds" in text
