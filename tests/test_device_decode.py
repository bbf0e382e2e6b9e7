"""Streamed JPEGs decoded on the training device (data/device_decode.py, issue 65): the same pixels as the workers'
PIL decode within a JPEG decoder's tolerance, EXIF orientation as PIL applies it, mixed batches (PNG, gray, CMYK
decoded by the workers), a damaged file named or skipped, and a run that trains with it (on the CPU, and on a played
GPU where the batch's decode is handed the GPU)."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data.device_decode import decode_batch, jpeg_orientation, orient
from vitkit.data.stream import Prepare
from vitkit.training.config import TrainConfig
from vitkit.training.trainer import Trainer

CPU = torch.device("cpu")
EVAL = {"img_size": [48, 48], "crop_pct": 0.875, "crop_mode": "center", "interpolation": "bicubic"}
SQUASH = {"img_size": [48, 48], "crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear"}


def photo(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth picture with a little grain, as a photo is (not noise, which no two JPEG decoders agree on)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([np.sin(xx / 7 + c + seed) * 60 + np.cos(yy / 11 - c) * 60 + 128 for c in range(3)], -1)
    a = np.clip(a + rng.normal(0, 3, a.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(a).convert(mode)


def jpeg(img: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, "JPEG", quality=92, **kw)
    return b.getvalue()


def on_device(data: bytes, prep: Prepare, channels: int = 3) -> torch.Tensor:
    item = (torch.frombuffer(bytearray(data), dtype=torch.uint8), jpeg_orientation(data), "x.jpg")
    return decode_batch([item], channels, prep.crop, prep.size, prep.train, CPU, None, prep.decode_side)[0]


@pytest.mark.parametrize("spec", [None, EVAL, SQUASH], ids=["resized", "centre-crop", "squash"])
def test_the_device_decode_gives_the_workers_pixels(spec):
    prep = Prepare((48, 48), 4 * 55 if spec else 48, spec)
    for h, w in [(90, 72), (48, 48), (37, 61), (120, 90)]:
        data = jpeg(photo(h, w))
        want = torch.from_numpy(prep.array(data, "x.jpg", 3)).float()
        got = on_device(data, prep).float()
        assert got.shape == want.shape == (3, 48, 48)
        diff = (got - want).abs()
        assert diff.mean() < 1.0 and diff.max() <= 12, (h, w, float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("orientation", [2, 3, 4, 5, 6, 7, 8])
def test_exif_orientation_is_applied_as_pil_applies_it(orientation):
    img = photo(40, 64, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(img, exif=exif.tobytes())
    prep = Prepare(None, 1000, None)
    want = torch.from_numpy(prep.array(data, "x.jpg", 3)).float()  # PIL's exif_transpose
    got = on_device(data, prep).float()
    assert got.shape == want.shape and (got - want).abs().mean() < 1.0


@pytest.mark.parametrize("orientation", [1, 6])
def test_the_training_crop_is_drawn_where_the_file_is_read_and_cut_as_the_workers_cut_it(orientation):
    """A worker draws the inception crop's box from the file's header (the image as oriented) with the generator its
    PIL decode would draw it from; the device cuts that box: the PIL crop's pixels, seed for seed. (So the device's
    decode draws nothing and can run on another thread, issue 80 N2.)"""
    from vitkit.data.device_decode import draw_box, jpeg_header

    spec = {**EVAL, "train_area": [0.25, 1.0]}
    prep = Prepare((48, 48), 1000, spec, train=True)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(photo(90, 60, seed=3), exif=exif.tobytes())
    o, pixels, hw = jpeg_header(data)
    assert hw == ((60, 90) if orientation == 6 else (90, 60))
    boxes = []
    for seed in range(3):
        torch.manual_seed(seed)
        want = torch.from_numpy(prep.array(data, "x.jpg", 3)).float()  # the workers' PIL decode and crop
        torch.manual_seed(seed)
        boxes.append(draw_box(spec, True, hw))
        item = (torch.frombuffer(bytearray(data), dtype=torch.uint8), o, "x.jpg", pixels, boxes[-1])
        got = decode_batch([item], 3, spec, prep.size, True, CPU, None, prep.decode_side)[0].float()
        assert got.shape == want.shape == (3, 48, 48) and (got - want).abs().mean() < 1.5, (seed, boxes[-1])
    assert len(set(boxes)) == 3 and draw_box(spec, False, hw) is None and draw_box(EVAL, True, hw) is None


def test_what_the_device_cannot_decode_is_left_to_the_workers():
    b = io.BytesIO()
    photo(20, 20).save(b, "PNG")
    assert jpeg_orientation(b.getvalue()) is None
    assert jpeg_orientation(jpeg(photo(20, 20, mode="CMYK"))) is None
    assert jpeg_orientation(jpeg(photo(20, 20, mode="L"))) == 1
    assert jpeg_orientation(jpeg(photo(30, 30)), max_pixels=100) is None  # too large to decode whole on a GPU
    # progressive: nvJPEG's batched decode takes baseline JPEGs only (torchvision decodes the others one by one, on
    # the thread that feeds the GPU); the workers decode them side by side
    assert jpeg_orientation(jpeg(photo(30, 30), progressive=True)) is None
    assert jpeg_orientation(jpeg(photo(30, 30), progressive=False)) == 1
    assert torch.equal(orient(torch.arange(6).reshape(1, 2, 3), 1), torch.arange(6).reshape(1, 2, 3))


def test_a_batch_is_decoded_in_chunks_of_bounded_full_size_bytes_each_cut_before_the_next(monkeypatch):
    """Issue 80 N4: a device-decoded batch was decoded whole at full size before any crop (a batch of 4096 photos of
    up to 4 MP: 48 GB). Chunks of at most DECODE_BYTES of full-size pixels (the workers read each image's size from
    its header), each cut to the model's size before the next is decoded; the pixels those of one call; a damaged
    file re-decodes only its own chunk one at a time (N5)."""
    import vitkit.data.device_decode as dd
    from vitkit.data.device_decode import chunks, jpeg_header

    assert [list(r) for r in chunks([10, 10, 10, 50, 5], 3, 60)] == [[0, 1], [2], [3], [4]]  # 30+30; 30; 150 alone
    assert chunks([], 3, 60) == []
    sizes = [(40, 30), (60, 50), (30, 30), (80, 64), (20, 50)]
    datas = [jpeg(photo(h, w, seed=i)) for i, (h, w) in enumerate(sizes)]
    assert jpeg_header(datas[1]) == (1, 60 * 50, (60, 50))
    items = [(torch.frombuffer(bytearray(d), dtype=torch.uint8), *jpeg_header(d)[:1], f"{i}.jpg", jpeg_header(d)[1])
             for i, d in enumerate(datas)]
    prep = Prepare((48, 48), 4 * 55, EVAL)
    whole = decode_batch(items, 3, prep.crop, prep.size, prep.train, CPU, None, prep.decode_side)
    from torchvision.io import decode_jpeg
    calls = []

    def counting(data, **kw):
        calls.append([int(d.numel()) for d in data] if isinstance(data, list) else None)
        return decode_jpeg(data, **kw)
    monkeypatch.setattr("torchvision.io.decode_jpeg", counting)
    monkeypatch.setattr(dd, "DECODE_BYTES", 3 * 60 * 50 + 3 * 40 * 30)  # two of these photos at most
    parts = decode_batch(items, 3, prep.crop, prep.size, prep.train, CPU, None, prep.decode_side)
    assert [len(c) for c in calls] == [2, 1, 1, 1]  # 40x30 + 60x50; 30x30 (+ 80x64 is over); 80x64 over alone; 20x50
    assert all(torch.equal(a, b) for a, b in zip(whole, parts)) and all(a.shape == (3, 48, 48) for a in parts)
    bad = datas[2][:300] + b"\x00" * 200  # its header reads; the decoder refuses it
    items[2] = (torch.frombuffer(bytearray(bad), dtype=torch.uint8), 1, "2.jpg", 30 * 30)
    calls.clear()
    named = []
    decode_batch(items, 3, prep.crop, prep.size, prep.train, CPU, lambda data, where: named.append(where), None)
    assert named == ["2.jpg"] and len(calls) == 4 and calls[1] == [500]  # its chunk (itself) alone, not all five
    # a damaged file in a chunk of 16: its halves decoded apart down to it (1 + 2 a level x 4 levels), not 16 + 1
    many = [items[0]] * 7 + [items[2]] + [items[1]] * 8
    monkeypatch.setattr(dd, "DECODE_BYTES", 10**9)
    calls.clear(), named.clear()
    out = decode_batch(many, 3, prep.crop, prep.size, prep.train, CPU, lambda data, where: named.append(where), None)
    assert named == ["2.jpg"] and len(calls) == 9 and all(isinstance(c, list) for c in calls)
    assert torch.equal(out[0], whole[0]) and torch.equal(out[15], whole[1]) and out[7] is None


def _jpeg_folder(root, per_class=6, bad=None):
    for split in ("train", "val"):
        for c in range(3):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                img = photo(30 + 7 * i, 40 + 3 * c, seed=c * 100 + i)
                if i == 0:  # a PNG, a gray JPEG and a progressive one among them: the batch mixes both decodes
                    img.save(d / f"{i}.png")
                else:
                    (d / f"{i}.jpg").write_bytes(jpeg(img if i != 1 else img.convert("L"), progressive=i == 2))
    if bad is not None:
        good = jpeg(photo(30, 40))
        (root / "train" / "c0" / "bad.jpg").write_bytes(good[:300] + b"\x00" * 200)  # the header reads
    return root


def test_a_streamed_run_decodes_its_jpegs_on_the_device(tmp_path):
    root = _jpeg_folder(tmp_path / "d")
    base = dict(dataset="folder", data_dir=str(root), data_mode="stream", workers=1, epochs=1, batch_size=6,
                model_args={"img_size": 32}, cache_dir=str(tmp_path / "c"), threads=1, precision="fp32",
                compile=False, attention="sdpa", channels_last=False)
    said = []
    t = Trainer(TrainConfig(**base, decode="device"), log=said.append, progress=False)
    assert t.data.train.device_decode and any("decode" in s for s in said)
    r = t.fit()
    assert r.epochs == 1 and 0 <= r.val_top1 <= 100
    t = Trainer(TrainConfig(**base), log=lambda s: None, progress=False)
    assert t.cfg.decode == "workers" and not t.data.train.device_decode  # auto on a CPU: its workers
    x_dev = torch.cat([x for x, _ in _batches(root, tmp_path, "device")])
    x_wrk = torch.cat([x for x, _ in _batches(root, tmp_path, "workers")])
    assert x_dev.shape == x_wrk.shape and (x_dev.float() - x_wrk.float()).abs().mean() < 1.5


def _batches(root, tmp_path, decode):
    from vitkit.data.augment import batches
    from vitkit.training.build import build_data

    data = build_data(TrainConfig(dataset="folder", data_dir=str(root), data_mode="stream",
                                  model_args={"img_size": 32}, cache_dir=str(tmp_path / "c")))
    data.val.device_decode = decode == "device"
    data.val.workers = 0
    return list(batches(data.val, list(range(len(data.val))), 4, False, CPU))


def _device_decoded_train(root, cache, skip):
    """The training split of the folder ``root``, streamed, its JPEGs decoded by the batches' device, in process."""
    from vitkit.training.build import build_data

    data = build_data(TrainConfig(dataset="folder", data_dir=str(root), data_mode="stream", skip_bad_images=skip,
                                  model_args={"img_size": 32}, cache_dir=str(cache)))
    data.train.device_decode, data.train.workers = True, 0
    return data.train


