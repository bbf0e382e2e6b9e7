"""Pretrained weights, offline: Hugging Face Hub caches in huggingface_hub's own layout holding files written by
timm's and transformers' own save functions (random weights), a loopback HTTP server for URLs, and the
preprocessing compared with timm's and transformers' on real photos."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from PIL import Image

import vitkit
from vitkit.interop.download import DownloadError, download_url
from vitkit.interop.registry import ENTRIES, PRETRAINED

ANTS_BEES = next((p for p in (Path(__file__).resolve().parents[2] / "shared/data/ants-bees.zip",
                              Path("/work/shared/data/ants-bees.zip")) if p.is_file()), None)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(hf_home: Path, repo_id: str, folder: Path) -> None:
    """``folder``'s files as huggingface_hub caches a download: blobs by sha256, snapshot symlinks, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in folder.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))


def run_offline(hf_home: Path, code: str) -> str:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TORCH_HOME": str(hf_home / "torch")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_timm_hub_weights_load_as_timm_loads_them(tmp_path):
    import timm
    from timm.models._hub import save_for_hf

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    t = timm.create_model(name.split(".")[0], num_classes=1000)
    with torch.no_grad():
        for p in t.parameters():
            p.normal_(0, 0.05)
    save_for_hf(t, str(tmp_path / "saved"), safe_serialization=True)
    put_in_hub_cache(tmp_path / "hf", f"timm/{name}", tmp_path / "saved")
    out = run_offline(tmp_path / "hf", f"""
import torch, timm, vitkit
x = torch.randn(2, 3, 224, 224)
ours = vitkit.create_model("{name}", pretrained=True).eval()
theirs = timm.create_model("{name}", pretrained=True).eval()
sd = theirs.state_dict()
assert all(torch.equal(v, sd[k]) for k, v in ours.state_dict().items()), "tensors differ"
with torch.no_grad():
    print((ours(x) - theirs(x)).abs().max().item())
print(ours.preprocessing["class_names"][:2], ours.preprocessing["crop_pct"])
new = vitkit.create_model("{name}", pretrained=True, num_classes=2, img_size=96)
print(new.config.num_classes, new.config.img_size, int(torch.count_nonzero(new.head.weight)))
""")
    diff, names, adapted = out.splitlines()
    assert float(diff) < 1e-5
    assert names == "['tench', 'goldfish'] 0.9" and adapted == "2 96 0"


def test_hugging_face_hub_weights_load_as_transformers_loads_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(num_labels=1000)  # google/vit-base-patch16-224's architecture
    torch.manual_seed(0)
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / "saved")
    put_in_hub_cache(tmp_path / "hf", "google/vit-base-patch16-224", tmp_path / "saved")
    out = run_offline(tmp_path / "hf", """
import torch, vitkit, transformers
x = torch.randn(1, 3, 224, 224)
ours = vitkit.create_model("google/vit-base-patch16-224", pretrained=True).eval()
theirs = transformers.ViTForImageClassification.from_pretrained("google/vit-base-patch16-224").eval()
same = vitkit.create_model("vit_base_patch16_224", pretrained="hf-hub:google/vit-base-patch16-224").eval()
with torch.no_grad():
    print((ours(x) - theirs(pixel_values=x).logits).abs().max().item(), (same(x) - ours(x)).abs().max().item())
""")
    a, b = map(float, out.split())
    assert a < 1e-4 and b == 0.0


def test_offline_without_the_file_says_where_to_put_it(tmp_path):
    (tmp_path / "hf").mkdir()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "vitkit", "predict", "--model",
                        "vit_tiny_patch16_224.augreg_in21k_ft_in1k", "x.jpg"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k" in r.stderr and "HF_HUB_OFFLINE" in r.stderr


