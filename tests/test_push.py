"""`vitkit push`: the model card read back by huggingface_hub's own parser, the upload through huggingface_hub's
client against a Hub on loopback (tests/fake_hub.py), and the pushed repository loaded back from that Hub by vitkit,
timm and transformers, each giving the run's own logits."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fake_hub import FakeHub
from vitkit.cli.main import main

pytest.importorskip("huggingface_hub")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("push") / "run"
    assert main(["train", "--epochs", "2", "--output", str(out), "--compile", "false", "--precision", "fp32",
                 "--attention", "sdpa", "--channels-last", "false", "--threads", "1", "--holdout", "0.1"]) == 0
    return out


def run_vitkit(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "vitkit", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_dry_run_writes_the_card_the_hub_parses_with_the_runs_own_numbers(run_dir, tmp_path, capsys):
    from huggingface_hub import ModelCard

    out = tmp_path / "repo"
    assert main(["push", str(run_dir), "--repo", "me/digits-vit", "--out", str(out), "--dry-run"]) == 0
    assert "nothing uploaded" in capsys.readouterr().out
    for f in ("model.safetensors", "config.json", "hf/model.safetensors", "hf/config.json", "model.onnx",
              "curves.png", "training/config.yaml", "training/plan.json", "training/metrics.jsonl", "README.md"):
        assert (out / f).is_file(), f
    card = ModelCard.load(out / "README.md")  # huggingface_hub's reader: the YAML header and model-index
    best = max(metrics(run_dir), key=lambda m: m["val_top1"])
    assert card.data.library_name == "vitkit" and card.data.pipeline_tag == "image-classification"
    (result,) = card.data.eval_results
    assert result.metric_type == "accuracy" and result.metric_value == pytest.approx(best["val_top1"], abs=1e-3)
    assert result.dataset_split == "validation"
    text = card.text
    assert f"{best['val_top1']:.2f}%" in text and "held out" in text  # --holdout: said, with the number
    assert "![training curves](curves.png)" in text and "vit_nano_patch2_8" in text
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["machine"] in text
    for how in ('vitkit.load("hf-hub:me/digits-vit")', 'timm.create_model("hf-hub:me/digits-vit", pretrained=True)',
                'ViTForImageClassification.from_pretrained("me/digits-vit", subfolder="hf")'):
        assert how in text
    # the files the card's table names are the files written
    listed = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {f.rstrip("/") for f in listed if not f.endswith("/")} <= written
    assert "hf/" in listed and "hf/config.json" in written


def test_push_refuses_what_it_cannot_do_before_writing_anything(run_dir, tmp_path, capsys):
    assert main(["push", str(run_dir), "--repo", "not a repo!", "--dry-run", "--out", str(tmp_path / "a")]) == 2
    assert "--repo not a repo!" in capsys.readouterr().err
    assert main(["push", str(run_dir), "--repo", "me/x", "--dry-run"]) == 2
    assert "give --out DIR" in capsys.readouterr().err
    assert main(["push", str(tmp_path), "--repo", "me/x", "--dry-run", "--out", str(tmp_path / "b")]) == 2
    assert "neither a run folder" in capsys.readouterr().err
    assert main(["push", str(run_dir), "--repo", "me/x", "--formats", "hf,tflite", "--dry-run",
                 "--out", str(tmp_path / "c")]) == 2
    assert "tflite unknown" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep")
    assert main(["push", str(run_dir), "--repo", "me/x", "--dry-run", "--out", str(tmp_path / "d")]) == 2
    assert (tmp_path / "d" / "mine.txt").read_text() == "keep" and len(list((tmp_path / "d").iterdir())) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


LOAD_BACK = textwrap.dedent("""
    import sys, torch, timm, vitkit
    from transformers import ViTForImageClassification
    x = torch.load(sys.argv[1])
    out = {}
    with torch.no_grad():
        out["vitkit"] = vitkit.load("hf-hub:me/digits-vit").eval()(x)
        out["timm"] = timm.create_model("hf-hub:me/digits-vit", pretrained=True).eval()(x)
        hf = ViTForImageClassification.from_pretrained("me/digits-vit", subfolder="hf").eval()
        out["transformers"] = hf(pixel_values=x, interpolate_pos_encoding=False).logits
    torch.save(out, sys.argv[2])