def test_a_damaged_jpeg_is_named_or_skipped(tmp_path):
    from vitkit.data.augment import batches

    root = _jpeg_folder(tmp_path / "d", bad=True)
    for skip in (False, True):
        train = _device_decoded_train(root, tmp_path / f"c{skip}", skip)
        everything = list(range(len(train)))
        if not skip:
            with pytest.raises(ValueError, match="bad.jpg"):
                list(batches(train, everything, 4, False, CPU))
        else:
            n = sum(len(y) for _, y in batches(train, everything, 4, False, CPU))
            assert n == len(train) - 1 and train.skipped_in_training == 1


def test_on_a_played_gpu_the_batch_is_decoded_there(tmp_path, monkeypatch):
    """--decode device on a GPU hands the JPEGs to the device; the decode is called with the GPU (played here:
    decoded on the CPU and moved, as decode_jpeg(device="cuda") returns). Untimed (--workers given), auto keeps
    the workers: no GPU has run the device's decode yet (issue 80, N3)."""
    import torchvision.io

    from device_shim import played_gpu

    real = torchvision.io.decode_jpeg
    asked, threads = [], set()

    def decode_jpeg(data, mode=None, device="cpu"):
        asked.append(torch.device(device).type)
        threads.add(threading.current_thread().name.split("_")[0])
        out = real(data, mode=mode)
        return [t.to(device) for t in out] if isinstance(out, list) else out.to(device)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    root = _jpeg_folder(tmp_path / "d")
    cfg = TrainConfig(dataset="folder", data_dir=str(root), data_mode="stream", workers=1, epochs=1, batch_size=6,
                      model_args={"img_size": 32}, cache_dir=str(tmp_path / "c"), threads=1, precision="fp32",
                      compile=False, attention="sdpa", channels_last=False, device="cuda", gpu_batch=False)
    with played_gpu():
        said = []
        untimed = Trainer(cfg, log=said.append, progress=False)
        assert untimed.cfg.decode == "workers" and not untimed.data.train.device_decode
        assert any("--decode device to use it" in s for s in said)
        t = Trainer(TrainConfig.from_dict({**cfg.to_dict(), "decode": "device"}), log=lambda s: None, progress=False)
        assert t.cfg.decode == "device" and t.data.train.device_decode
        r = t.fit()
    assert r.epochs == 1 and asked.count("cuda") >= 2  # (the mean and std are read on the CPU, before training)
    assert threads == {"MainThread", "vitkit-decode"}  # on a GPU the batches are decoded ahead, on a thread (N2)


