"""Round 2 of "nothing silently wrong": each test here failed (a traceback, a wrong result, a lost file) before its
fix. The round-trip matrix of the formats is tests/test_roundtrip.py."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from PIL import Image

import vitkit
from vitkit.cli.main import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("r") / "run"
    assert main(["train", "--epochs", "1", "--depth", "1", "--output", str(out)]) == 0
    return out


def test_written_weights_are_ordinary_files_not_0600(run_dir):
    mode = stat.S_IMODE(os.stat(run_dir / "best" / "model.safetensors").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_eval_of_a_single_file_checkpoint_writes_beside_it(run_dir, tmp_path, capsys):
    f = tmp_path / "w.safetensors"
    assert main(["export", "--checkpoint", str(run_dir / "best"), "--format", "timm", "--out", str(f)]) == 0
    assert main(["eval", "--checkpoint", str(f), "--precision", "fp32"]) == 0
    assert (tmp_path / "w.safetensors.eval" / "eval.json").is_file() and f.is_file()
    assert "Not a directory" not in capsys.readouterr().err


def test_predict_on_many_large_photos_keeps_memory_bounded(run_dir, tmp_path):
    """A folder of 12-megapixel JPEGs: decoded a batch at a time, each at the size the model needs (all at once at
    full size took 1.5 GB for 15 of them)."""
    import shutil
    import subprocess
    import sys

    import numpy as np

    noise = np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8)
    Image.fromarray(noise).resize((4000, 3000)).save(tmp_path / "0.jpg", quality=80)
    for i in range(1, 40):
        shutil.copy(tmp_path / "0.jpg", tmp_path / f"{i}.jpg")
    code = ("import resource, json; from vitkit.cli.main import main\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"assert main(['predict', '--checkpoint', {str(run_dir / 'best')!r}, {str(tmp_path)!r}, '--json']) == 0\n"
            "print('grown', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    answers = json.loads(r.stdout[:r.stdout.rindex("grown")])
    assert len(answers) == 40 and all(len(a["top"]) == 5 for a in answers)
    assert int(r.stdout.rsplit(" ", 1)[1]) < 300  # 40 photos at full size: 1.4 GB


def test_predict_takes_an_image_after_pretrained_as_an_image(tmp_path, capsys, monkeypatch):
    img = tmp_path / "a.png"
    Image.new("RGB", (16, 16)).save(img)
    seen = {}

    def fake_create(name, pretrained=True, **kw):  # no download: the weights source is what is checked
        seen["pretrained"] = pretrained
        raise ValueError("stop here")

    monkeypatch.setattr(vitkit, "create_model", fake_create)
    code = main(["predict", "--model", "vit_tiny_patch16_224.augreg_in21k_ft_in1k", "--pretrained", str(img)])
    assert code == 2 and seen["pretrained"] is True and "stop here" in capsys.readouterr().err
    assert main(["predict", "--model", "x.y"]) == 2
    assert "no images given" in capsys.readouterr().err


def test_topk_below_one_is_a_message(run_dir, tmp_path, capsys):
    img = tmp_path / "a.png"
    Image.new("L", (8, 8)).save(img)
    with pytest.raises(SystemExit):
        main(["predict", "--checkpoint", str(run_dir / "best"), str(img), "--topk", "-1"])
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("text,error", [
    ("model_args: 3\n", "model_args must be a mapping"),
    ("lr: 0.1\nlr: 0.2\n", "key 'lr' is given twice"),
    ("tiers: 5\n", "tiers must be a list")])
def test_config_files_that_mean_nothing_are_refused_by_name(tmp_path, capsys, text, error):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert main(["train", "--config", str(f), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert error in err and str(f) in err and "Traceback" not in err


def test_a_zero_crop_pct_in_config_json_is_refused_by_name(run_dir, tmp_path, capsys):
    import shutil

    ckpt = tmp_path / "ck"
    shutil.copytree(run_dir / "best", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["preprocessing"]["crop_pct"] = 0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert main(["eval", "--checkpoint", str(ckpt)]) == 2
    assert "crop_pct must be a number in (0, 1]" in capsys.readouterr().err


def test_resume_with_another_model_is_refused(run_dir, capsys):
    assert main(["train", "--resume", str(run_dir), "--depth", "3"]) == 2
    err = capsys.readouterr().err
    assert "continues that run's model" in err and "depth 1 -> 3" in err


@pytest.mark.parametrize("field, value", [("epoch_loss", "oops"), ("epoch_loss", [1.0]), ("step", -3)])
def test_a_training_state_with_counters_of_the_wrong_kind_is_refused_by_name(run_dir, tmp_path, capsys, field,
                                                                             value):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(".lock"))
    state = torch.load(run / "last" / "train_state.pt", weights_only=True)
    torch.save({**state, field: value}, run / "last" / "train_state.pt")
    assert main(["train", "--epochs", "2", "--depth", "1", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"not a vitkit training state ({field}={value!r}" in err and "Traceback" not in err


def test_an_onnx_export_that_fails_its_check_leaves_no_file(run_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnxruntime")
    from vitkit.serving import onnx

    def broken(model, path, atol=1e-4, batch=3, sizes=None):
        raise ValueError("onnxruntime disagrees")

    monkeypatch.setattr(onnx, "check_onnx", broken)
    out = tmp_path / "m.onnx"
    assert main(["export", "--checkpoint", str(run_dir / "best"), "--format", "onnx", "--out", str(out)]) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing under the name, no temporary left
    assert "onnxruntime disagrees" in capsys.readouterr().err


def test_the_heads_of_an_exported_recipe_model_survive_eval(run_dir, tmp_path, capsys):
    """The digits recipe's model has 4 heads at width 64 (guessed as 1 from the width before): its timm export,
    evaluated, gives the run's own accuracy."""
    f = tmp_path / "t.safetensors"
    assert main(["export", "--checkpoint", str(run_dir / "best"), "--format", "timm", "--out", str(f)]) == 0
    assert vitkit.load(f).config.num_heads == vitkit.load(run_dir / "best").config.num_heads == 4
    capsys.readouterr()
    for ck in (run_dir / "best", f):
        assert main(["eval", "--checkpoint", str(ck), "--precision", "fp32", "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    tops = [line for line in out.splitlines() if line.startswith("top-1")]
    assert len(tops) == 2 and tops[0] == tops[1], tops
    x = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(f)(x), vitkit.load(run_dir / "best")(x))


def _png(size=8, value=0) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, "PNG")
    return buf.getvalue()


