"""An ImageFolder tree, or a zip of one, decoded into memory: ``train/<class>/*`` and ``val/`` or ``test/``.

Images are shrunk as they are read, files that operating systems leave beside photos are passed over, anything
unreadable is named, and the decoded tensors are cached under a key that changes whenever any file does.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from ..runtime.memory import available_memory
from .images import BadImageError, crop_decode_side, decode_within, fit_within, is_gray, resize_and_crop, to_array
from .splits import DataSplits, ImageTensors, load_cached, save_cached

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
        self.files: dict[str, dict[str, list[str]]] = {}  # split -> class -> files
        self.dirs: dict[str, set[str]] = {}
        self.names: dict[str, str] = {}  # as split below (a zip written on Windows has backslashes) -> as stored
        roots: dict[str, set[str]] = {}  # the folder holding train/ val/ test/ -> the splits found there
        entries = []
        for stored in sorted(names):
            n = stored.replace("\\", "/")
            parts = Path(n).parts
            if any(is_junk(p) for p in parts):
                continue
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
                self.dirs.setdefault(split, set()).add(cls)
                self.files.setdefault(split, {}).setdefault(cls, []).append(n)
                self.names[n] = stored
        if deeper:
            raise ValueError(f"{path}: {len(deeper)} image(s) lie deeper than <split>/<class>/<image>, e.g. "
                             f"{deeper[0]}; vitkit reads the images directly inside each class folder (a sub-folder "
                             "is not a class): move them up, or make each sub-folder a class of its own")

    def where(self, name: str) -> str:
        return f"{self.path}/{name}" if self.zip else str(self.path / name)

    def read(self, name: str) -> bytes:
        """The file's bytes; an entry too large to be an image, or a file that cannot be read (a symlink loop, a
        permission), is a BadImageError naming it, so --skip-bad-images can pass over it."""
        try:
            size = self.zip.getinfo(self.names.get(name, name)).file_size if self.zip else \
                (self.path / name).stat().st_size
            if size > MAX_IMAGE_BYTES:  # known before a byte is inflated: a zip bomb is refused at once
                raise BadImageError(self.where(name), f"{size:,} bytes, more than the {MAX_IMAGE_BYTES:,} an image "
                                                      "file may have")
            return self.zip.read(self.names.get(name, name)) if self.zip else (self.path / name).read_bytes()
        except (OSError, zipfile.BadZipFile) as e:
            raise BadImageError(self.where(name), f"cannot read it ({type(e).__name__}: {e})") from None

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


FIRST_DECODE_PEAK = 3.6  # peak memory of a first decode over its decoded size: 12,000 JPEGs kept at 224 px, 1.87 GB
# decoded, peaked at 6.73 GB RSS (the decoded images, their stacked copy, the cache written); a cached one ~1.1x


def estimate_decoded(src: _Source, splits: tuple[str, ...], size: tuple[int, int] | None, max_side: int,
                     crop: dict[str, Any] | None, sample: int = 256) -> tuple[int, tuple[int, int], int]:
    """(images, (H, W) kept, channels) of a folder before decoding it, from the headers of up to ``sample`` files
    spread over it (PIL reads a header without decoding the pixels)."""
    names = [n for s in splits for c in sorted(src.files.get(s, {})) for n in src.files[s][c]]
    step = max(1, len(names) // sample)
    sizes: Counter = Counter()
    gray = True
    for n in names[::step][:sample]:
        try:
            with Image.open(io.BytesIO(src.read(n))) as im:
                sizes[(im.height, im.width)] += 1
                gray = gray and im.mode in ("1", "L", "LA", "I", "I;16", "F")
        except Exception:  # noqa: BLE001 - a bad file is named when it is decoded; here it only counts for less
            continue
    if crop is not None:
        kept = tuple(crop["img_size"])
    elif size is not None:
        kept = tuple(size)
    else:
        common = sizes.most_common(1)[0][0] if sizes else (max_side, max_side)
        kept = fit_within(common, max_side) or common
    return len(names), kept, 1 if gray else 3


def check_fits_in_memory(path: str, images: int, kept: tuple[int, int], channels: int) -> None:
    """Refuse, before a pixel is decoded, a folder whose first decode would not fit in the memory this process may
    use (its container's limit where it has one): the kernel's out-of-memory kill at 43% of "decoding train" (exit
    137, no message) was the alternative."""
    decoded = images * kept[0] * kept[1] * channels
    mem = available_memory()
    if mem is None or decoded * FIRST_DECODE_PEAK <= mem.available:  # (None: not Linux, nothing to go by)
        return
    gib, peak = 2 ** 30, decoded * FIRST_DECODE_PEAK
    raise ValueError(f"{path}: {images:,} images kept at {kept[0]}x{kept[1]}x{channels} are {decoded / gib:.2f} GiB "
                     f"decoded, and a first decode peaks at ~{FIRST_DECODE_PEAK:g}x that (~{peak / gib:.1f} GiB), "
                     f"more than this process may use ({mem.describe()}); nothing was decoded. Keep the "
                     "photos smaller (--folder-max-side N, a smaller --img-size), or give the process more memory")


def load_folder_splits(path: str, skip_bad_images: bool = False, size: tuple[int, int] | None = None,
                       cache_dir: str | None = None, progress: Callable | None = None,
                       max_side: int = 128, crop: dict[str, Any] | None = None) -> DataSplits:
    """Decode an ImageFolder tree (or a zip of one) into memory as uint8, all at one size (``size``, else the most
    common size, scaled down to at most ``max_side`` pixels); cached under ``cache_dir`` by fingerprint.

    ``crop`` (``images.crop_spec``: pretrained weights' own resize + centre crop) decodes every image as predict and
    serve prepare it for that model, instead of squashing it to the common size: one preprocessing per model."""
    src = _Source(Path(path))
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
    if crop is not None:
        size, max_side = tuple(crop["img_size"]), crop_decode_side(crop)
    key = hashlib.sha256(f"{src.fingerprint()}|{size}|{max_side}|{skip_bad_images}|"
                         f"{json.dumps(crop, sort_keys=True)}".encode()).hexdigest()[:24]
    cache = Path(cache_dir) / f"folder-{key}.safetensors" if cache_dir else None
    if (hit := load_cached(cache, "classes", "skipped")) is not None:
        return DataSplits(f"folder:{path}", hit[0], hit[1], hit[2]["classes"], hit[2]["skipped"])
    check_fits_in_memory(path, *estimate_decoded(src, ("train", val_split), size, max_side, crop))
    items = {s: [(n, ci) for ci, c in enumerate(classes) for n in src.files[s][c]] for s in ("train", val_split)}
    decoded: dict[str, list] = {}
    full_sizes: Counter = Counter()
    skipped = 0
    for s, lst in items.items():
        imgs = []
        for n, ci in (progress(lst, desc=f"decoding {s}") if progress else lst):
            try:  # each image shrunk to fit max_side as it is read: memory is bounded by the result's size
                img, full = decode_within(src.read(n), src.where(n),
                                          max_side=max_side if crop else max(size) if size else max_side)
            except BadImageError:
                if not skip_bad_images:
                    raise
                skipped += 1
                continue
            if crop is not None:  # the gray test needs the image as stored; the crop keeps the channel count
                gray = is_gray(img)
                img = resize_and_crop(crop, 1 if gray else 3)(img)
            imgs.append((img, ci))
            full_sizes[full] += 1
        decoded[s] = imgs
    every = decoded["train"] + decoded[val_split]
    if not every:
        raise ValueError(f"{path}: no decodable images")
    channels = 1 if all(is_gray(im) for im, _ in every) else 3
    if size is None:  # the most common size wins; the others are resized to it
        size = full_sizes.most_common(1)[0][0]
        size = fit_within(size, max_side) or size  # large photos are kept in memory at a training-friendly size
    tensors = []
    for s in ("train", val_split):
        x = torch.from_numpy(np.stack([to_array(im, channels, size) for im, _ in decoded[s]]))
        y = torch.tensor([ci for _, ci in decoded[s]], dtype=torch.int64)
        tensors.append(ImageTensors(x, y))
    save_cached(cache, tensors[0], tensors[1], {"classes": classes, "skipped": skipped})
    return DataSplits(f"folder:{path}", tensors[0], tensors[1], classes, skipped)