def test_on_a_played_gpu_a_damaged_jpeg_is_named_or_skipped_and_the_batch_stays_there(tmp_path, monkeypatch):
    """The GPU's decode refuses a damaged JPEG whose header read; its chunk is decoded in halves down to it, the
    file is handed to the workers' decode (named, or skipped and counted), and the batch is one GPU tensor. A JPEG
    that the GPU's decoder refuses but libjpeg reads (played: one with a marked comment) is decoded on the host and
    moved to the GPU, not stacked from the host beside the GPU's images (which a GPU refuses)."""
    import torchvision.io

    from device_shim import played_gpu
    from vitkit.data.augment import batches

    real = torchvision.io.decode_jpeg
    calls = []

    def decode_jpeg(data, mode=None, device="cpu"):  # as decode_jpeg(device="cuda") answers: a list on the GPU
        calls.append((torch.device(device).type, len(data)))
        if any(REFUSED in bytes(d.numpy()) for d in data):
            raise RuntimeError("nvjpegDecodeJpeg failed (played)")
        return [t.to(device) for t in real(data, mode=mode)]

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    root = _jpeg_folder(tmp_path / "d", bad=True)
    REFUSED = b"played: refused by the GPU's decoder"
    (root / "train" / "c1" / "refused.jpg").write_bytes(jpeg(photo(36, 44, seed=7), comment=REFUSED))
    gpu = torch.device("cuda")
    for skip in (False, True):
        train = _device_decoded_train(root, tmp_path / f"c{skip}", skip)
        everything = list(range(len(train)))
        calls.clear()
        with played_gpu() as shim:
            if not skip:
                with pytest.raises(ValueError, match="bad.jpg"):
                    list(batches(train, everything, len(everything), False, gpu))
                continue
            got = list(batches(train, everything, len(everything), False, gpu))
            assert all(x.device.type == "cuda" and y.device.type == "cuda" for x, y in got)
            n = sum(len(y) for _, y in got)
        assert n == len(train) - 1 and train.skipped_in_training == 1  # the refused one trained, from the host
        jpegs = calls[0][1]  # one batch: its JPEGs (the PNGs are the workers'), the damaged one among them
        assert all(kind == "cuda" for kind, _ in calls) and len(calls) <= 1 + 4 * (jpegs - 1).bit_length()
        assert shim.syncs() == 0  # nothing read back from the GPU to find the file or to build the batch


