"""Nothing crashes, nothing silently wrong, round 6 (issue 81): each item reproduced as the red team found it first.
Every refusal is one line naming the flag, file or key and what is expected; every setting taken from elsewhere
is said."""
from __future__ import annotations

import json

import pytest
import yaml

from vitkit.cli.main import main

TINY = ["--depth", "1", "--embed-dim", "32", "--num-heads", "2"]


def _one_line(capsys, code, want: str) -> str:
    err = capsys.readouterr().err
    lines = [line.split("\r")[-1] for line in err.splitlines() if line.strip()]
    lines = [line for line in lines if line.strip() and "it/s]" not in line]  # (a progress bar's)
    assert code == 2 and "Traceback" not in err and len(lines) == 1 and want in lines[0], err
    return lines[0]


def test_c2_a_model_mapping_in_a_config_file_is_one_line_naming_the_file_and_model_args(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {depth: 4.5}\n")  # was: TypeError: unhashable type: 'dict'
    line = _one_line(capsys, main(["train", "--config", str(cfg), "--epochs", "1"]), f"{cfg}: model names a model")
    assert "model_args" in line
    cfg.write_text("epochs: [1, 2]\n")  # any key of the wrong kind is named with its file, before anything merges
    _one_line(capsys, main(["train", "--config", str(cfg)]), f"{cfg}: epochs must be a whole number")


def test_s2_continued_mae_keeps_the_checkpoints_norm_pix_loss_unless_a_flag_says_otherwise(tmp_path, capsys):
    first = tmp_path / "plain"
    assert main(["pretrain", "--method", "mae", "--epochs", "1", "--no-norm-pix-loss", *TINY,
                 "--output", str(first)]) == 0
    assert json.loads((first / "best" / "ssl.json").read_text())["norm_pix_loss"] is False
    capsys.readouterr()
    assert main(["pretrain", "--method", "mae", "--init", str(first / "best"), "--epochs", "1",
                 "--output", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "again" / "best" / "ssl.json").read_text())["norm_pix_loss"] is False  # was True
    assert "its own norm_pix_loss False and mask ratio 0.75 (no flag changes them)" in out
    assert "as the flags ask" not in out
    assert main(["pretrain", "--method", "mae", "--init", str(first / "best"), "--epochs", "1", "--norm-pix-loss",
                 "--output", str(tmp_path / "asked")]) == 0
    assert "as the flags ask: norm_pix_loss False -> True" in capsys.readouterr().out
    assert json.loads((tmp_path / "asked" / "best" / "ssl.json").read_text())["norm_pix_loss"] is True
    assert main(["pretrain", "--method", "mae", "--epochs", "1", *TINY, "--output", str(tmp_path / "new")]) == 0
    assert json.loads((tmp_path / "new" / "best" / "ssl.json").read_text())["norm_pix_loss"] is True  # He et al.'s


def test_c1_a_run_folder_whose_first_last_save_died_can_be_started_over_and_nothing_is_lost(tmp_path, capsys):
    """kill -9 or a full disk during the first save of last/, best/ already written: every command answered
    "already holds a run; use --resume auto", and --resume auto answered the same."""
    import shutil

    run = tmp_path / "run"
    cmd = ["train", "--epochs", "1", *TINY, "--output", str(run)]
    assert main(cmd) == 0
    shutil.rmtree(run / "last")
    best = (run / "best" / "model.safetensors").read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    capsys.readouterr()
    line = _one_line(capsys, main(cmd), "--resume auto starts it over there")
    assert "no last/ checkpoint" in line and (run / "best").is_dir()  # refused, nothing touched
    assert main([*cmd, "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"{run} holds no last/ checkpoint to continue" in out and "starting it over there" in out
    aside = next(run.glob("before-restart-*"))
    assert (aside / "best" / "model.safetensors").read_bytes() == best and (aside / "metrics.jsonl").is_file()
    assert (run / "last" / "train_state.pt").is_file() and (run / "best").is_dir()  # the new run's
    assert main(["train", "--resume", str(copy)]) == 0  # the folder named: the same, as that run (its settings)
    out = capsys.readouterr().out
    assert "starting it over there" in out and next(copy.glob("before-restart-*"))
    assert "the run starts over with its own settings" in out
    restarted = yaml.safe_load((copy / "config.yaml").read_text())
    assert restarted["epochs"] == 1 and restarted["model_args"]["depth"] == 1  # (not the digits recipe's 40 epochs)


def test_u2_a_checkpoint_missing_one_of_its_two_objective_files_names_the_one_missing(tmp_path, capsys):
    import shutil

    first = tmp_path / "mae"
    assert main(["pretrain", "--method", "mae", "--epochs", "1", *TINY, "--output", str(first)]) == 0
    no_weights = tmp_path / "no-weights"
    shutil.copytree(first / "best", no_weights)
    (no_weights / "ssl.safetensors").unlink()
    capsys.readouterr()
    code = main(["pretrain", "--method", "mae", "--init", str(no_weights), "--epochs", "1",
                 "--output", str(tmp_path / "a")])
    _one_line(capsys, code, f"{no_weights}: ssl.json is there, but not ssl.safetensors")
    no_json = tmp_path / "no-json"
    shutil.copytree(first / "best", no_json)
    (no_json / "ssl.json").unlink()
    assert main(["pretrain", "--method", "mae", "--init", str(no_json), "--epochs", "1",
                 "--output", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"has ssl.safetensors but not ssl.json, which says what they are" in out and "no ssl.json and" not in out


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` (IHDR, then IEND: no pixels); PIL reads its size at open."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) \
        + chunk(b"IEND", b"")


def test_u11_an_image_too_large_to_decode_is_refused_for_its_size(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(tmp_path / split / c / f"{i}.png")
    bomb = tmp_path / "train" / "a" / "huge.png"
    bomb.write_bytes(_png_header(60000, 60000))
    code = main(["train", "--dataset", "folder", "--data-dir", str(tmp_path), "--epochs", "1", *TINY,
                 "--output", str(tmp_path / "run")])
    line = _one_line(capsys, code, str(bomb))
    assert "3,600,000,000 pixels, more than the limit of" in line and "not an image PIL can read" not in line
    from vitkit.data.images import BadImageError, open_image

    with pytest.raises(BadImageError, match="3,600,000,000 pixels, more than the limit of 40,000,000"):
        open_image(bomb.read_bytes(), str(bomb))


@pytest.mark.parametrize("flags,want", [
    (["--compile", "reduce-overhead"], "--compile reduce-overhead: CUDA graphs, which a GPU runs; this run is on cpu"),
    (["--decode", "workers"], "--decode workers: where streamed files are decoded; digits is held in memory")])
def test_u9_a_setting_that_means_nothing_here_is_refused_not_ignored(flags, want, capsys):
    _one_line(capsys, main(["train", "--epochs", "1", *TINY, *flags]), want)


def test_s1_pretraining_never_trains_on_a_test_folder_beside_loose_training_images(tmp_path, capsys):
    """train/ holds loose images, test/<class>/ is labelled: pre-training read all of it as one flat folder and
    trained on the test images (142/8 re-split)."""
    import numpy as np
    from PIL import Image

    from vitkit.data.folder import folder_items

    def save(where, i):
        where.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (8, 8, 3), np.uint8)).save(where)

    for i in range(12):
        save(tmp_path / "train" / f"{i}.png", i)
    for c in ("cat", "dog"):
        for i in range(3):
            save(tmp_path / "test" / c / f"{i}.png", 100 + i)
    _, _, items = folder_items(str(tmp_path), unlabeled=True)
    assert sorted(n for n, _ in items["train"]) == sorted(f"train/{i}.png" for i in range(12))
    assert sorted(n for n, _ in items["val"]) == sorted(f"test/{c}/{i}.png" for c in ("cat", "dog") for i in range(3))
    assert main(["pretrain", "--method", "mae", "--dataset", "folder", "--data-dir", str(tmp_path), "--epochs", "1",
                 *TINY, "--patch-size", "4", "--output", str(tmp_path.parent / f"{tmp_path.name}-run")]) == 0
    assert "12 images outside test/ trained on; test/'s 6 validate" in capsys.readouterr().out
    (tmp_path / "train").rename(tmp_path / "elsewhere")
    import shutil

    shutil.rmtree(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="every image is under test/, a split held out"):
        folder_items(str(tmp_path), unlabeled=True)


def test_u10_a_tampered_checkpoint_config_is_named_not_blamed_on_the_data(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--epochs", "1", *TINY, "--output", str(run)]) == 0
    cfg_file = run / "last" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["preprocessing"]["class_names"] = list("abcdefghij")
    cfg_file.write_text(json.dumps(cfg))
    capsys.readouterr()
    line = _one_line(capsys, main(["train", "--resume", str(run), "--epochs", "2"]),
                     f"{cfg_file} lists the classes [a, b, c, d, e, f, ... 10 in all], but the run's best/ and this "
                     "data have")
    assert "was changed after the run wrote it" in line and "this data has" not in line


@pytest.mark.parametrize("flags,want", [
    ([], "--estimate times a run streamed from the files; digits is held in memory"),
    (["--dataset", "digits"], "--estimate times a run streamed from image files"),
    (["--dataset", "folder", "--data-dir", "x", "--data-mode", "memory"], "--data-mode stream or auto, not memory")])
def test_u6_estimate_on_data_held_in_memory_is_refused_before_the_plan(flags, want, capsys):
    code = main(["train", "--estimate", *TINY, *flags])
    said = capsys.readouterr()
    assert code == 2 and want in said.err and "plan:" not in said.out, (said.out[-500:], said.err[-500:])


def test_new_user_serve_stopped_by_sigterm_ends_with_0_and_a_line(tmp_path):
    """A service manager's stop (SIGTERM) ended `vitkit serve` with 143 and nothing said: uvicorn shuts down, then
    raises the signal again under the default handler."""
    import sys

    from helpers import free_port, serve_then_stop

    import vitkit

    model = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, patch_size=8, depth=1)
    model.save_pretrained(tmp_path / "m")
    port = free_port()
    code, out = serve_then_stop([sys.executable, "-m", "vitkit", "serve", "--checkpoint", str(tmp_path / "m"),
                                 "--port", str(port)], port, wait_s=120)
    assert code == 0, out
    assert out.rstrip().splitlines()[-1] == "vitkit demo stopped (SIGTERM)" and "Traceback" not in out, out


@pytest.mark.parametrize("flag", [["--mixup", "0.8"], ["--smoothing", "0.1"], ["--freeze-body"],
                                  ["--layer-decay", "0.75"]])
def test_pretrain_refuses_flags_that_act_on_labels_and_does_not_list_them(flag, capsys):
    """`pretrain --help` listed train's label flags; given, they were taken without effect on a run with no labels."""
    _one_line(capsys, main(["pretrain", "--method", "mae", *flag, "--epochs", "1", *TINY]),
              f"{flag[0]} acts on labels or a fine-tuned head")
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert flag[0] not in capsys.readouterr().out


def test_new_user_the_pretrained_list_fits_a_wide_terminal_and_names_stay_whole(capsys):
    """`vitkit models --pretrained` was over 300 columns: the official .npz names and the download URLs."""
    from vitkit.interop.registry import list_pretrained

    assert main(["models", "--pretrained"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 110, max(out.splitlines(), key=len)
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {e.name for e in list_pretrained("")} <= names  # every name whole, to copy
    assert main(["models", "--pretrained", "--sources", "augreg2"]) == 0
    assert "hf.co/timm/vit_base_patch16_224.augreg2_in21k_ft_in1k/model.safetensors" in capsys.readouterr().out
    assert main(["models", "--pretrained", "nosuch"]) == 1  # (was a header alone)
    assert "no registered weights' name contains 'nosuch'" in capsys.readouterr().out


def test_u3_a_batch_larger_than_the_data_is_refused_from_the_counts_before_memory_is_measured(capsys, monkeypatch):
    """`-b 100000` on digits: the memory plan split it 50000 x 2, then "fewer than one global batch (1 x 50000)"."""
    import vitkit.training.plan as plan

    measured = []
    monkeypatch.setattr(plan, "_fit_memory", lambda *a, **k: measured.append(1) or a[4:])
    line = _one_line(capsys, main(["train", "-b", "100000", "--epochs", "1", *TINY]),
                     "1,437 training images are fewer than one global batch of 100,000")
    assert "lower --batch-size" in line and not measured


def test_d2_the_imagenet_estimate_on_a_few_images_is_refused_from_the_counts_before_any_timing(tmp_path, capsys,
                                                                                               monkeypatch):
    """`--recipe imagenet-vit-s16 --estimate` on 150 tiny images printed nothing for 150 s after the memory line
    (ViT-S/16's candidates timed at 224 px), then refused: 150 images make no batch of 1,024."""
    from helpers import write_digits_folder

    import vitkit.training.plan as plan

    timed = []
    monkeypatch.setattr(plan, "_fit_memory", lambda *a, **k: timed.append(1) or a[4:])
    root = write_digits_folder(tmp_path / "f", per_class=15, size=32, mode="RGB")
    line = _one_line(capsys, main(["train", "--recipe", "imagenet-vit-s16", "--dataset", "folder", "--data-dir",
                                   str(root), "--estimate", "--cache-dir", str(tmp_path / "c")]),
                     "150 training images are fewer than one global batch of 1,024")
    assert "lower --batch-size" in line and not timed


@pytest.mark.parametrize("method", ["mpp", "mae"])
def test_u8_an_older_mpp_run_resumed_says_its_masks_differ(method, tmp_path):
    """An MPP run saved before the masks were drawn by ``noise()`` continued on other masks, without a word. (MAE's
    draws did not change: no note.)"""
    import torch

    from vitkit.training.config import TrainConfig
    from vitkit.training.trainer import Trainer

    cfg = dict(objective=method, epochs=2, batch_size=64, model_args={"img_size": 8, "patch_size": 2,
                                                                      "embed_dim": 32, "depth": 1, "num_heads": 2},
               precision="fp32", compile=False, attention="sdpa", channels_last=False, tiers=None, threads=1,
               output=str(tmp_path / "r"))
    t = Trainer(TrainConfig.from_dict({**cfg, "epochs": 1}), log=lambda s: None, progress=False)
    t.fit()
    state = tmp_path / "r" / "last" / "train_state.pt"
    s = torch.load(state, weights_only=True)
    assert s.pop("masks") == 2
    torch.save(s, state)  # as an older vitkit wrote it
    said: list[str] = []
    Trainer(TrainConfig.from_dict({**cfg, "resume": str(tmp_path / "r")}), log=said.append, progress=False).fit()
    noted = [line for line in said if "saved by an older vitkit" in line]
    assert (len(noted) == 1 and "other masks" in noted[0]) if method == "mpp" else not noted, said


def test_new_user_classes_picks_a_subset_by_name_relabelled_in_the_datasets_order(tmp_path):
    """Training on a few classes of a folder needed a hand-written filter: `--classes a,b,c` is one flag."""
    import torch
    from helpers import write_digits_folder

    from vitkit.data.datasets import load_dataset

    root = write_digits_folder(tmp_path / "f", per_class=6, size=16)
    every = load_dataset("folder", str(root), cache_dir=str(tmp_path / "c"), mode="memory")
    for mode in ("memory", "stream"):
        some = load_dataset("folder", str(root), cache_dir=str(tmp_path / "c"), mode=mode, classes=["8", "3"])
        assert some.classes == ["3", "8"] and "classes 3, 8 of 10 (--classes)" in some.describe()
        for split, whole in ((some.train, every.train), (some.val, every.val)):
            assert sorted(split.labels.tolist()) == sorted([0] * (whole.labels == 3).sum().item()
                                                           + [1] * (whole.labels == 8).sum().item())
            if mode == "memory":  # the same pixels, renumbered: class 3's images are label 0
                assert torch.equal(split.images[split.labels == 0], whole.images[whole.labels == 3])
            else:  # streamed: only those classes' files, each with its class's new number
                assert all(("/3/" in n) == (lab == 0) for n, lab in zip(split.names, split.labels.tolist()))
    with pytest.raises(ValueError, match=r"--classes: cat is not a class of folder:.*; its classes: 0, 1, 2"):
        load_dataset("folder", str(root), cache_dir=str(tmp_path / "c"), classes=["3", "cat"])


def test_new_user_classes_trains_saves_those_names_and_eval_follows_them(tmp_path, capsys):
    import json

    cfg = tmp_path / "c.yaml"
    cfg.write_text("classes: [3, 5, 8]\n")  # YAML's numbers are the digits' class names
    assert main(["train", "--config", str(cfg), "--epochs", "1", *TINY, "--output", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "3 classes, classes 3, 5, 8 of 10 (--classes)" in out
    saved = json.loads((tmp_path / "r" / "best" / "config.json").read_text())
    assert saved["preprocessing"]["class_names"] == ["3", "5", "8"]
    assert main(["eval", "--checkpoint", str(tmp_path / "r" / "best")]) == 0  # no flag: the classes it knows
    assert "was trained on 3 of its classes (3, 5, 8): evaluated on those" in capsys.readouterr().out
    _one_line(capsys, main(["train", "--classes", "3,3", "--epochs", "1", *TINY]), "--classes: 3 given twice")


def test_d2_a_step_too_long_for_the_budget_is_refused_before_it_runs_and_a_long_one_is_said(monkeypatch):
    """The FLOPs of ViT-S/16 at 224 px (4.6 GFLOP an image forward) at a CPU of 1 GFLOP/s: ~1,770 s a step of 128.
    Nothing is run: the test would take half an hour otherwise."""
    import vitkit.runtime.cpu as cpu_mod
    import vitkit.training.plan as plan_mod
    from vitkit.training.config import TrainConfig

    monkeypatch.setattr(plan_mod, "fp32_matmul_flops", lambda: 1e9)
    ran = []
    monkeypatch.setattr(plan_mod, "time_step", lambda *a, **k: ran.append(1) or (_ for _ in ()).throw(AssertionError))
    cfg = TrainConfig(dataset="digits", model="vit_small_patch16_224", model_args={"img_size": 224, "in_chans": 1},
                      batch_size=128, time_limit=2, precision="fp32", attention="sdpa", compile=False)
    import time as _t

    started = _t.time()
    with pytest.raises(ValueError, match=r"--time-limit 2 minutes is shorter .* foreseen at half its FLOPs' time at "
                                         r"this CPU's fp32 matmul rate, 1 GFLOP/s: nothing was run"):
        plan_mod.make_plan(cfg, log=lambda s: None, in_run=True)
    assert not ran and _t.time() - started < 60
    said = []
    monkeypatch.setattr(plan_mod, "_fit_memory", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # (stopped at the memory plan's steps: the line before it is tested)
        plan_mod.make_plan(TrainConfig.from_dict({**cfg.to_dict(), "time_limit": None}), log=said.append,
                           in_run=True)
    assert any("a step or more, foreseen from its FLOPs at this CPU's matmul rate (1 GFLOP/s)" in s for s in said)
    assert cpu_mod.fp32_matmul_flops() > 0


def test_max_epochs_below_the_recipes_epochs_caps_them_and_below_the_users_is_refused(tmp_path, capsys):
    """--max-epochs 1 on digits' 40 epochs was silently not used (a 5-minute budget trained 21 epochs); now the
    recipe's epochs are capped there, said; below --epochs given too, it is one line."""
    assert main(["train", "--max-epochs", "1", *TINY, "--output", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "epochs: the recipe's 40 capped at --max-epochs 1" in out and "epochs=1 " in out.splitlines()[-1]
    code = main(["train", "--epochs", "3", "--max-epochs", "1", *TINY, "--output", str(tmp_path / "b")])
    _one_line(capsys, code, "--max-epochs 1 is below --epochs 3")
    assert not (tmp_path / "b").exists()
    _one_line(capsys, main(["train", "--max-epochs", "0", "--output", str(tmp_path / "c")]),
              "max_epochs must be at least 1, got 0")  # (named as itself, not as the epochs it would cap)