""")


def test_push_uploads_through_huggingface_hub_and_the_repo_loads_back_in_three_libraries(run_dir, tmp_path):
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    import vitkit

    with FakeHub() as hub:
        env = hub.env(str(tmp_path / "hf-home"))
        r = run_vitkit("push", str(run_dir), "--repo", "me/digits-vit", env=env)
        assert r.returncode == 0, r.stderr
        assert "pushed me/digits-vit: " in r.stdout and hub.url in r.stdout
        (commit,) = hub.commits
        files = hub.repos["me/digits-vit"]["branches"]["main"]
        assert set(commit["paths"]) == set(files) and "README.md" in files and "hf/model.safetensors" in files
        # the weights went the way the Hub takes big binary files: LFS batch, then PUT (not inline in the commit)
        assert ("POST", "/me/digits-vit.git/info/lfs/objects/batch") in hub.requests
        assert files["model.safetensors"] in hub.lfs.values()

        # loaded back from the Hub (a fresh cache) by vitkit, timm and transformers: the run's own logits
        model = vitkit.load(run_dir / "best").eval()
        x = torch.randn(4, 1, 8, 8)
        torch.save(x, tmp_path / "x.pt")
        (tmp_path / "load.py").write_text(LOAD_BACK)
        r = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr[-3000:]
        with torch.no_grad():
            want = model(x)
        for lib, y in torch.load(tmp_path / "y.pt").items():
            torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{lib}: {m}")

        # a second push of the same run to a branch: the repository exists (kept), one more commit there
        r = run_vitkit("push", str(run_dir), "--repo", "me/digits-vit", "--which", "last", "--revision", "try-last",
                   "--formats", "hf", env=env)
        assert r.returncode == 0, r.stderr
        assert [c["revision"] for c in hub.commits] == ["main", "try-last"]
        assert "model.onnx" not in hub.commits[1]["paths"]  # --formats hf: no ONNX this time
        assert hub.repos["me/digits-vit"]["branches"]["main"] == files  # main untouched

        # a wrong token: one line naming what to do, exit 2, no traceback
        r = run_vitkit("push", str(run_dir), "--repo", "me/other", env={**env, "HF_TOKEN": "hf_wrong"})
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "HTTP 401" in r.stderr and "hf auth login" in r.stderr


def test_no_hub_to_reach_is_one_line(run_dir, tmp_path):
    """A Hub that does not answer (no network): exit 2 and a line naming the address, nothing half-done."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_x", "HF_HUB_DISABLE_XET": "1",
           "HF_HOME": str(tmp_path / "h")}
    r = run_vitkit("push", str(run_dir), "--repo", "me/x", "--formats", "hf", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"could not reach the Hub at http://127.0.0.1:{port}" in r.stderr and "nothing was pushed" in r.stderr


def test_a_model_transformers_cannot_hold_is_pushed_without_hf_and_timm_builds_it_from_the_config(tmp_path, capsys):
    """A GAP model (no class token): transformers' ViT has no such model, so hf/ is skipped with the reason and the
    card says so; timm's VisionTransformer, built from the pushed config.json's keys alone, loads the weights
    strictly and gives vitkit's logits. A checkpoint folder outside a run pushes without a training section."""
    timm = pytest.importorskip("timm")
    from safetensors.torch import load_file

    import vitkit

    model = vitkit.create_model("vit_nano_patch2_8", pool="gap", num_classes=3, img_size=8).eval()
    vitkit.save_pretrained(model, tmp_path / "ckpt", class_names=["a", "b", "c"])
    out = tmp_path / "repo"
    assert main(["push", str(tmp_path / "ckpt"), "--repo", "me/gap", "--out", str(out), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "skipped hf: Hugging Face ViT has only the class-token" in said and not (out / "hf").exists()
    card = (out / "README.md").read_text()
    assert "transformers: no equivalent (Hugging Face ViT has only the class-token" in card
    assert "## Training" not in card and "## Results" not in card and "subfolder" not in card
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["library"] == "vitkit" and cfg["label_names"] == ["a", "b", "c"]
    net = timm.create_model(cfg["architecture"], pretrained=False, **cfg["model_args"]).eval()
    net.load_state_dict(load_file(str(out / "model.safetensors")))  # strict: every key, every shape
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), atol=1e-5, rtol=1e-5)
    assert cfg["pretrained_cfg"]["input_size"] == [1, 8, 8] and cfg["pretrained_cfg"]["num_classes"] == 3


def test_files_of_the_run_that_do_not_read_are_left_out_of_the_card_saying_so(run_dir, tmp_path, capsys):
    """Found by trying: a broken config.yaml ended in a YAML traceback; a plan.json of another shape in an
    AttributeError. The weights are what is pushed: the card goes without what does not read, and says so."""
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    (bad / "config.yaml").write_text("a: [1, 2")
    (bad / "plan.json").write_text('["not", "a", "plan"]')
    with open(bad / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 9, "val_top1": 5\n3\n{"epoch": 10, "val_top1": "high"}\n')
    (bad / "best" / "eval").mkdir()
    (bad / "best" / "eval" / "eval.json").write_text("{nope")
    out = tmp_path / "repo"
    assert main(["push", str(bad), "--repo", "me/x", "--out", str(out), "--dry-run", "--formats", "hf"]) == 0
    said = capsys.readouterr().out
    assert "config.yaml: not read (YAMLError" in said or "config.yaml: not read (" in said
    assert "plan.json: not a mapping" in said and "eval.json: not read" in said
    card = (out / "README.md").read_text()
    best = max(json.loads(line)["val_top1"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert f"{best:.2f}%" in card and "## Training" not in card  # the metrics that read; no settings to show