def test_the_next_batch_is_decoded_on_a_thread_while_the_step_trains_and_the_batches_are_the_same(tmp_path,
                                                                                                 monkeypatch):
    """Issue 80, N2: the device's decode of batch i+1 runs on its own thread while the step trains on batch i (on a
    GPU by default; asked for here on the CPU), and gives the very batches the training thread's decode gives,
    random training crops included (drawn by the workers, seeded from the run's generator)."""
    import dataclasses

    from vitkit.data import stream
    from vitkit.data.augment import batches
    from vitkit.training.build import build_data

    where = []
    real = stream.decode_batch

    def decode_batch(*a, **k):
        where.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(stream, "decode_batch", decode_batch)
    root = _jpeg_folder(tmp_path / "d", per_class=8)
    data = build_data(TrainConfig(dataset="folder", data_dir=str(root), data_mode="stream",
                                  model_args={"img_size": 32}, cache_dir=str(tmp_path / "c")))
    train = data.train
    train.prep = dataclasses.replace(train.prep, crop={**EVAL, "img_size": [32, 32], "train_area": [0.25, 1.0]},
                                     train=True)
    train.device_decode = True
    got = {}
    for ahead in (False, True):
        for workers in (0, 1):
            train.decode_ahead, train.workers = ahead, workers
            where.clear()
            torch.manual_seed(0)
            got[ahead, workers] = list(batches(train, list(range(len(train))), 5, False, CPU))
            assert all(w.startswith("vitkit-decode") == ahead for w in where) and len(where) == 5  # 24 images / 5
            assert sum(len(y) for _, y in got[ahead, workers]) == len(train)
    for workers in (0, 1):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(got[False, workers], got[True, workers], strict=True))
    train.decode_ahead = True  # left after two batches (a worker count's timing does): its thread ends with it
    it = batches(train, list(range(len(train))), 5, False, CPU)
    next(it), next(it)
    assert any(t.name.startswith("vitkit-decode") for t in threading.enumerate())
    it.close()
    assert not any(t.name.startswith("vitkit-decode") for t in threading.enumerate())
    torch.manual_seed(1)  # another seed, other crops: the comparison above can tell batches apart
    other = list(batches(train, list(range(len(train))), 5, False, CPU))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(other, got[True, 1]))


