"""An ImageFolder tree, or a zip of one, decoded into memory: ``train/<class>/*`` and ``val/`` or ``test/``.

Images are shrunk as they are read, files that operating systems leave beside photos are passed over, anything
unreadable is named, and the decoded tensors are cached under a key that changes whenever any file does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import statistics
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from ..runtime.memory import available_memory
from ..runtime.threads import usable_cores
from .images import BadImageError, crop_decode_side
from .splits import DataSplits, ImageTensors, load_cached, save_cached
from .stream import Listing, Prepare, Reader, StreamedImages, header, kept, list_images, listing_cache

MAX_IMAGE_BYTES = 512 * 1024 * 1024  # a 100-megapixel uncompressed RGB TIFF is 300 MB; a photo JPEG is a few MB
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


class _Source:
    """A folder or a zip file with the ImageFolder layout ``{train,val|test}/<class>/<image>``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.zip = zipfile.ZipFile(path) if path.is_file() else None
        except (zipfile.BadZipFile, EOFError) as e:  # truncated, or not a zip at all
            raise ValueError(f"{path}: not a readable zip of images (truncated, or not a zip: {e})") from None
        if self.zip is None and not path.is_dir():
            raise FileNotFoundError(f"{path}: no such folder or zip file")
        names = self.zip.namelist() if self.zip else _walk(path)
        self.reader = Reader(path, MAX_IMAGE_BYTES)
        self.files: dict[str, dict[str, list[str]]] = {}  # split -> class -> files
        self.dirs: dict[str, set[str]] = {}
        self.names: dict[str, str] = {}  # as split below (a zip written on Windows has backslashes) -> as stored
        roots: dict[str, set[str]] = {}  # the folder holding train/ val/ test/ -> the splits found there
        entries = []
        self.loose: list[tuple[str, str]] = []  # every image file, (name, stored), for a folder read without labels
        self.held_note = ""  # read without labels: which images were held out (unlabeled_items)
        for stored in sorted(names):
            n = stored.replace("\\", "/")
            parts = Path(n).parts
            if any(is_junk(p) for p in parts):
                continue
            if Path(n).suffix.lower() in IMAGE_EXTENSIONS and (self.zip is not None or _regular_file(path / n)):
                self.loose.append((n, stored))
            i = next((i for i, p in enumerate(parts[:-1]) if p in ("train", "val", "test")), None)
            if i is None:
                continue
            root = "/".join(parts[:i])
            roots.setdefault(root, set()).add(parts[i])
            entries.append((root, parts[i:], n, stored))
        with_train = sorted(r for r, splits in roots.items() if "train" in splits)
        if len(with_train) > 1:  # a nested copy, or two versions side by side: which one is meant?
            listed = ", ".join(f"{r or '.'}/ ({', '.join(sorted(roots[r]))})" for r in with_train)
            raise ValueError(f"{path}: {len(with_train)} folders hold a train/ split: {listed}; vitkit reads exactly "
                             "one (merging them would train on duplicates or on validation images). Point --data-dir "
                             "at one of them (unzip first for a zip)")
        self.root = with_train[0] if with_train else (sorted(roots)[0] if roots else "")
        deeper = []
        for root, rel, n, stored in entries:
            if root != self.root:
                continue
            split, cls = rel[0], rel[1]
            if len(rel) == 2:  # a class folder (a zip's directory entry, or a real folder)
                if self.zip is None and not (path / n).is_dir():
                    continue  # a stray file directly under train/
                self.dirs.setdefault(split, set()).add(cls)
            elif Path(n).suffix.lower() in IMAGE_EXTENSIONS:
                if len(rel) > 3:
                    deeper.append(n)
                    continue
                if self.zip is None and not _regular_file(path / n):
                    continue  # a FIFO or a device named x.jpg is no image: reading it waited for ever
                self.dirs.setdefault(split, set()).add(cls)
                self.files.setdefault(split, {}).setdefault(cls, []).append(n)
                self.names[n] = stored
        if deeper:
            raise ValueError(f"{path}: {len(deeper)} image(s) lie deeper than <split>/<class>/<image>, e.g. "
                             f"{deeper[0]}; vitkit reads the images directly inside each class folder (a sub-folder "
                             "is not a class): move them up, or make each sub-folder a class of its own")

    def where(self, name: str) -> str:
        return self.reader.where(name)

    def read(self, name: str) -> bytes:
        """The file's bytes; an entry too large to be an image, or a file that cannot be read (a symlink loop, a
        permission), is a BadImageError naming it, so --skip-bad-images can pass over it."""
        return self.reader.read(self.names.get(name, name))

    def fingerprint(self) -> str:
        """Changes whenever any image file does: every file's size and modification time (a zip's own, and each
        entry's CRC), so images overwritten in place under the same names are decoded again."""
        st = self.path.stat()
        if self.zip is not None:
            listing = [(i.filename, i.file_size, i.CRC) for i in self.zip.infolist()]
        else:
            listing = []
            for files in self.files.values():
                for names in files.values():
                    for n in names:
                        try:
                            f = (self.path / n).stat()
                            listing.append((n, f.st_size, f.st_mtime_ns))
                        except OSError:
                            listing.append((n, -1, -1))
        digest = hashlib.sha256(json.dumps(sorted(listing)).encode()).hexdigest()
        return f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{digest}"