def _zip(path, names):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for i, n in enumerate(names):
            z.writestr(n, _png(value=i % 255))
    return path


def _tree(prefix=""):
    return [f"{prefix}{s}/{c}/{i}.png" for s in ("train", "val") for c in ("a", "b") for i in range(3)]


@pytest.mark.parametrize("names,found", [
    (_tree("xray/") + _tree("xray/xray/"), "xray/ (train, val), xray/xray/ (train, val)"),  # a nested copy
    ([n for n in _tree("v1/") if "/train/" in n] + _tree("v2/"), "v1/ (train), v2/ (train, val)")])
def test_a_zip_with_two_split_roots_is_refused_listing_them(tmp_path, names, found):
    from vitkit.data.folder import load_folder_splits

    z = _zip(tmp_path / "d.zip", names)
    with pytest.raises(ValueError, match="2 folders hold a train/ split") as e:
        load_folder_splits(str(z))
    assert found in str(e.value)


def test_images_below_a_class_folder_are_named_not_dropped(tmp_path):
    from vitkit.data.folder import load_folder_splits

    z = _zip(tmp_path / "d.zip", _tree() + ["train/a/extra/9.png"])
    with pytest.raises(ValueError, match=r"1 image\(s\) lie deeper than .*train/a/extra/9.png"):
        load_folder_splits(str(z))