def test_the_gpu_batch_is_sized_with_the_decode_ahead_held_beside_the_step(tmp_path):
    """The next batch is decoded (at full size, up to DECODE_BYTES) while the step runs, so on a GPU the batch search
    sizes the step to the free memory less that, where a stream's JPEGs may be decoded there; not for the workers'
    decode, nor for data held in memory."""
    from device_shim import played_gpu
    from vitkit.data.device_decode import DECODE_BYTES
    from vitkit.training.build import build_data
    from vitkit.training.plan import _held_beside_the_step

    root = _jpeg_folder(tmp_path / "d")
    gpu = torch.device("cuda")
    for mode, decode, want in (("stream", "device", DECODE_BYTES), ("stream", "auto", DECODE_BYTES),
                               ("stream", "workers", 0), ("memory", "auto", None)):
        cfg = TrainConfig(dataset="folder", data_dir=str(root), data_mode=mode, decode=decode,
                          model_args={"img_size": 32}, cache_dir=str(tmp_path / f"c{mode}"))
        data = build_data(cfg)
        with played_gpu(free_gib=70.0):
            held, what = _held_beside_the_step(cfg, data, gpu)
        if want is None:  # in memory: the dataset itself lives on the GPU
            assert held == sum(t.images.nbytes + t.labels.nbytes for t in (data.train, data.val))
            assert what == ["the dataset, resident there"]
        else:
            assert held == want and (what == [] if not want else "decoded at full size" in what[0])


def test_on_a_gpu_host_the_workers_are_as_many_as_its_memory_holds(tmp_path, monkeypatch):
    """Issue 80, P9: on a GPU the step's memory is the GPU's, and the host's was never planned: --workers 64 started
    64 workers whatever the host had. Each holds its batches in flight (PREFETCH x 3 copies of a batch of uint8
    images, memory_plan.worker_bytes); the host's room less RESERVE decides how many start, and the plan says so."""
    from device_shim import played_gpu
    from vitkit.data.stream import PREFETCH
    from vitkit.runtime.memory import Memory
    from vitkit.training import memory_plan, plan as plan_mod
    from vitkit.training.build import build_data

    root = _jpeg_folder(tmp_path / "d")
    cfg = TrainConfig(dataset="folder", data_dir=str(root), data_mode="stream", workers=64, batch_size=512,
                      eval_batch_size=256, model_args={"img_size": 32}, cache_dir=str(tmp_path / "c"))
    data = build_data(cfg)
    per = memory_plan.WORKER_BYTES + 3 * PREFETCH * 512 * 3 * 32 * 32  # 64 MiB + 18 MiB of batches in flight
    for room_workers in (1, 0):  # (under the cores' cap: two a core)
        available = memory_plan.RESERVE + room_workers * per + per // 2
        monkeypatch.setattr(memory_plan, "available_memory", lambda: Memory(available, None, "host MemAvailable"))
        p = plan_mod.Plan("folder", "cuda:0", "played", {})
        with played_gpu():
            out = plan_mod._decide_workers(cfg, data, torch.device("cuda"), p)
        assert out.workers == room_workers and p.memory["max_workers"] == room_workers
        assert any(n.startswith("host memory:") and f"{room_workers} fit" in n for n in p.notes)
        assert any(f"--workers 64 -> {room_workers}" in n and "memory" in n for n in p.notes)
