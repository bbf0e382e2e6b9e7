"""Images read from their files as training goes, for a folder (or zip) larger than the memory a process may use.

The in-memory path (folder.py) decodes every image once and cuts batches from one uint8 tensor. Streaming gives the
trainer the same thing batch by batch: DataLoader worker processes read and decode the files a batch names, each
image prepared exactly as the in-memory path prepares it (the same decode, size and channels), and the batch then
goes through the same augmentation on the device. So a streamed run trains on the same pixels, in the same order
(the sampler's indices), as an in-memory run, resumes mid-epoch at the same batch, and under torchrun each rank
reads its own part of each epoch. Memory is bounded by the batches in flight, not by the dataset.

The files are listed once and their headers read once (sizes, gray or colour), cached beside the decoded datasets.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from PIL import Image

from ..model.serialization import atomic_write
from ..runtime.memory import release_free_memory
from .device_decode import decode_batch, draw_box, jpeg_header
from .images import (BadImageError, decode_within, fit_within, inception_crop, is_gray, resize_and_crop, to_array,
                     too_many_pixels)

PREFETCH = 4  # batches each worker keeps ready: enough to hide a slow file, bounded memory
WORKER_TIMEOUT_S = 600  # a worker silent this long (a hung network mount) is an error, not a hang
STATS_SAMPLE = 512  # images decoded for the dataset's mean and std (the in-memory path uses up to 20,000)


@dataclasses.dataclass
class Prepare:
    """How every image of a dataset is turned into the uint8 (C, H, W) array its batches are cut from: the same
    function for the decode into memory and for the streaming workers."""

    size: tuple[int, int] | None  # (H, W) every image is resized to (None until decided from the headers)
    decode_side: int  # decoded no larger than this on its longer side (JPEG DCT scaling), then resized to size
    crop: dict[str, Any] | None  # pretrained weights' resize + centre crop (images.crop_spec), or None
    # the training split's: a random crop each time an image is read, where ``crop`` has a ``train_area``
    train: bool = False

    def decode(self, data: bytes, where: str) -> tuple[Image.Image, tuple[int, int]]:
        """The image as read (cropped for ``crop``) and its full size (H, W)."""
        img, full = decode_within(data, where, max_side=self.decode_side)
        if self.crop is not None:  # the gray test needs the image as stored; the crop keeps the channel count
            cut = inception_crop if self.train and "train_area" in self.crop else resize_and_crop
            img = cut(self.crop, 1 if is_gray(img) else 3)(img)
        return img, full

    def array(self, data: bytes, where: str, channels: int) -> np.ndarray:
        a = to_array(self.decode(data, where)[0], channels, self.size)
        return a if a.flags.writeable else a.copy()  # (a gray image's array is PIL's read-only buffer)


def check_size(size: int, limit: int, where: str) -> None:
    """A file larger than any image should be (``limit`` bytes) is a BadImageError naming it, before it is read."""
    if size > limit:
        raise BadImageError(where, f"{size:,} bytes, more than the {limit:,} an image file may have")


class Reader:
    """Reads members of a folder or zip; a zip is opened again in each process (a file handle shared with forked
    DataLoader workers would interleave their reads)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self.is_zip = path.is_file()
        self._zip: zipfile.ZipFile | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_zip": None, "_pid": -1}

    def where(self, name: str) -> str:
        return f"{self.path}/{name}" if self.is_zip else str(self.path / name)

    def read(self, name: str) -> bytes:
        """The file's bytes; a file too large to be an image or that cannot be read is a BadImageError naming it."""
        try:
            if self.is_zip:
                if self._pid != os.getpid():
                    self._zip, self._pid = zipfile.ZipFile(self.path), os.getpid()
                size = self._zip.getinfo(name).file_size
            else:
                size = (self.path / name).stat().st_size
            check_size(size, self.max_bytes, self.where(name))  # before a byte is inflated: a zip bomb is refused
            return self._zip.read(name) if self._zip is not None else (self.path / name).read_bytes()
        except (OSError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise BadImageError(self.where(name), f"cannot read it ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------------------------------ the listing
@dataclasses.dataclass
class Listing:
    """A folder's images, by split: stored names and class indices in the in-memory path's order, every image's
    full size (H, W) and whether all are gray; read from headers alone (no pixel decoded)."""

    names: dict[str, list[str]]
    labels: dict[str, list[int]]
    sizes: dict[str, int]  # "HxW" -> count, over every split
    gray: bool
    skipped: list[str]  # files whose header did not read (--skip-bad-images)

    def common_size(self) -> tuple[int, int]:
        h, w = max(self.sizes.items(), key=lambda kv: kv[1])[0].split("x")
        return int(h), int(w)


def header(data: bytes, where: str) -> tuple[tuple[int, int], bool]:
    """((H, W) after EXIF rotation, gray) from a file's header; a palette image is decoded to tell gray."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format == "PNG":  # PIL's getexif() decodes a whole PNG to look for a late eXIf chunk
                exif = Image.Exif()
                if im.info.get("exif"):
                    exif.load(im.info["exif"])
            else:
                exif = im.getexif()  # JPEG, WebP, TIFF: from the header
            rotated = exif.get(0x0112, 1) in (5, 6, 7, 8)
            hw = (im.width, im.height) if rotated else (im.height, im.width)
            return hw, is_gray(im)
    except Image.DecompressionBombError as e:  # its size is the reason (serve and predict say so too)
        raise BadImageError(where, too_many_pixels(e)) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a file that is not an image
        raise BadImageError(where, f"not an image PIL can read ({type(e).__name__}: {e})") from None


def listing_cache(fingerprint: str, skip_bad: bool, cache_dir: str | None) -> Path | None:
    """Where ``list_images`` keeps the listing of the files ``fingerprint`` names."""
    key = hashlib.sha256(f"{fingerprint}|{skip_bad}".encode()).hexdigest()[:24]
    return Path(cache_dir) / f"listing-{key}.json" if cache_dir else None


def list_images(reader: Reader, items: dict[str, list[tuple[str, int]]], fingerprint: str, skip_bad: bool,
                cache_dir: str | None, progress: Callable | None = None) -> Listing:
    """Every image's header, read once and cached under the folder's fingerprint (a changed file reads again)."""
    cache = listing_cache(fingerprint, skip_bad, cache_dir)
    if cache is not None and cache.is_file():
        try:
            cached = Listing(**json.loads(cache.read_text()))
            if _lists(cached, items):
                return cached
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # unreadable, or not this folder's listing: listed again and rewritten
    names: dict[str, list[str]] = {}
    labels: dict[str, list[int]] = {}
    sizes: Counter = Counter()
    gray, skipped = True, []
    for split, lst in items.items():
        names[split], labels[split] = [], []
        for n, ci in (progress(lst, desc=f"listing {split}") if progress else lst):
            try:
                hw, g = header(reader.read(n), reader.where(n))
            except BadImageError:
                if not skip_bad:
                    raise
                skipped.append(n)
                continue
            names[split].append(n)
            labels[split].append(ci)
            sizes[f"{hw[0]}x{hw[1]}"] += 1
            gray = gray and g
    out = Listing(names, labels, dict(sizes), gray, skipped)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, lambda p: p.write_text(json.dumps(dataclasses.asdict(out))))
    return out


def _lists(listing: Listing, items: dict[str, list[tuple[str, int]]]) -> bool:
    """Whether a cached listing is the folder's: every file of every split, with its class, in order (less the ones
    it skipped), and a size counted for each. A cache that read but was cut short trained on 50 of 120 images; one
    with a label out of range gave a traceback."""
    skipped = set(listing.skipped)
    for split, lst in items.items():
        want = [(n, ci) for n, ci in lst if n not in skipped]
        if list(zip(listing.names.get(split, []), listing.labels.get(split, []))) != want or \
                len(listing.names.get(split, [])) != len(want) or len(listing.labels.get(split, [])) != len(want):
            return False
    if set(listing.names) != set(items):
        return False
    counts = list(listing.sizes.values())
    return (all(isinstance(c, int) and c > 0 for c in counts) and sum(counts) == sum(map(len, listing.names.values()))
            and all(re.fullmatch(r"[1-9]\d*x[1-9]\d*", k) for k in listing.sizes) and isinstance(listing.gray, bool))


def kept(listing: Listing, prep: Prepare) -> tuple[Prepare, int]:
    """``prep`` with the (H, W) every image is kept at (the crop's, the given size, else the most common size,
    scaled to fit the decode side), and the channels (1 when every image is gray, else 3)."""
    size = prep.size
    if size is None:
        common = listing.common_size()
        size = fit_within(common, prep.decode_side) or common
    return dataclasses.replace(prep, size=tuple(size)), 1 if listing.gray else 3


# ------------------------------------------------------------------------------------------ the streamed split
class StreamedImages(torch.utils.data.Dataset):
    """One split read from its files: ``len``, ``labels`` and ``shape`` as an in-memory ``ImageTensors`` has, and
    ``batches`` cut by DataLoader workers. ``workers`` is set by the planner (measured) or by ``--workers``."""

    def __init__(self, reader: Reader, names: list[str], labels: torch.Tensor, prep: Prepare, channels: int,
                 skip_bad: bool, workers: int = 1) -> None:
        self.reader, self.names, self.labels, self.prep = reader, list(names), labels, prep
        self.channels, self.skip_bad, self.workers = channels, skip_bad, workers
        self.undecodable: set[str] = set()  # listed, then did not decode in a worker (--skip-bad-images)
        # the training split's loader on a GPU, kept from epoch to epoch with its workers (``keep_workers``)
        self.keep_workers = False
        # JPEGs decoded by the workers (False), or in the main process on the device its batches go to (True:
        # device_decode.py)
        self.device_decode = False
        # the device's decode of the next batch on a thread while the step trains (None: on a GPU; _decoded_ahead)
        self.decode_ahead: bool | None = None
        self._kept: tuple[tuple[int, str, bool], torch.utils.data.DataLoader, "_Chunks"] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def identity(self) -> str:
        """Which images these are, as a resume checks it: their count and a digest of their names and labels (a
        file added to or deleted from a streamed folder changes every later batch)."""
        digest = hashlib.sha256(json.dumps([self.names, self.labels.tolist()]).encode()).hexdigest()[:16]
        return f"{len(self)} images, {digest}"

    @property
    def skipped_in_training(self) -> int:
        return len(self.undecodable)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        h, w = self.prep.size  # type: ignore[misc]
        return len(self.names), self.channels, h, w

    def subset(self, idx: torch.Tensor) -> "StreamedImages":
        return StreamedImages(self.reader, [self.names[i] for i in idx.tolist()], self.labels[idx], self.prep,
                              self.channels, self.skip_bad, self.workers)

    def __getitem__(self, i: int) -> tuple[torch.Tensor | None, int, str]:
        """(image or None, label, why it did not decode): a bad file is reported by the main process, in one line,
        instead of as a worker's traceback."""
        name = self.names[i]
        try:
            data = self.reader.read(name)
            if self.device_decode and (h := jpeg_header(data)) is not None:  # the device decodes it
                box = draw_box(self.prep.crop, self.prep.train, h[2])  # (drawn here: device_decode.draw_box)
                return (torch.frombuffer(bytearray(data), dtype=torch.uint8), h[0], self.reader.where(name), h[1],
                        box), int(self.labels[i]), ""
            a = self.prep.array(data, self.reader.where(name), self.channels)
        except BadImageError as e:
            return None, int(self.labels[i]), str(e)
        return torch.from_numpy(a), int(self.labels[i]), ""

    def take(self, idx: list[int] | torch.Tensor) -> torch.Tensor:
        """The uint8 images at ``idx``, decoded now."""
        return torch.cat([x for x, _ in self.batches(idx, 64, False, torch.device("cpu"))])

    def stats_sample(self) -> torch.Tensor:
        """Up to STATS_SAMPLE images spread over the split, for the mean and std."""
        return self.take(list(range(0, len(self), max(1, len(self) // STATS_SAMPLE)))[:STATS_SAMPLE])

    def loader(self, chunks: list[list[int]], device: torch.device, workers: int | None = None
               ) -> torch.utils.data.DataLoader:
        w = self.workers if workers is None else workers
        key = (w, device.type, self.device_decode)  # (what the workers return depends on where JPEGs decode)
        if self.keep_workers and w and self._kept is not None and self._kept[0] == key:
            self._kept[2].chunks = chunks  # the same workers, this epoch's batches
            return self._kept[1]
        sampler = _Chunks(chunks)
        # Workers are forked: they start at once and share the listing. (A fork server, what JAX's warning about
        # fork asks for where JAX is loaded, took ~2.5 s per loader: the suite's streaming tests went from 3 to 77 s.
        # A forked worker only decodes images and never touches JAX's threads or their locks.)
        loader = torch.utils.data.DataLoader(self, batch_sampler=sampler, num_workers=w, collate_fn=self.collate_fn(),
                                             pin_memory=device.type == "cuda", prefetch_factor=PREFETCH if w else None,
                                             timeout=WORKER_TIMEOUT_S if w else 0,
                                             persistent_workers=bool(self.keep_workers and w))
        if self.keep_workers and w:
            self._kept = (key, loader, sampler)
        return loader

    def __getstate__(self) -> dict[str, Any]:  # (a worker gets the split without the loader that forked it)
        return {**self.__dict__, "_kept": None}

    def collate_fn(self) -> Callable:
        """How the workers' items become one batch (a NaFlex split pads patches instead: data/naflex.py; with
        ``device_decode``, a list of images and JPEG bytes, decoded by ``_decode``)."""
        return functools.partial(_collate, stack=list) if self.device_decode else _collate

    def _passed_over(self, bad: list[str]) -> None:
        """Files that did not decode (``bad``: why, each naming its file): counted with --skip-bad-images, else
        the first named in the error."""
        if not self.skip_bad:
            raise ValueError(f"{bad[0]} (while streaming; --skip-bad-images passes over such files)")
        self.undecodable.update(bad)

    def _decode(self, items: list[Any], y: torch.Tensor, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``items`` (the workers' images and JPEG bytes) as one uint8 batch on ``device``, with their labels; a
        JPEG the device's decoder refuses is decoded as the workers would, and named if it is bad."""
        def fallback(data: bytes, where: str) -> torch.Tensor | None:
            try:
                return torch.from_numpy(self.prep.array(data, where, self.channels)).to(device)
            except BadImageError as e:
                self._passed_over([str(e)])
                return None

        imgs = decode_batch(items, self.channels, self.prep.crop, self.prep.size, self.prep.train, device, fallback,
                            self.prep.decode_side)
        keep = [i for i, t in enumerate(imgs) if t is not None]
        if not keep:
            return None, y[:0]
        return torch.stack([imgs[i] for i in keep]), y[keep] if len(keep) < len(imgs) else y

    def batches(self, indices: list[int] | torch.Tensor, batch_size: int, drop_last: bool, device: torch.device,
                workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(uint8 images, labels) on ``device`` for consecutive chunks of ``indices``, decoded by the workers."""
        idx = torch.as_tensor(indices, dtype=torch.int64).tolist()
        n = len(idx) - (len(idx) % batch_size if drop_last else 0)
        chunks = [idx[i:i + batch_size] for i in range(0, n, batch_size)]
        if not chunks:
            return
        if (self.workers if workers is None else workers):
            # the heap freed since the last step goes back to the kernel before the workers fork: a page shared with
            # a worker is copied the first time the training process writes to it again, and both copies count
            release_free_memory()
        try:
            read = self._read(self.loader(chunks, device, workers))
            if self.device_decode:  # the batch's JPEGs decoded and cut on the device, in one call
                ahead = device.type == "cuda" if self.decode_ahead is None else self.decode_ahead
                read = (self._decoded_ahead if ahead else self._decoded)(read, device)
            for x, y in read:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        except RuntimeError as e:
            if "DataLoader" not in str(e):
                raise
            raise ValueError(f"reading {self.reader.path}: {' '.join(str(e).split())[:300]} (a worker killed for "
                             "memory? fewer --workers, a smaller --batch-size, or --data-mode memory where it "
                             "fits)") from None


    def _read(self, loader: Iterable[tuple[Any, torch.Tensor, list[str]]]) -> Iterator[tuple[Any, torch.Tensor]]:
        """The workers' batches, the files that did not decode passed over (or named)."""
        for x, y, bad in loader:
            if bad:
                self._passed_over(bad)
            if x is not None:
                yield x, y

    def _decoded(self, read: Iterable[tuple[Any, torch.Tensor]], device: torch.device
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for items, y in read:
            x, y = self._decode(items, y, device)
            if x is not None:
                yield x, y

    def _decoded_ahead(self, read: Iterable[tuple[Any, torch.Tensor]], device: torch.device
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """As ``_decoded``, each batch decoded on a thread of its own while the step trains on the one before (issue
        80, N2: on the training thread a GPU's decode waited for the device twice a call and cut its photos one by
        one in Python, while the GPU idled). The decode draws nothing (the workers drew the crops: ``draw_box``), so
        the batches are the ones ``_decoded`` gives; the thread's kernels go to the device's default stream, as the
        step's do, in the order they were queued, and a batch is handed over only once its decode has returned."""
        def on_device() -> None:  # (a thread starts on the first GPU)
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device.index)

        with concurrent.futures.ThreadPoolExecutor(1, "vitkit-decode", on_device) as pool:
            pending = None
            for items, y in read:
                queued = pool.submit(self._decode, items, y, device)
                if pending is not None and (done := pending.result())[0] is not None:
                    yield done
                pending = queued
            if pending is not None and (done := pending.result())[0] is not None:
                yield done


class _Chunks:
    """A batch sampler whose batches are set anew each epoch: a kept loader's workers stay, its batches change (the
    main process hands the indices out as it iterates)."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


def _collate(items: list[tuple[Any, int, str]], stack: Callable[[list[Any]], Any] = torch.stack
             ) -> tuple[Any, torch.Tensor, list[str]]:
    """(batch of the decoded items, their labels, why the others did not decode); ``stack`` makes the batch."""
    good = [(x, y) for x, y, _ in items if x is not None]
    bad = [why for x, _, why in items if x is None]
    if not good:
        return None, torch.empty(0, dtype=torch.int64), bad
    return stack([x for x, _ in good]), torch.tensor([y for _, y in good], dtype=torch.int64), bad


# ------------------------------------------------------------------------------------------ how many workers
def worker_candidates(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the cores this process may run on (at least 2: one decodes while one waits on a file)."""
    cores = cores or len(os.sched_getaffinity(0))
    out, w = [], 1
    while w <= max(2, cores):
        out.append(w)
        w *= 2
    return out


def choose_workers(data: StreamedImages, batch_size: int, step: Callable[[torch.Tensor, torch.Tensor], None],
                   device: torch.device, candidates: list[int] | None = None, batches_each: int = 8,
                   clock: Callable[[], float] = time.perf_counter, seconds_each: float = 1.5
                   ) -> tuple[int, dict[int, float]]:
    """The worker count whose pipeline (workers decoding while the run's step trains) gives the most images per
    second, measured on the run's own step and files: the fewest within 5% of the fastest (each worker takes
    memory and, on a small machine, cores the step would use). A pipeline is timed in steady state: after the
    workers have started and the batches they had ready before the step ran were taken (``PREFETCH`` a worker:
    timed, they made 16 workers look twice as fast as they read), for ``batches_each`` batches or ``seconds_each``
    seconds, whichever comes first (at least 3 batches: a slow step made this 9 s of a 30-second budget). The counts
    are timed from the most down (``fewest_within``)."""
    n = len(data)

    def rate(w: int) -> float:
        warm = PREFETCH * w + 1  # the workers' start and what they had queued, outside the timing
        need = warm + batches_each
        idx = [i % n for i in range(need * batch_size)]
        it = data.batches(idx, batch_size, True, device, workers=w)
        for _ in range(warm):
            x, y = next(it)
            step(x, y)
        t0 = clock()
        seen = done = 0
        for x, y in it:
            step(x, y)
            seen, done = seen + len(y), done + 1
            if done >= 3 and clock() - t0 > seconds_each:
                break
        it.close()  # its workers end now, not while the next count's start (their memory beside theirs)
        return seen / max(clock() - t0, 1e-9)

    return fewest_within(candidates or worker_candidates(), rate)


WORKERS_WITHIN = 0.95  # the fewest workers within 5% of the fastest count's images per second


def fewest_within(candidates: list[int], rate: Callable[[int], float]) -> tuple[int, dict[int, float]]:
    """The fewest of ``candidates`` whose ``rate`` is within 5% of the best, timed from the most down and stopped at
    the first count below that: a count's pipeline reads no faster with fewer workers, and the fewest are the
    slowest to time (an H200 host's 1, 2, 4, 8, 16 workers: 223 ... 2,619 img/s, each count's warm-up and timed batches
    of 256 photos; ~30 s of an 80-s plan, results/gpu/h200-2026-12-04). Returns the count and the rates timed."""
    rates: dict[int, float] = {}
    for w in sorted(candidates, reverse=True):
        rates[w] = rate(w)
        if rates[w] < WORKERS_WITHIN * max(rates.values()):
            break
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= WORKERS_WITHIN * best), dict(sorted(rates.items()))
