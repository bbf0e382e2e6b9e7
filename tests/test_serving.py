"""ONNX against onnxruntime; the demo's API and hostile uploads; a real browser against `vitkit serve`."""
import io
import os
import shutil
import socket
import subprocess
import sys
import time
import zlib
import struct
from pathlib import Path

import pytest
import torch
from PIL import Image

import vitkit
from vitkit.serving.predictor import Limits, Predictor

from conftest import tiny_config
from helpers import digits_arrays


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_onnx_export_matches_onnxruntime(tmp_path, pool):
    pytest.importorskip("onnxruntime")
    from vitkit.cli.main import main

    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, pool=pool, depth=3)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "m")
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--format", "onnx",
                 "--out", str(tmp_path / "m.onnx")]) == 0
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the batch axis is dynamic
        x = torch.randn(batch, 3, 32, 32)
        got = sess.run(None, {"pixel_values": x.numpy()})[0]
        with torch.no_grad():
            assert np.abs(got - model.eval()(x).numpy()).max() <= 1e-4


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def decompression_bomb(side: int = 30000) -> bytes:
    """A valid grayscale PNG of side x side black pixels: tiny on disk, 900 megapixels when decoded."""
    raw = zlib.compress(b"".join(b"\x00" + bytes(side) for _ in range(side)), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return decompression_bomb()


def _client(limits=Limits()):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vitkit.serving.app import create_app

    model = vitkit.VisionTransformer(tiny_config(num_classes=10, in_chans=1, img_size=8, patch_size=2))
    torch.nn.init.normal_(model.head.weight, std=0.5)  # not the zero head of a new model: the classes differ
    pre = {"mean": [0.5], "std": [0.25], "class_names": [f"digit {i}" for i in range(10)]}
    ex = [("digit 0", Image.fromarray(digits_arrays()[0][0]))]
    return TestClient(create_app(Predictor(model, pre, limits), ex))


def test_api_predicts_top5_with_overlay_and_rejects_hostile_uploads(bomb):
    c = _client(Limits(max_bytes=2_000_000, max_pixels=1_000_000))
    img = Image.fromarray(digits_arrays()[0][3]).resize((64, 64))
    r = c.post("/api/predict", files={"file": ("../../etc/passwd", _png(img), "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["top"]) == 5 and body["overlay"].startswith("data:image/png;base64,")
    probs = [t["prob"] for t in body["top"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    r = c.post("/api/predict", files={"file": ("bomb.png", bomb, "image/png")})
    assert r.status_code == 400 and "pixels, more than the limit of 1,000,000" in r.json()["error"]
    r = c.post("/api/predict", files={"file": ("x.png", b"hello, not an image", "image/png")})
    assert r.status_code == 400 and "not an image" in r.json()["error"]
    r = c.post("/api/predict", files={"file": ("big.png", os.urandom(3_000_000), "image/png")})
    assert r.status_code == 413
    tiff = io.BytesIO()
    img.save(tiff, format="TIFF")
    r = c.post("/api/predict", files={"file": ("x.tif", tiff.getvalue(), "image/tiff")})
    assert r.status_code == 400 and "TIFF images are not accepted" in r.json()["error"]
    gif = io.BytesIO()
    img.convert("P").save(gif, format="GIF", save_all=True, append_images=[img.convert("P").rotate(90)])
    assert c.post("/api/predict", files={"file": ("a.gif", gif.getvalue(), "image/gif")}).status_code == 200
    assert c.get("/api/info").json()["examples"][0]["label"] == "digit 0"
    assert c.get("/api/info").json()["methods"] == ["rollout", "attention-last", "grad-rollout", "gradcam"]
    assert c.get("/api/examples/0.png").content.startswith(b"\x89PNG")
    assert "<title>vitkit" in c.get("/").text


def test_api_explains_the_class_and_method_asked_for():
    c = _client()
    img = _png(Image.fromarray(digits_arrays()[0][3]).resize((64, 64)))
    first = c.post("/api/predict", files={"file": ("d.png", img, "image/png")}).json()
    # rollout, the default, is class-agnostic: it says it explains no class (it once said "explained class 4")
    assert first["explained"] == {"method": "rollout", "class_specific": False, "class": None, "index": None,
                                  "prob": None}
    overlays = {}
    for method in ("rollout", "grad-rollout", "gradcam"):
        for target in ("digit 2", "7"):
            r = c.post(f"/api/predict?method={method}&target={target}", files={"file": ("d.png", img, "image/png")})
            assert r.status_code == 200, r.text
            ex = r.json()["explained"]
            want = None if method == "rollout" else "digit 2" if target == "digit 2" else "digit 7"
            assert ex["method"] == method and ex["class"] == want and ex["class_specific"] == (want is not None)
            overlays[method, target] = r.json()["overlay"]
    assert overlays["rollout", "digit 2"] == overlays["rollout", "7"]  # class-agnostic
    assert overlays["grad-rollout", "digit 2"] != overlays["grad-rollout", "7"]
    assert overlays["gradcam", "digit 2"] != overlays["gradcam", "7"]
    for query, msg in [("method=gradcm", "unknown explanation method 'gradcm'"),
                       ("target=digit 12", "unknown class 'digit 12'"), ("target=10", "out of range")]:
        r = c.post(f"/api/predict?{query}", files={"file": ("d.png", img, "image/png")})
        assert r.status_code == 400 and msg in r.json()["error"], r.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (.ci/run installs it)")
def test_real_browser_uploads_and_sees_prediction_and_overlay(tmp_path, bomb):
    sync_api = pytest.importorskip("playwright.sync_api")
    from vitkit.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--epochs", "15", "--output", str(run)]) == 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "vitkit", "serve", "--checkpoint", str(run / "best"),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.3)
        x, y = digits_arrays()
        digit = tmp_path / "seven.png"
        Image.fromarray(x[y == 7][-1]).resize((96, 96), Image.NEAREST).save(digit)
        (tmp_path / "bomb.png").write_bytes(bomb)
        (tmp_path / "notes.txt").write_text("not an image")
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("#examples img")  # example images from the run's dataset
            page.set_input_files("#file", str(digit))
            page.wait_for_selector("#top .label")
            labels = page.locator("#top .label").all_inner_texts()
            assert len(labels) == 5 and labels[0] == "7"
            src = page.get_attribute("#overlay", "src")
            assert src.startswith("data:image/png;base64,") and len(src) > 1000
            assert page.is_visible("#legend") and page.input_value("#method") == "grad-rollout"
            assert page.inner_text("#why").startswith("7 (")  # the predicted class, explained first
            second = page.locator("#top .label").nth(1).inner_text()
            page.locator("#top tr.row").nth(1).click()  # explain the runner-up instead
            page.wait_for_function(f"document.querySelector('#why').textContent.startsWith('{second} (')")
            assert page.locator("#top tr.chosen .label").inner_text() == second
            assert page.get_attribute("#overlay", "src") != src
            page.select_option("#method", "rollout")
            page.wait_for_function("document.querySelector('#why').textContent.startsWith('rollout · the same map')")
            assert page.locator("#top tr.chosen").count() == 0  # a class-agnostic map explains no row
            page.select_option("#method", "gradcam")
            page.wait_for_function("document.querySelector('#why').textContent.endsWith('gradcam')")
            assert page.inner_text("#why").startswith(f"{second} (")  # the class stays as chosen
            page.set_input_files("#file", str(tmp_path / "bomb.png"))
            page.wait_for_selector("#error:visible")
            assert "pixels, more than the limit of 40,000,000" in page.inner_text("#error")
            assert page.locator("#top .label").count() == 0  # the previous prediction is not left beside the error
            assert not page.is_visible("#overlay")
            page.set_input_files("#file", str(tmp_path / "notes.txt"))
            page.wait_for_function("document.querySelector('#error').textContent.includes('not an image')")
            page.locator("#examples img").first.click()  # the server is still up and answering
            page.wait_for_function("document.querySelector('#error').style.display === 'none'")
            page.wait_for_selector("#top .label")
            browser.close()
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_int8_onnx_export_is_onnxruntimes_int8_layout_and_runs_in_eval_and_predict(tmp_path, capsys):
    """`vitkit export --int8`: every linear layer a MatMulInteger over int8 weights in 7 bits (onnxruntime's dynamic
    quantization), and `vitkit eval` / `vitkit predict` run the file. That it keeps a trained model's accuracy is
    checked on the trained digits model by the export tutorial (docs/tutorials/export-serve-scale.md)."""
    pytest.importorskip("onnxruntime")
    import json

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from vitkit.cli.main import main
    from vitkit.data.preprocess import preprocessing_of

    model = vitkit.VisionTransformer(tiny_config(num_classes=10, in_chans=1, img_size=8, patch_size=2))
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "m")
    out = str(tmp_path / "m8.onnx")
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--format", "onnx", "--int8", "--out", out]) == 0
    assert "int8 logits differ" in capsys.readouterr().out

    proto = onnx.load(out)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["vitkit.preprocessing"]) == preprocessing_of(vitkit.load(tmp_path / "m"))  # kept
    assert json.loads(meta["vitkit.config"]) == model.config.to_dict()
    graph = proto.graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    linears = [n for n in graph.node if n.op_type == "MatMulInteger"]
    assert len(linears) >= 4 * model.config.depth  # qkv, proj, fc1, fc2 of every block
    for n in linears:
        w = weights[n.input[1]]
        # 7-bit: a pair of uint8 x int8 products, 2 x 255 x 64, stays under the int16 limit AVX2 sums them in
        assert w.dtype == np.int8 and np.abs(w.astype(int)).max() <= 64
    assert not any(n.op_type == "MatMul" and n.input[1] in weights and weights[n.input[1]].dtype == np.float32
                   and weights[n.input[1]].ndim == 2 for n in graph.node)  # no linear layer left in fp32

    assert main(["eval", "--checkpoint", out, "--dataset", "digits", "--out", str(tmp_path / "e")]) == 0
    assert "onnxruntime, int8 (dynamic, per channel, 7-bit weights)" in capsys.readouterr().out
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["n"] > 300
    image = str(tmp_path / "d.png")
    Image.fromarray(digits_arrays()[0][-1]).resize((32, 32)).save(image)
    assert main(["predict", "--checkpoint", out, image, "--json", "--topk", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["top"]) == 3


def test_onnx_files_vitkit_cannot_run_are_refused_by_name(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from vitkit.cli.main import main

    from onnx import TensorProto, helper, save

    plain = tmp_path / "plain.onnx"  # a valid ONNX file (pixel_values -> logits) without vitkit's metadata
    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["logits"])], "plain",
                              [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(plain))
    assert main(["eval", "--checkpoint", str(plain)]) == 2
    assert "plain.onnx: no 'vitkit.config' in the ONNX metadata" in capsys.readouterr().err
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x08\x07garbage")
    assert main(["predict", "--checkpoint", str(broken), str(plain)]) == 2
    assert "broken.onnx: not an ONNX model onnxruntime can run" in capsys.readouterr().err
    model = vitkit.VisionTransformer(tiny_config(num_classes=10, in_chans=1, img_size=8, patch_size=2))
    model.save_pretrained(tmp_path / "m")
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--format", "onnx",
                 "--out", str(tmp_path / "m.onnx")]) == 0
    for flags, said in ((["--device", "cuda"], "run on the CPU here"), (["--precision", "bf16"], "number format")):
        assert main(["eval", "--checkpoint", str(tmp_path / "m.onnx"), *flags]) == 2
        assert said in capsys.readouterr().err
    assert main(["inspect", "rollout", "--checkpoint", str(plain), "--out", str(tmp_path / "r.png")]) == 2
    assert "needs the PyTorch weights" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--format", "safetensors", "--int8",
                 "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "--int8 applies to --format onnx only" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--format", "onnx", "--int8",
                 "--out", str(tmp_path / "no" / "m8.onnx")]) == 2
    assert f"the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()