def _regular_file(p: Path) -> bool:
    """A regular file (or a link to one); not a FIFO, socket or device, and not a broken link."""
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except OSError:
        return True  # unreadable: listed, and named by the reader (a permission, a link loop)


def _walk(path: Path) -> list[str]:
    """Every file and folder under ``path`` (relative, "/"-separated), following symlinked folders (a class folder
    linked in from elsewhere is a class), each real folder once (a link loop ends)."""
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        rel = Path(dirpath).relative_to(path)
        out += [str(rel / d) for d in dirnames] + [str(rel / f) for f in filenames]
    return [n[2:] if n.startswith("./") else n for n in out]


def is_junk(name: str) -> bool:
    """What operating systems leave beside photos: macOS's __MACOSX/ and ._* AppleDouble files, .DS_Store,
    Windows' Thumbs.db and desktop.ini, and any other hidden file or folder."""
    return name.startswith(".") or name in ("__MACOSX", "Thumbs.db", "desktop.ini")


DECODE_PEAK = 1.1  # peak memory of a decode into memory over the decoded size: the images go straight into one
# preallocated tensor, so 55,000 photos kept at 96x128x3 (1.89 GiB) peaked 1.95 GiB above the process before it (the
# decoded PIL images, their arrays and a stacked copy took 3.6x before: 1.87 GB decoded peaked at 6.73 GB)