def test_windows_zip_names_and_symlinked_class_folders_are_read(tmp_path):
    from vitkit.data.folder import load_folder_splits

    z = _zip(tmp_path / "w.zip", [n.replace("/", "\\") for n in _tree("data/")])
    d = load_folder_splits(str(z))
    assert (len(d.train), len(d.val), d.classes) == (6, 6, ["a", "b"])
    root = tmp_path / "f"
    elsewhere = tmp_path / "elsewhere"
    for n in _tree():
        p = (elsewhere if n.startswith("train/b/") else root) / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_png())
    (root / "train" / "b").symlink_to(elsewhere / "train" / "b", target_is_directory=True)
    (root / "train" / "a" / "loop").symlink_to(root / "train", target_is_directory=True)  # a link loop ends
    d = load_folder_splits(str(root))
    assert (len(d.train), len(d.val)) == (6, 6)


def test_a_run_folder_held_by_a_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import subprocess
    import sys

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".vitkit-run.lock").write_text(str(holder.pid))  # another run, alive, writing here
        assert main(["train", "--epochs", "1", "--output", str(out)]) == 2
        assert f"being written by another vitkit run (process {holder.pid})" in capsys.readouterr().err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "--epochs", "1", "--output", str(out)]) == 0  # its process is gone: taken over
    assert not (out / ".vitkit-run.lock").exists()  # released at the end


def test_a_users_config_in_the_output_folder_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "exp1"
    out.mkdir()
    mine = "# my experiment\nepochs: 1\nlr: 0.002  # tuned by hand\n"
    (out / "config.yaml").write_text(mine)
    assert main(["train", "--config", str(out / "config.yaml"), "--output", str(out)]) == 2
    assert "already has config.yaml" in capsys.readouterr().err
    assert (out / "config.yaml").read_text() == mine


