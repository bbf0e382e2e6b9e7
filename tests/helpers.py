"""Small real-image fixtures made from scikit-learn's digits and the shared CIFAR-10 zip."""
from __future__ import annotations

import gzip
import os
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

# the team's CIFAR-10 JPEG zip: $VITKIT_CIFAR_ZIP, ../shared next to the checkout, or the workspace's shared/
_CIFAR_CANDIDATES = [Path(p) for p in (os.environ.get("VITKIT_CIFAR_ZIP"),) if p] + [
    Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpg.zip",
    Path("/work/shared/data/cifar10-jpg.zip")]
SHARED_CIFAR = next((p for p in _CIFAR_CANDIDATES if p.is_file()), _CIFAR_CANDIDATES[0])


def digits_arrays():
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.round(d.images * (255 / 16)).astype(np.uint8), d.target


def write_digits_folder(root: Path, per_class: int = 12, size: int = 16, val_split: str = "val",
                        mode: str = "L") -> Path:
    """ImageFolder of real digits, upscaled to ``size`` (PNG), train/ and val/."""
    x, y = digits_arrays()
    for split, offset in (("train", 0), (val_split, 500)):
        for c in range(10):
            (root / split / str(c)).mkdir(parents=True, exist_ok=True)
            idx = np.where(y == c)[0][offset // 10: offset // 10 + per_class]
            for i in idx:
                im = Image.fromarray(x[i]).resize((size, size), Image.NEAREST).convert(mode)
                im.save(root / split / str(c) / f"{i}.png")
    return root


def write_idx(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    def idx_bytes(a: np.ndarray) -> bytes:
        head = bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
        return head + a.astype(np.uint8).tobytes()

    for kind, a in (("images-idx3", images), ("labels-idx1", labels)):
        data = idx_bytes(a)
        name = f"{prefix}-{kind}-ubyte" + (".gz" if gz else "")
        (root / name).write_bytes(gzip.compress(data) if gz else data)


def cifar_slice(root: Path, per_class: int = 10) -> Path | None:
    """A small ImageFolder zip cut from the shared CIFAR-10 JPEG zip (None when it is not there)."""
    if not SHARED_CIFAR.is_file():
        return None
    out = root / "cifar-small.zip"
    with zipfile.ZipFile(SHARED_CIFAR) as src, zipfile.ZipFile(out, "w") as dst:
        counts: dict[tuple[str, str], int] = {}
        for n in src.namelist():
            parts = n.split("/")
            if len(parts) == 4 and parts[3].endswith(".jpg"):
                key = (parts[1], parts[2])
                if counts.get(key, 0) < per_class:
                    counts[key] = counts.get(key, 0) + 1
                    dst.writestr(n, src.read(n))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_then_stop(argv: list[str], port: int, cwd: Path | None = None, env: dict | None = None,
                    wait_s: float = 240) -> tuple[int, str]:
    """Start ``vitkit serve`` (``argv``, listening on ``port``), wait until its page answers, stop it with SIGTERM
    as a service manager would; its exit code and what it printed."""
    import signal
    import subprocess
    import time
    import urllib.request

    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            assert proc.poll() is None, f"serve ended with {proc.returncode}: {proc.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    assert r.status == 200 and b"<html" in r.read().lower()
                break
            except OSError:
                assert time.monotonic() < deadline, "serve never answered"
                time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out