def test_no_network_without_hub_offline_is_told_at_once_and_the_cache_still_used(tmp_path):
    """Without HF_HUB_OFFLINE, a machine with no network waited through ~30 s of retries before the message; the
    Hub's host is now probed first (a closed loopback port stands in for an unreachable hub)."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    env.pop("HF_HUB_OFFLINE", None)
    code = ("from vitkit.interop.download import hub_file\n"
            "print(hub_file('timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k', 'model.safetensors'))")
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "did not answer within 3 s (no network?)" in r.stderr
    assert "hf download" in r.stderr and "--preprocessing NAME.TAG" in r.stderr and time.time() - t < 20
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "model.safetensors").write_bytes(b"weights")
    put_in_hub_cache(tmp_path / "hf", "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", tmp_path / "files")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and Path(r.stdout.strip()).read_bytes() == b"weights"


def test_import_keeps_a_registered_entrys_preprocessing_for_its_bare_file(tmp_path):
    """A timm file has no mean/std/crop: `--init FILE` standardised with the dataset's statistics instead of the
    publisher's. `import --preprocessing NAME.TAG` records them (timm's pretrained_cfg the reference)."""
    import timm
    from safetensors.torch import save_file

    from vitkit.cli.main import main

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    save_file(timm.create_model("vit_tiny_patch16_224", num_classes=1000).state_dict(), str(tmp_path / "w.safetensors"))
    assert main(["import", "--from", "timm", str(tmp_path / "w.safetensors"), "--num-heads", "3",
                 "--preprocessing", name, "--out", str(tmp_path / "d")]) == 0
    pre = vitkit.from_pretrained(tmp_path / "d").preprocessing
    cfg = timm.create_model(name, pretrained=False).pretrained_cfg
    assert pre["mean"] == list(cfg["mean"]) and pre["crop_pct"] == cfg["crop_pct"] and len(pre["class_names"]) == 1000
    assert main(["import", "--from", "timm", str(tmp_path / "w.safetensors"), "--num-heads", "3",
                 "--preprocessing", "vit_base_patch16_224.augreg2_in21k_ft_in1k", "--out", str(tmp_path / "e")]) == 2


def test_registry_agrees_with_timm_pretrained_configs():
    import timm
    from timm.models import get_pretrained_cfg

    for e in ENTRIES:
        if not (e.hub or "").startswith("timm/"):
            continue
        c = get_pretrained_cfg(e.name)
        assert c is not None, e.name
        assert (tuple(c.mean), tuple(c.std), c.crop_pct, c.interpolation, c.input_size[1:]) == \
            (e.mean, e.std, e.crop_pct, e.interpolation, (e.img_size, e.img_size)), e.name
        assert c.num_classes == e.num_classes, e.name
        with torch.device("meta"):
            ours = vitkit.create_model(e.name)
            theirs = timm.create_model(e.name.split(".")[0], num_classes=e.num_classes)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()), e.name


def photos(n: int = 6) -> list[Image.Image]:
    if ANTS_BEES is None:
        pytest.skip("../shared/data/ants-bees.zip is not here")
    with zipfile.ZipFile(ANTS_BEES) as z:
        names = [m for m in z.namelist() if m.endswith(".jpg")][:n]
        out = []
        for m in names:
            with z.open(m) as f:
                out.append(Image.open(f).convert("RGB"))
                out[-1].load()
    return out


@pytest.mark.parametrize("name", ["deit_small_patch16_224.fb_in1k", "vit_base_patch16_384.augreg_in21k_ft_in1k",
                                  "vit_small_patch16_224.augreg_in21k_ft_in1k"])
def test_eval_transform_equals_timms(name):
    import timm
    from timm.data import create_transform, resolve_data_config

    model = vitkit.create_model(name)  # the architecture and the entry's preprocessing, no weights needed
    with torch.device("meta"):
        t = timm.create_model(name, pretrained=False)
    theirs_cfg = resolve_data_config({}, model=t)
    ours_cfg = vitkit.data_config(model)
    for k in ("input_size", "interpolation", "crop_pct", "mean", "std"):
        assert tuple(ours_cfg[k]) == tuple(theirs_cfg[k]) if isinstance(ours_cfg[k], tuple) else \
            ours_cfg[k] == theirs_cfg[k], k
    ours, theirs = vitkit.transforms(model), create_transform(**theirs_cfg)
    for im in photos():
        a, b = ours(im), theirs(im)
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5


def test_hugging_face_entry_transform_equals_the_image_processor():
    transformers = pytest.importorskip("transformers")
    model = vitkit.create_model("google/vit-base-patch16-224")
    proc = transformers.ViTImageProcessor(size={"height": 224, "width": 224}, resample=2,
                                          image_mean=[0.5] * 3, image_std=[0.5] * 3)
    tf = vitkit.transforms(model)
    for im in photos(4):
        ref = torch.from_numpy(proc(im, return_tensors="np")["pixel_values"][0])
        assert (tf(im) - ref).abs().max() < 2 / 255 + 1e-6  # one 8-bit level (x 1/std): both resize with PIL


def test_imagenet_names_are_torchvisions():
    from torchvision.models import ViT_B_16_Weights

    from vitkit.interop.pretrained import class_names

    assert class_names("imagenet-1k", 1000) == ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"]
    assert class_names("imagenet-1k", 10) is None and class_names(None, 1000) is None


def test_models_command_lists_the_registry():
    r = subprocess.run([sys.executable, "-m", "vitkit", "models", "--pretrained", "augreg2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "vit_base_patch16_224.augreg2_in21k_ft_in1k" in r.stdout and "85.096" in r.stdout
    assert "vit_tiny_patch16_224.augreg_in21k " not in r.stdout
    assert vitkit.list_models("augreg2", pretrained=True) == [
        "vit_base_patch16_224.augreg2_in21k_ft_in1k", "vit_base_patch8_224.augreg2_in21k_ft_in1k"]


# --- URLs, on a loopback server ---

class Files(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    cut: set[str] = set()  # paths whose transfer stops halfway

    def do_GET(self):  # noqa: N802
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if self.path in self.cut else body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_url_download_checks_length_and_hash(tmp_path, server):
    body = os.urandom(3 << 20)
    Files.files = {"/w.bin": body, "/cut.bin": body}
    Files.cut = {"/cut.bin"}
    got = download_url(f"{server}/w.bin", cache_dir=tmp_path, sha256=hashlib.sha256(body).hexdigest(),
                       progress=False)
    assert got.read_bytes() == body and not list(tmp_path.glob("*.part"))
    with pytest.raises(DownloadError, match=r"stopped after 1572864 of 3145728 bytes"):
        download_url(f"{server}/cut.bin", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "cut.bin").exists() and not list(tmp_path.glob("*.part"))
    Files.cut = set()  # the next try starts again and completes
    assert download_url(f"{server}/cut.bin", cache_dir=tmp_path, progress=False).read_bytes() == body
    wrong = "0" * 64
    with pytest.raises(DownloadError, match=f"{hashlib.sha256(body).hexdigest()}.*{wrong}"):
        download_url(f"{server}/w.bin", filename="other.bin", cache_dir=tmp_path, sha256=wrong, progress=False)
    assert not (tmp_path / "other.bin").exists()
    with pytest.raises(DownloadError, match="HTTP 404.*place it at"):
        download_url(f"{server}/missing.npz", cache_dir=tmp_path, progress=False)
    with pytest.raises(DownloadError, match="no network here.*place it at"):
        download_url("http://127.0.0.1:9/w.npz", cache_dir=tmp_path, progress=False)


def test_official_npz_by_url_and_registry_entry(tmp_path, server, monkeypatch):
    """An official-layout npz served by URL: ``pretrained=URL`` downloads, caches and loads it."""
    model = vitkit.create_model("vit_tiny_patch16_224", num_classes=10)
    vitkit.interop.to_jax_npz(model, tmp_path / "Ti_16.npz")
    Files.files, Files.cut = {"/augreg/Ti_16.npz": (tmp_path / "Ti_16.npz").read_bytes()}, set()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    got = vitkit.create_model("vit_tiny_patch16_224", pretrained=f"{server}/augreg/Ti_16.npz", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), model.state_dict().values()))
    assert (tmp_path / "torch" / "hub" / "checkpoints" / "Ti_16.npz").is_file()
    with pytest.raises(ValueError, match="not a vit_small_patch16_224: embed_dim 192 where"):
        vitkit.create_model("vit_small_patch16_224", pretrained=str(tmp_path / "Ti_16.npz"))


def test_every_entry_names_an_existing_architecture():
    for e in ENTRIES:
        assert e.arch in vitkit.PRESETS, e.name
        assert e.name in PRETRAINED and (e.hub or e.url)
    assert json.dumps([e.preprocessing() for e in ENTRIES])  # plain values: they go into config.json


@pytest.mark.long
@pytest.mark.skipif(ANTS_BEES is None, reason="../shared/data/ants-bees.zip is not here")
def test_finetune_recipe_end_to_end_on_ants_bees(tmp_path):
    """A locally made "pretrained" ViT-Ti (timm's own save, in a Hub cache) fine-tuned on the real photos."""
    import timm
    from timm.models._hub import save_for_hf

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    torch.manual_seed(0)
    save_for_hf(timm.create_model("vit_tiny_patch16_224", num_classes=1000), str(tmp_path / "saved"),
                safe_serialization=True)
    put_in_hub_cache(tmp_path / "hf", f"timm/{name}", tmp_path / "saved")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for extra, out in (([], "ft"), (["--freeze-body"], "probe")):
        r = subprocess.run([sys.executable, "-m", "vitkit", "train", "--init", name, "--dataset", "folder",
                            "--data-dir", str(ANTS_BEES), "--epochs", "1", "--img-size", "96", "--output",
                            str(tmp_path / out), *extra], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        log = r.stdout
        assert "configs/finetune.yaml" in log and "opt: sgd" in log and "weight_decay: 0.0" in log
        assert "clip_grad: 1.0" in log and "val_top1=" in log and f"model --init {name}" in log
        assert "fewer than 8 optimiser steps" in log  # 245 photos: the 512 batch is cut
        ft = vitkit.from_pretrained(tmp_path / out / "last")
        assert ft.config.num_classes == 2 and ft.config.img_size == 96 and ft.pos_embed.shape[1] == 1 + 6 * 6
        assert ft.preprocessing["class_names"] == ["ants", "bees"] and ft.preprocessing["mean"] == [0.5] * 3
    assert "--freeze-body: only the head trains (386 parameters)" in log
    base = vitkit.create_model(name, pretrained=str(tmp_path / "saved" / "model.safetensors"))
    probe = vitkit.from_pretrained(tmp_path / "probe" / "last")
    assert torch.equal(probe.blocks[0].attn.qkv.weight, base.blocks[0].attn.qkv.weight)  # the body stayed frozen
    _check_one_preprocessing(tmp_path / "ft" / "last", tmp_path / "ft" / "config.yaml")


def _check_one_preprocessing(ckpt: Path, run_config: Path) -> None:
    """Training and eval see each validation photo as predict (and serve) do: the publisher's resize + centre crop
    (timm's own transform the reference), not every photo squashed to the folder's most common shape (43x64 here:
    eval and predict then disagreed on 16 of 153 photos)."""
    import timm.data
    import yaml

    from vitkit.cli.predict import predict
    from vitkit.data.preprocess import normalizer
    from vitkit.training.build import build_data
    from vitkit.training.config import TrainConfig

    model = vitkit.from_pretrained(ckpt).eval()
    pre = model.preprocessing
    assert pre["crop_pct"] == 0.9 and pre["interpolation"] == "bicubic"
    cfg = TrainConfig.from_dict(yaml.safe_load(run_config.read_text()))
    data = build_data(cfg)  # the training run's own loader, from its cache
    assert data.img_size == (96, 96) and len(data.val) == 153
    timm_tf = timm.data.create_transform(input_size=(3, 96, 96), crop_pct=0.9, interpolation="bicubic",
                                         mean=(0, 0, 0), std=(1, 1, 1))
    with zipfile.ZipFile(ANTS_BEES) as z, tempfile.TemporaryDirectory() as d:
        names = sorted(n for n in z.namelist() if "/val/" in n and n.endswith(".jpg"))
        z.extractall(d, names)
        paths = [str(Path(d) / n) for n in names]  # sorted as the loader's classes, then files: ants, then bees
        for i in (0, 80, 152):  # within JPEG-draft decoding of the timm transform (it decodes at full size)
            ref = timm_tf(Image.open(paths[i]).convert("RGB"))
            assert (data.val.images[i].float() / 255 - ref).abs().mean() < 0.02, paths[i]
        with torch.no_grad():
            ours = model(normalizer(pre, model.config).normalize(data.val.images))
            got = predict(model, pre, paths, topk=1)
    assert [g["top"][0]["index"] for g in got] == ours.argmax(-1).tolist()  # all 153, the same answer
    assert torch.allclose(torch.softmax(ours, -1).max(-1).values,
                          torch.tensor([g["top"][0]["prob"] for g in got]), atol=1e-4)