def estimate_decoded(reader: Reader, names: list[str], prep: Prepare, sample: int = 256
                     ) -> tuple[tuple[int, tuple[int, int], int], float]:
    """(images, (H, W) kept, channels) of ``names`` before decoding them, from the headers of up to ``sample`` files
    spread over them (stream.header: no pixel decoded), kept by the listing's own rule (stream.kept); and the
    seconds listing every header would take at the pace these were read, once the reader is open."""
    sizes: Counter = Counter()
    gray = True
    picked = names[::max(1, len(names) // sample)][:sample]
    _warm(reader, picked, lambda data, where: header(data, where))
    each = []
    for n in picked:
        started = time.perf_counter()
        try:
            hw, g = header(reader.read(n), reader.where(n))
        except BadImageError:  # named when it is listed or decoded; here it only counts for less
            continue
        finally:
            each.append(time.perf_counter() - started)
        sizes[f"{hw[0]}x{hw[1]}"] += 1
        gray = gray and g
    listing_s = statistics.median(each) * len(names) if each else 0.0
    if not sizes and prep.size is None:  # nothing read: the largest the decode side allows
        return (len(names), (prep.decode_side, prep.decode_side), 1 if gray else 3), listing_s
    prep, channels = kept(Listing({}, {}, dict(sizes), gray, []), prep)
    return (len(names), prep.size, channels), listing_s  # type: ignore[return-value]


def _warm(reader: Reader, picked: list[str], use: Callable[[bytes, str], Any]) -> None:
    """One file read and used, untimed, before a timed sample: the first read opens a zip (its central directory:
    0.39 s for CIFAR-10's 60,000 members) and imports PIL's plugins, and counted once in 256 it made that zip's
    ~2.5 s listing "~97 s", so a 1-minute run refused it and a 5-minute one streamed it."""
    for n in picked[:1]:
        try:
            use(reader.read(n), reader.where(n))
        except BadImageError:
            pass


DECODE_SAMPLE = 32  # images decoded to time a decode into memory, at most (the headers' sample is 256: cheap) ...
DECODE_SAMPLE_S = 0.5  # ... or fewer, once this many seconds of decoding have passed (large photos)
DECODE_SHARE = 1 / 3  # under --time-limit, --data-mode auto streams a dataset whose decode into memory would take
# more than this share of the budget: a 1-minute run on 16,356 photos spent 40 s decoding them and was then refused,
# where streamed it decodes only what its steps read (in workers, beside the step)


def decode_seconds(reader: Reader, names: list[str], prep: Prepare, size: tuple[int, int], channels: int) -> float:
    """Seconds decoding all of ``names`` into memory would take, timed on up to ``DECODE_SAMPLE`` of them spread
    over the list after one untimed (an unreadable one counts its failed read). Eight of them, the first one's
    plugin import included, said 18-90 s for CIFAR-10's 60,000 32x32 JPEGs, whose decode takes 8.2 s in one process."""
    picked = names[::max(1, len(names) // DECODE_SAMPLE)][:DECODE_SAMPLE]
    p = dataclasses.replace(prep, size=size)
    _warm(reader, picked, lambda data, where: p.array(data, where, channels))
    started, each = time.perf_counter(), []
    for n in picked:
        t = time.perf_counter()
        try:
            p.array(reader.read(n), reader.where(n), channels)
        except BadImageError:
            pass
        each.append(time.perf_counter() - t)
        if time.perf_counter() - started > DECODE_SAMPLE_S:
            break
    # the median image: the mean of 32 took one pause of the process for a third of the decode (CIFAR-10: "~30 s",
    # where 9-11 s is its estimate on a quiet process)
    procs = usable_cores() if len(names) >= PARALLEL_FROM else 1  # (decode_chunks: a process a core)
    return statistics.median(each) * len(names) / procs if each else 0.0


def mode_within_budget(path: str, mode: str, auto: bool, budget_s: float, listing_s: float,
                       decode_s: Callable[[], float], images: int, say: Callable[[str], None]) -> str:
    """The data mode a ``--time-limit`` leaving ``budget_s`` seconds allows, judged before a header is listed or a
    pixel decoded (``listing_s``: 0 for a cached listing; ``decode_s``: the decode into memory, timed when asked,
    0 for a cached one): --data-mode auto streams data whose decode would take more than ``DECODE_SHARE`` of what
    the listing leaves (a cold zip's listing counted against the decode streamed CIFAR-10 at 1 minute: issue 79);
    data that cannot be listed (and, in memory, decoded) within it is refused now, not after."""
    if mode == "memory" and (decode := decode_s()) > 0:
        # (the listing is paid either way: streamed files are listed too; only the decode is memory's own)
        if auto and decode > DECODE_SHARE * (budget_s - listing_s):
            after = f" after listing them (~{listing_s:.0f} s)" if listing_s >= 0.5 else ""
            say(f"{path}: decoding {images:,} images into memory would take ~{decode:.0f} s of the "
                f"~{budget_s - listing_s:.0f} s the --time-limit leaves{after} (timed on a few): streamed from the "
                "files instead, each decoded as a step reads it (--data-mode memory to decode them anyway)")
            mode = "stream"
        elif listing_s + decode >= budget_s:
            raise ValueError(f"{path}: listing and decoding {images:,} images into memory would take ~"
                             f"{listing_s + decode:.0f} s (timed on a few), more than the ~{budget_s:.0f} s the "
                             f"--time-limit leaves; nothing was decoded. Give --time-limit "
                             f"{_at_least(listing_s + decode):g} or more, or --data-mode stream (each image decoded "
                             "as a step reads it)")
    if mode == "stream" and listing_s >= budget_s:
        raise ValueError(f"{path}: listing the headers of {images:,} images would take ~{listing_s:.0f} s (timed on "
                         f"a few), more than the ~{budget_s:.0f} s the --time-limit leaves; nothing was decoded. Give "
                         f"--time-limit {_at_least(listing_s):g} or more (the listing is cached for the next run)")
    return mode


SHORTEST_RUN_S = 15.0  # beside reading the data: planning, the steps a schedule is fitted from and an evaluation


def _at_least(data_s: float) -> float:
    """The shortest --time-limit, in minutes to 0.01, whose usable seconds (training/budget.usable_seconds: 99% less
    2 s) hold ``data_s`` seconds of reading the data and the shortest run after it."""
    return math.ceil((data_s + SHORTEST_RUN_S + 2) / 0.99 / 60 * 100) / 100


DATA_MODES = ("auto", "memory", "stream")


def memory_need(images: int, hw: tuple[int, int], channels: int) -> tuple[int, int]:
    """(decoded bytes, the peak a decode into memory, or a read of its cache, reaches)."""
    decoded = images * hw[0] * hw[1] * channels
    return decoded, int(decoded * DECODE_PEAK)


RUN_BYTES = 384 * 2 ** 20  # what the smallest run needs beside its data (a step, Python's heap): a forced
# --data-mode memory whose decode peak (825 MiB) fitted the 1.0 GiB a 1.5 GiB container left was killed decoding
AUTO_SHARE = 0.5  # of the memory the process may use, what data in memory may take under --data-mode auto: the
# rest is the run's own (a 2-core CPU run's step took ~600 MB beside torch's ~800 MB; workers, the page cache)


def fits_in_memory(path: str, images: int, hw: tuple[int, int], channels: int, share: float = 1.0
                   ) -> tuple[bool, str]:
    """Whether a decode into memory fits in ``share`` of the memory this process may use (its container's limit
    where it has one), and the sentence with the numbers."""
    decoded, peak = memory_need(images, hw, channels)
    mem = available_memory()
    gib = 2 ** 30
    what = (f"{path}: {images:,} images kept at {hw[0]}x{hw[1]}x{channels} are {decoded / gib:.2f} GiB decoded, "
            f"~{peak / gib:.2f} GiB at the decode's peak")
    if mem is None:  # not Linux: nothing to go by
        return True, what
    return peak <= min(share * mem.available, mem.available - RUN_BYTES), \
        f"{what}; this process may use {mem.describe()}" + (
            f", and data in memory at most {share:.0%} of it" if share < 1 else f", {RUN_BYTES >> 20} MiB of it the "
                                                                                "run's own at least")


def check_fits_in_memory(path: str, images: int, hw: tuple[int, int], channels: int) -> None:
    """Refuse, before a pixel is decoded, a folder whose decode would not fit in the memory this process may use:
    the kernel's out-of-memory kill at 43% of "decoding train" (exit 137, no message) was the alternative."""
    ok, what = fits_in_memory(path, images, hw, channels)
    if not ok:
        raise ValueError(f"{what}; nothing was decoded. Stream it from the files (--data-mode stream, the choice of "
                         "--data-mode auto), keep the photos smaller (--folder-max-side N, a smaller --img-size), or "
                         "give the process more memory")


UNLABELED_VAL = 20  # a folder without splits, read for self-supervision: every 20th image (5%) is held out
UNLABELED_VAL_MAX = 2000  # ... at most this many (the validation loss of an objective, not a test of a classifier)


def folder_items(path: str, unlabeled: bool = False) -> tuple[_Source, list[str], dict[str, list[tuple[str, int]]]]:
    """A folder's (or zip's) layout checked: the source, its classes, and split -> [(stored name, class index)]
    (train first, then val/ or test/). ``unlabeled`` (self-supervision, which reads no label): a folder without
    train/ is every image in it, at any depth, one class "images", every ``UNLABELED_VAL``-th held out (a
    folder with train/ is read as always, its labels unread)."""
    src = _Source(Path(path))
    if unlabeled and "train" not in src.dirs:
        return unlabeled_items(src, path, held_out_splits(src))
    if "train" not in src.dirs:
        raise FileNotFoundError(f"{path}: expected {path}/train/<class>/<image> (and val/ or test/); found splits "
                                f"{sorted(src.dirs) or 'none'}" + (f" under {src.root}/" if src.root else ""))
    val_split = "val" if "val" in src.dirs else "test" if "test" in src.dirs else None
    if val_split is None:
        raise FileNotFoundError(f"{path}: found train/ but neither val/ nor test/")
    classes = sorted(src.dirs["train"])
    for split in ("train", val_split):
        for c in sorted(src.dirs[split]):
            if not src.files.get(split, {}).get(c):
                raise ValueError(f"{path}: class folder {split}/{c} has no images")
    if set(src.dirs[val_split]) != set(classes):
        only_t = sorted(set(classes) - set(src.dirs[val_split]))
        only_v = sorted(set(src.dirs[val_split]) - set(classes))
        raise ValueError(f"{path}: classes differ between train/ and {val_split}/: only in train {only_t}, "
                         f"only in {val_split} {only_v}")
    items = {s: [(src.names[n], ci) for ci, c in enumerate(classes) for n in src.files[s][c]]
             for s in ("train", val_split)}
    return src, classes, items


def held_out_splits(src: _Source) -> dict[str, list[tuple[str, str]]]:
    """The images under a val/ or test/ folder (at the layout's root), by split: a folder read without labels whose
    train/ holds loose images and whose test/<class>/ is labelled was read as one flat folder, and its test images
    were pre-trained on (issue 81, S1)."""
    depth = len(Path(src.root).parts) if src.root else 0
    held: dict[str, list[tuple[str, str]]] = {}
    for n, stored in src.loose:
        parts = Path(n).parts
        if len(parts) > depth + 1 and parts[depth] in ("val", "test") and \
                "/".join(parts[:depth]) == (src.root or ""):
            held.setdefault(parts[depth], []).append((n, stored))
    return held


def unlabeled_items(src: _Source, path: str, held: dict[str, list[tuple[str, str]]] | None = None
                    ) -> tuple[_Source, list[str], dict[str, list[tuple[str, int]]]]:
    """A folder of images without classes: every image, in name order, as the class "images"; every
    ``UNLABELED_VAL``-th of them (at most ``UNLABELED_VAL_MAX``) the validation split. ``held``: the images under
    val/ or test/ folders (held_out_splits): never trained on; val/'s (else test/'s) are the validation split."""
    if held:
        out = {n for images in held.values() for n, _ in images}
        train = [(n, stored) for n, stored in src.loose if n not in out]
        if not train:
            raise ValueError(f"{path}: every image is under {' or '.join(f'{k}/' for k in sorted(held))}, a split "
                             "held out; pre-training reads train/ (or a folder without splits): point --data-dir at "
                             "the training images")
        val = held.get("val") or held["test"]
        src.files = {"train": {"images": [n for n, _ in train]}, "val": {"images": [n for n, _ in val]}}
        src.names = {**dict(train), **dict(val)}
        src.held_note = (f"{len(train):,} images outside {' and '.join(f'{k}/' for k in sorted(held))} trained on; "
                         f"{'val' if held.get('val') else 'test'}/'s {len(val):,} validate" +
                         (f", test/'s {len(held['test']):,} are not read" if held.get("val") and held.get("test")
                          else ""))
        items = {s: [(src.names[n], 0) for n in src.files[s]["images"]] for s in ("train", "val")}
        return src, ["images"], items
    if not src.loose:
        raise ValueError(f"{path}: no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) in it or below it")
    if len(src.loose) < 2:
        raise ValueError(f"{path}: one image; self-supervised training needs a few to learn from and one to hold out")
    val = {i for i in range(0, len(src.loose), UNLABELED_VAL)}
    val = set(sorted(val)[:UNLABELED_VAL_MAX])
    src.files = {"train": {"images": [n for i, (n, _) in enumerate(src.loose) if i not in val]},
                 "val": {"images": [n for i, (n, _) in enumerate(src.loose) if i in val]}}
    src.names = dict(src.loose)
    items = {s: [(src.names[n], 0) for n in src.files[s]["images"]] for s in ("train", "val")}
    return src, ["images"], items


def load_folder_splits(path: str, skip_bad_images: bool = False, size: tuple[int, int] | None = None,
                       cache_dir: str | None = None, progress: Callable | None = None,
                       max_side: int = 128, crop: dict[str, Any] | None = None, mode: str = "auto",
                       say: Callable[[str], None] | None = None, unlabeled: bool = False,
                       budget_s: float | None = None) -> DataSplits:
    """An ImageFolder tree (or a zip of one) as uint8 images all at one size (``size``, else the most common size,
    scaled down to at most ``max_side`` pixels): decoded into memory (cached under ``cache_dir`` by fingerprint), or
    streamed from the files (``mode``: ``auto`` streams what would not fit in the memory this process may use).

    ``crop`` (``images.crop_spec``: pretrained weights' own resize + centre crop) prepares every image as predict and
    serve prepare it for that model, instead of squashing it to the common size: one preprocessing per model."""
    src, classes, items = folder_items(path, unlabeled)
    splits = load_images(path, src.reader, items, classes, src.fingerprint(), skip_bad_images, size, cache_dir,
                         progress, max_side, crop, mode, say, budget_s=budget_s)
    if unlabeled and "train" not in src.dirs:  # (the share held out was not said, nor how to choose another)
        flat = src.held_note or (f"every {UNLABELED_VAL}th image set aside to validate (--holdout SHARE: a share "
                                 "of your choosing)")
        splits = dataclasses.replace(splits, how=", ".join(filter(None, [splits.how, flat])))
    return splits


def load_images(path: str, reader: Reader, items: dict[str, list[tuple[str, int]]], classes: list[str],
                fingerprint: str, skip_bad_images: bool = False, size: tuple[int, int] | None = None,
                cache_dir: str | None = None, progress: Callable | None = None, max_side: int = 128,
                crop: dict[str, Any] | None = None, mode: str = "auto",
                say: Callable[[str], None] | None = None, kind: str = "folder",
                budget_s: float | None = None) -> DataSplits:
    """The images ``items`` names (split -> [(name, class index)], train first), ``reader`` reads (a folder, a zip,
    WebDataset shards, a Hugging Face dataset): decoded into memory, or streamed, as ``mode`` says or (``auto``) the
    memory this process may use allows, and the ``budget_s`` seconds a --time-limit leaves (mode_within_budget).
    ``fingerprint`` changes whenever any image does (the caches' key)."""
    if mode not in DATA_MODES:
        raise ValueError(f"data_mode must be one of {DATA_MODES}, got {mode!r}")
    say = say or (lambda s: None)
    if crop is not None:
        size, max_side = tuple(crop["img_size"]), crop_decode_side(crop)
    prep = Prepare(tuple(size) if size else None, max_side if crop or not size else max(size), crop)
    key = hashlib.sha256(f"{fingerprint}|{size}|{max_side}|{skip_bad_images}|"
                         f"{json.dumps(crop, sort_keys=True)}".encode()).hexdigest()[:24]
    cache = Path(cache_dir) / f"folder-{key}.safetensors" if cache_dir else None
    names = [n for lst in items.values() for n, _ in lst]
    estimate, listing_s = estimate_decoded(reader, names, prep)
    auto = mode == "auto"
    if crop is not None and "train_area" in crop:  # a new random crop of every training image each epoch
        if mode == "memory":
            raise ValueError(f"{path}: inception_crop cuts each training photo anew as it is read, so its files are "
                             "streamed: --data-mode stream or auto, not memory")
        if mode == "auto":
            say(f"{path}: streamed from the files (inception_crop cuts each training image anew every epoch)")
        mode = "stream"
    if mode == "memory":
        check_fits_in_memory(path, *estimate)
    elif mode == "auto":
        ok, what = fits_in_memory(path, *estimate, share=AUTO_SHARE)
        mode = "memory" if ok else "stream"
        say(f"{what}: " + ("in memory" if ok else "streamed from the files (--data-mode memory to decode it "
                                                   "anyway)"))
    if budget_s is not None:
        listing = listing_cache(fingerprint, skip_bad_images, cache_dir)
        listed = listing is not None and listing.is_file()
        decoded = cache is not None and cache.is_file()
        mode = mode_within_budget(path, mode, auto, budget_s, 0.0 if listed else listing_s,
                                  lambda: 0.0 if decoded else decode_seconds(reader, names, prep, *estimate[1:]),
                                  estimate[0], say)
    if mode == "memory" and (hit := load_cached(cache, "classes", "skipped")) is not None:  # decoded before
        data = DataSplits(path, hit[0], hit[1], hit[2]["classes"], hit[2]["skipped"])
    else:  # every header read once (cached): the size and channels every image is kept at, in both modes
        listing = list_images(reader, items, fingerprint, skip_bad_images, cache_dir, progress)
        if not any(listing.names.values()):
            raise ValueError(f"{path}: no decodable images")
        prep, channels = kept(listing, prep)
        if mode == "stream":
            data = _streamed(path, reader, listing, classes, prep, channels, skip_bad_images)
        else:
            data = _decoded(path, reader, listing, classes, prep, channels, skip_bad_images, cache, progress)
    data.name = f"{kind}:{path}"  # "folder:photos.zip", "shards:shards/", "hf:user/name"
    return data


def _streamed(path: str, reader: Reader, listing: Listing, classes: list[str], prep: Prepare, channels: int,
              skip_bad_images: bool) -> DataSplits:
    """The splits read from their files as the run goes (data/stream.py), each image prepared as ``_decoded``
    prepares it."""
    splits = [StreamedImages(reader, listing.names[s], torch.tensor(listing.labels[s], dtype=torch.int64),
                             dataclasses.replace(prep, train=s == "train"), channels, skip_bad_images)
              for s in listing.names]
    h, w = prep.size  # type: ignore[misc]
    return DataSplits(path, splits[0], splits[1], classes, len(listing.skipped),
                      how=f"streamed from the files at {h}x{w}x{channels}")


def _decoded(path: str, reader: Reader, listing: Listing, classes: list[str], prep: Prepare, channels: int,
             skip_bad_images: bool, cache: Path | None, progress: Callable | None) -> DataSplits:
    """Every image decoded straight into one preallocated uint8 tensor per split (its size and channels known
    from the headers first), kept in ``cache``: the decode peaks at the tensors' size, not at the decoded images,
    their arrays and a stacked copy (3.6x) as it did before. Many images are decoded by one process a core
    (``decode_chunks``)."""
    skipped = len(listing.skipped)
    tensors = []
    for s, names in listing.names.items():
        labels = listing.labels[s]
        x = torch.empty((len(names), channels, *prep.size), dtype=torch.uint8)  # type: ignore[misc]
        keep: list[int] = []
        for start, arrays, bad in decode_chunks(reader, names, prep, channels, progress, f"decoding {s}"):
            for i, a in enumerate(arrays):  # each image shrunk to fit the decode side as it was read
                n = start + i
                if n in bad:
                    if not skip_bad_images:
                        raise BadImageError(*bad[n])
                    skipped += 1
                    continue
                x[len(keep)] = torch.from_numpy(a)
                keep.append(labels[n])
        tensors.append(ImageTensors(x[:len(keep)].clone() if len(keep) < len(names) else x,
                                    torch.tensor(keep, dtype=torch.int64)))
    save_cached(cache, tensors[0], tensors[1], {"classes": classes, "skipped": skipped})
    return DataSplits(path, tensors[0], tensors[1], classes, skipped)


CHUNK = 1024  # images a decoding process returns at a time
PARALLEL_FROM = 8192  # images from which a split is decoded by a process a core: CIFAR-10's 60,000 32x32 JPEGs took
# 8.2 s in one on a 2-core Xeon with AMX, a seventh of a 1-minute budget (forking costs ~0.1 s: not for a few)


def decode_chunks(reader: Reader, names: list[str], prep: Prepare, channels: int, progress: Callable | None,
                  desc: str):  # type: ignore[no-untyped-def]
    """(first index, arrays, {index: (file, reason)} of those that did not decode) for ``CHUNK`` images at a time,
    in order; from a process a core where there are ``PARALLEL_FROM`` or more (forked: each opens the zip anew,
    and decodes with PIL and NumPy alone, no torch: OpenMP's threads do not survive a fork)."""
    chunks = [(i, names[i:i + CHUNK]) for i in range(0, len(names), CHUNK)]
    bar = progress(total=len(names), desc=desc) if progress else None
    procs = min(usable_cores(), len(chunks)) if len(names) >= PARALLEL_FROM else 1
    global _JOB
    _JOB = (reader, prep, channels)  # the processes forked below inherit it (sent with each chunk, the reader
    try:  # opened the zip anew for every one: 0.39 s each, 18 s for CIFAR-10 where one process took 12)
        import multiprocessing as mp  # (a pool only for large decodes)

        with mp.get_context("fork").Pool(procs) if procs > 1 else contextlib.nullcontext() as pool:
            for done in pool.imap(_decode_chunk, chunks) if pool is not None else map(_decode_chunk, chunks):
                if bar:
                    bar.update(len(done[1]))
                yield done
    finally:
        _JOB = None
        if bar:
            bar.close()


_JOB: tuple[Reader, Prepare, int] | None = None  # (reader, prep, channels) of the decode in progress


def _decode_chunk(chunk: tuple[int, list[str]]) -> tuple[int, list[Any], dict[int, tuple[str, str]]]:
    assert _JOB is not None
    reader, prep, channels = _JOB
    start, names = chunk
    arrays: list[Any] = []
    bad: dict[int, tuple[str, str]] = {}
    for i, n in enumerate(names):
        try:
            arrays.append(prep.array(reader.read(n), reader.where(n), channels))
        except BadImageError as e:  # (passed back as its parts: its own constructor takes two)
            bad[start + i] = (e.path, str(e).removeprefix(f"cannot decode image {e.path}: "))
            arrays.append(None)
    return start, arrays, bad
