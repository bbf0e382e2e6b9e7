"""Loopback load test of `vitkit serve`: N concurrent uploads to a small model, latency percentiles, and how long the
page takes to answer while the burst is in flight. Prints numbers; asserts nothing.

    python benchmarks/serve_load.py [--uploads 50] [--threads N] [--workers N] [--max-batch 16] [--busy]

--busy keeps one core busy with another process meanwhile (the shared-machine case). The model is the default
`vitkit train` model (digits, 8x8) untrained: the serving path, not the weights, is what is timed.
"""
from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
from PIL import Image

import vitkit
from vitkit.runtime.cpu import cpu_kind
from vitkit.serving.predictor import Limits


def _serve(args):  # type: ignore[no-untyped-def]
    import socket

    import uvicorn

    from vitkit.serving.app import create_app
    from vitkit.serving.predictor import Predictor

    model = vitkit.create_model(args.model, num_classes=10, in_chans=1, img_size=8, patch_size=2)
    limits = Limits(workers=args.workers, max_batch=args.max_batch, max_queue=args.max_queue)
    predictor = Predictor(model, {"mean": [0.5], "std": [0.25]}, limits, threads=args.threads)
    print(predictor.threads_note, f"| workers {predictor.workers}, max batch {limits.max_batch}")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(predictor), log_level="warning",
                                           limit_concurrency=limits.max_connections))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, sock.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uploads", type=int, default=50)
    p.add_argument("--model", default="vit_nano_patch2_8")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--busy", action="store_true", help="keep one core busy with another process")
    args = p.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    server, port = _serve(args)
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(args.uploads):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    httpx.post(f"{url}/api/predict", files={"file": ("w.png", pngs[0])}, timeout=60)  # warm-up
    latencies: list[float] = []
    codes: list[int] = []
    page: list[float] = []

    def upload(data: bytes) -> None:
        t = time.perf_counter()
        r = httpx.post(f"{url}/api/predict", files={"file": ("x.png", data)}, timeout=60)
        latencies.append(time.perf_counter() - t)
        codes.append(r.status_code)

    threads = [threading.Thread(target=upload, args=(d,)) for d in pngs]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(0.05)
    t = time.perf_counter()
    httpx.get(url + "/", timeout=60)
    page.append(time.perf_counter() - t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    server.should_exit = True
    if busy:
        busy.kill()
    q = statistics.quantiles(latencies, n=20)
    print(f"machine: {cpu_kind()}{' (one core kept busy)' if args.busy else ''}")
    print(f"{args.uploads} concurrent uploads: p50 {statistics.median(latencies):.2f} s, p95 {q[18]:.2f} s, "
          f"max {max(latencies):.2f} s, all answered in {wall:.2f} s; status {sorted(set(codes))}; "
          f"page during the burst {page[0] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