def test_a_full_disk_is_said_in_words_and_the_last_good_checkpoint_kept(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--depth", "1", "--output", str(out)]) == 0
    before = (out / "last" / "model.safetensors").read_bytes()
    real_save = torch.save

    def full(obj, f, *a, **k):  # what torch.save raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 0 vs 1; basic_ios::clear: "
                           "iostream error")

    monkeypatch.setattr(torch, "save", full)
    assert main(["train", "--epochs", "2", "--depth", "1", "--output", str(out), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "could not write the last/ checkpoint" in err and "The previous last/ is kept" in err
    assert "Traceback" not in err and "iostream error" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert (out / "last" / "model.safetensors").read_bytes() == before  # the last good one survived
    assert not list(out.glob(".last.*"))


def test_files_of_the_wrong_kind_are_named_for_what_they_are(tmp_path, capsys):
    from safetensors.torch import save_file

    jpg = tmp_path / "cat.jpg"
    Image.new("RGB", (8, 8)).save(jpg)
    assert main(["import", "--from", "timm", str(jpg), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "a JPEG image, not a weights file" in err and "unpickl" not in err
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=3)
    f = tmp_path / "t.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(f))
    assert main(["import", "--from", "hf", str(f), "--out", str(tmp_path / "b")]) == 2
    assert "timm's names" in capsys.readouterr().err


def test_the_pretrained_table_fits_a_terminal():
    from vitkit.cli.models_cmd import _table

    rows = [["name", "source"], ["vit_base_patch16_224.augreg2_in21k_ft_in1k", "https://example.org/" + "x" * 200]]
    lines = _table(rows, columns=100).splitlines()
    assert all(len(line) <= 100 for line in lines) and lines[1].endswith("…")
    assert _table(rows).splitlines()[1].endswith("x" * 10)  # a pipe gets whole lines


def test_serve_overlay_is_drawn_over_the_crop_the_model_saw():
    """A 3:1 photo for a model with a centre crop: the overlay is the square the model looked at (it was the whole
    photo, with the crop's attention map stretched over it)."""
    import base64
    import io

    from vitkit.serving.predictor import Predictor

    model = vitkit.VisionTransformer(vitkit.ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                                      num_classes=3)).eval()
    pre = {"mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.9, "crop_mode": "center", "interpolation": "bicubic"}
    photo = Image.new("RGB", (300, 100), "white")
    photo.paste((255, 0, 0), (0, 0, 100, 100))  # the left third red: the centre crop never sees it
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    out = Predictor(model, pre, threads=1)(buf.getvalue())
    drawn = Image.open(io.BytesIO(base64.b64decode(out["overlay"].split(",", 1)[1])))
    assert drawn.size == (256, 256)


def test_a_near_uniform_rollout_is_not_drawn_as_sharply_focused(tmp_path):
    import numpy as np

    from vitkit.inspect.plots import plot_overlay, share_scale

    flat = np.full((4, 4), 1.0) + np.random.default_rng(0).uniform(0, 0.01, (4, 4))
    share, vmax = share_scale(flat)
    assert share.sum() == pytest.approx(1) and share.max() / vmax < 0.3  # the lower part of the colour scale
    focused = np.zeros((4, 4))
    focused[1, 2] = 1.0
    share, vmax = share_scale(focused)
    assert share.max() / vmax == 1  # the top colour where all the attention went
    plot_overlay(np.zeros((3, 16, 16), np.uint8), flat, tmp_path / "o.png", "attention rollout")
    assert (tmp_path / "o.png").stat().st_size > 0


def test_half_sent_headers_are_closed_after_the_header_timeout_and_the_page_still_served():
    """A client that sends half a request line and stalls (slowloris) held its connection for ever: uvicorn times
    only idle keep-alive connections."""
    import socket
    import threading
    import time

    import httpx

    from vitkit.serving.app import serve
    from vitkit.serving.predictor import Limits, Predictor

    model = vitkit.VisionTransformer(vitkit.ViTConfig(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                                      num_classes=3)).eval()
    ready: list[str] = []
    predictor = Predictor(model, {"mean": [0.5] * 3, "std": [0.5] * 3}, Limits(header_timeout_s=1.0), threads=1)
    threading.Thread(target=serve, args=(predictor, "127.0.0.1", 0), kwargs={"on_ready": ready.append},
                     daemon=True).start()
    for _ in range(100):
        if ready:
            break
        time.sleep(0.05)
    host, port = ready[0].split("//")[1].rsplit(":", 1)
    for _ in range(100):  # the socket is bound before uvicorn starts accepting
        try:
            httpx.get(ready[0] + "/api/info", timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    stalled = socket.create_connection((host, int(port)))
    stalled.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUser-Ag")  # and nothing more
    stalled.settimeout(5)
    t = time.time()
    assert stalled.recv(100) == b"" and time.time() - t < 4  # closed by the server after ~1 s
    with httpx.Client() as c:  # a keep-alive client that asks in time is served, twice
        assert c.get(ready[0]).status_code == 200 and c.get(ready[0] + "/api/info").status_code == 200


@pytest.mark.parametrize("fmt", ["safetensors", "timm"])
def test_single_file_exports_keep_the_preprocessing(run_dir, tmp_path, fmt):
    """A digits checkpoint (its own mean/std and class names) exported to one file came back standardised with
    0.5/0.5 and nameless: predictions on the same images changed. The preprocessing rides in the file's metadata."""
    src = vitkit.load(str(run_dir / "best"))
    src.preprocessing = {**src.preprocessing, "crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear"}
    src.save_pretrained(tmp_path / "ckpt")
    f = tmp_path / f"w.{fmt}.safetensors"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", fmt, "--out", str(f)]) == 0
    back = vitkit.load(str(f))
    for key in ("mean", "std", "class_names", "crop_pct", "interpolation"):
        assert back.preprocessing[key] == src.preprocessing[key], key
    assert back.preprocessing["mean"] != [0.5]  # the digits' own statistics, not the default
    assert "class_names" not in vitkit.load(str(f), num_classes=3).preprocessing  # a new head: names dropped


def test_hugging_face_export_has_an_image_processor_transformers_reads(run_dir, tmp_path):
    from transformers import AutoImageProcessor

    assert main(["export", "--checkpoint", str(run_dir / "best"), "--format", "hf", "--out", str(tmp_path / "h")]) == 0
    proc = AutoImageProcessor.from_pretrained(tmp_path / "h")
    pre = vitkit.load(str(run_dir / "best")).preprocessing
    assert list(proc.image_mean) == pytest.approx(pre["mean"]) and list(proc.image_std) == pytest.approx(pre["std"])
    assert proc.size == {"height": 8, "width": 8}
