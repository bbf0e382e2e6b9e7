"""Datasets as uint8 tensors in memory: decoded once, cached, then augmented in batches on the device.

Every loader returns :class:`DataSplits` (train + val) of :class:`ImageTensors`.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torchvision
from safetensors.torch import load_file, save_file

from ..model.serialization import atomic_write
from .images import BadImageError, is_gray, open_image, to_array

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "folder", "fake")
FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


@dataclass
class ImageTensors:
    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4 or len(self.images) != len(self.labels):
            raise ValueError(f"images must be uint8 (N, C, H, W) matching labels (N,); got {self.images.dtype} "
                             f"{tuple(self.images.shape)} and {tuple(self.labels.shape)}")


@dataclass
class DataSplits:
    name: str
    train: ImageTensors
    val: ImageTensors
    classes: list[str]
    skipped: int = 0  # bad images skipped with --skip-bad-images

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_chans(self) -> int:
        return self.train.images.shape[1]

    @property
    def img_size(self) -> tuple[int, int]:
        return tuple(self.train.images.shape[2:])  # type: ignore[return-value]

    def mean_std(self) -> tuple[list[float], list[float]]:
        x = self.train.images[:20000].float().div_(255)
        return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()

    def describe(self) -> str:
        h, w = self.img_size
        return (f"{self.name}: {len(self.train)} train / {len(self.val)} val images, {h}x{w}x{self.in_chans}, "
                f"{self.num_classes} classes" + (f", {self.skipped} bad images skipped" if self.skipped else ""))


# --------------------------------------------------------------------------------------------- digits
def load_digits_splits(val_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """scikit-learn's 1,797 real 8x8 handwritten digits (values 0-16), a fixed stratified split."""
    from sklearn.datasets import load_digits  # scikit-learn's import (≈1 s) only for the digits
    from sklearn.model_selection import train_test_split  # (the same)

    d = load_digits()
    x = torch.from_numpy(np.round(d.images * (255 / 16)).astype(np.uint8))[:, None]  # n h w -> n 1 h w
    y = torch.from_numpy(d.target.astype(np.int64))
    tr, va = train_test_split(np.arange(len(y)), test_size=val_fraction, random_state=seed, stratify=d.target)
    return DataSplits("digits", ImageTensors(x[tr], y[tr]), ImageTensors(x[va], y[va]), [str(i) for i in range(10)])


# --------------------------------------------------------------------------------------------- IDX (MNIST)
def read_idx(path: Path) -> np.ndarray:
    """An IDX file (``*-ubyte`` or ``*-ubyte.gz``) as a numpy array."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(f"{path}: IDX header says {dims} ({expected} bytes) but the file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find_idx(root: Path, stem: str) -> Path:
    for sub in ("", "raw", "MNIST/raw", "FashionMNIST/raw"):
        for suffix in ("", ".gz"):
            p = root / sub / f"{stem}{suffix}"
            if p.is_file():
                return p
    raise FileNotFoundError(f"{stem}[.gz] not found in {root} (nor in raw/, MNIST/raw/, FashionMNIST/raw/): give "
                            "--data-dir DIR with the IDX files, or --download")


def load_idx_splits(name: str, data_dir: str | None, download: bool) -> DataSplits:
    classes = FASHION_CLASSES if name == "fashion-mnist" else [str(i) for i in range(10)]
    root = Path(data_dir or (FASHION_MNIST_SYSTEM_DIR if name == "fashion-mnist" else "data"))
    if download:
        cls = torchvision.datasets.FashionMNIST if name == "fashion-mnist" else torchvision.datasets.MNIST
        with _downloading(name, root, download):
            for train in (True, False):
                cls(str(root), train=train, download=True)
    splits = []
    for prefix in ("train", "t10k"):
        x = read_idx(_find_idx(root, f"{prefix}-images-idx3-ubyte"))
        y = read_idx(_find_idx(root, f"{prefix}-labels-idx1-ubyte"))
        if len(x) != len(y):
            raise ValueError(f"{root}: {prefix} has {len(x)} images but {len(y)} labels")
        splits.append(ImageTensors(torch.from_numpy(x.copy())[:, None], torch.from_numpy(y.astype(np.int64))))
    return DataSplits(name, splits[0], splits[1], classes)


FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]


@contextlib.contextmanager
def _downloading(name: str, root: object, download: bool) -> Iterator[None]:
    """A failed ``--download`` (no network: urllib's URLError, or torchvision's RuntimeError once every MNIST mirror
    failed) as one message naming the dataset and the folder, instead of urllib's traceback."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not download:
            raise
        reason = " ".join(str(e).split())  # torchvision's MNIST message spans lines
        raise FileNotFoundError(f"{name}: --download into {root} failed ({reason}); without internet, put the files "
                                "there yourself (torchvision's layout) and leave out --download") from None


# --------------------------------------------------------------------------------------------- CIFAR
def load_cifar_splits(name: str, data_dir: str | None, download: bool) -> DataSplits:
    """torchvision's CIFAR format (``cifar-10-batches-py`` / ``cifar-100-python``) under ``data_dir``."""
    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    root = data_dir or "data"
    try:
        with _downloading(name, root, download):
            sets = [cls(root, train=t, download=download) for t in (True, False)]
    except RuntimeError as e:
        raise FileNotFoundError(f"{name} not found under {root}: {e} (use --download, or --dataset folder for an "
                                "ImageFolder copy)") from None
    out = [ImageTensors(torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(),  # n h w c -> n c h w
                        torch.tensor(s.targets, dtype=torch.int64)) for s in sets]
    return DataSplits(name, out[0], out[1], list(sets[0].classes))


# --------------------------------------------------------------------------------------------- fake
def load_fake_splits(n: int = 256, img_size: int = 16, channels: int = 3, num_classes: int = 4,
                     seed: int = 0) -> DataSplits:
    """torchvision FakeData (random images), for tests."""
    def make(size: int, offset: int) -> ImageTensors:
        ds = torchvision.datasets.FakeData(size, (channels, img_size, img_size), num_classes, random_offset=offset)
        xs = [to_array(img, channels) for img, _ in ds]
        return ImageTensors(torch.from_numpy(np.stack(xs)), torch.tensor([int(t) for _, t in ds]))

    return DataSplits("fake", make(n, seed), make(max(n // 4, 8), seed + 10_000),
                      [f"class{i}" for i in range(num_classes)])


# --------------------------------------------------------------------------------------------- folder / zip
class _Source:
    """A folder or a zip file with the ImageFolder layout ``{train,val|test}/<class>/<image>``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path) if path.is_file() else None
        if self.zip is None and not path.is_dir():
            raise FileNotFoundError(f"{path}: no such folder or zip file")
        names = self.zip.namelist() if self.zip else [str(p.relative_to(path)) for p in path.rglob("*")]
        self.files: dict[str, dict[str, list[str]]] = {}  # split -> class -> files
        self.dirs: dict[str, set[str]] = {}
        for n in sorted(names):
            parts = Path(n).parts
            # accept one wrapping folder (cifar10/train/...), as zips are often made that way
            for i in range(len(parts) - 1):
                if parts[i] in ("train", "val", "test") and len(parts) - i in (2, 3):
                    split = parts[i]
                    is_class_dir = len(parts) - i == 2  # zip directory entry or real folder
                    if is_class_dir and self.zip is None and not (path / n).is_dir():
                        break  # a stray file directly under train/
                    self.dirs.setdefault(split, set()).add(parts[i + 1])
                    if not is_class_dir and Path(n).suffix.lower() in IMAGE_EXTENSIONS:
                        self.files.setdefault(split, {}).setdefault(parts[i + 1], []).append(n)
                    break

    def read(self, name: str) -> bytes:
        return self.zip.read(name) if self.zip else (self.path / name).read_bytes()

    def fingerprint(self) -> str:
        st = self.path.stat()
        listing = json.dumps(self.files, sort_keys=True) if self.zip is None else ""
        return hashlib.sha256(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{listing}".encode()).hexdigest()


def load_folder_splits(path: str, skip_bad_images: bool = False, size: tuple[int, int] | None = None,
                       cache_dir: str | None = None, progress: Callable | None = None,
                       max_side: int = 128) -> DataSplits:
    """Decode an ImageFolder tree (or a zip of one) into memory as uint8, all at one size (``size``, else the most
    common size, scaled down to at most ``max_side`` pixels); cached under ``cache_dir`` by fingerprint."""
    src = _Source(Path(path))
    if "train" not in src.dirs:
        raise FileNotFoundError(f"{path}: expected {path}/train/<class>/<image> (and val/ or test/); found splits "
                                f"{sorted(src.dirs) or 'none'}")
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
    key = hashlib.sha256(f"{src.fingerprint()}|{size}|{max_side}|{skip_bad_images}".encode()).hexdigest()[:24]
    cache = Path(cache_dir) / f"folder-{key}.safetensors" if cache_dir else None
    if cache is not None and cache.is_file():
        t = load_file(str(cache))
        meta = json.loads(Path(str(cache) + ".json").read_text())
        return DataSplits(f"folder:{path}", ImageTensors(t["train_x"], t["train_y"]),
                          ImageTensors(t["val_x"], t["val_y"]), meta["classes"], meta["skipped"])
    items = {s: [(n, ci) for ci, c in enumerate(classes) for n in src.files[s][c]] for s in ("train", val_split)}
    decoded: dict[str, list] = {}
    skipped = 0
    for s, lst in items.items():
        imgs = []
        for n, ci in (progress(lst, desc=f"decoding {s}") if progress else lst):
            try:
                imgs.append((open_image(src.read(n), f"{path}/{n}" if src.zip else str(src.path / n)), ci))
            except BadImageError:
                if not skip_bad_images:
                    raise
                skipped += 1
        decoded[s] = imgs
    every = decoded["train"] + decoded[val_split]
    if not every:
        raise ValueError(f"{path}: no decodable images")
    channels = 1 if all(is_gray(im) for im, _ in every) else 3
    if size is None:  # the most common size wins; the others are resized to it
        size = Counter((im.height, im.width) for im, _ in every).most_common(1)[0][0]
        if max(size) > max_side:  # large photos are kept in memory at a training-friendly size
            scale = max_side / max(size)
            size = (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))
    tensors = []
    for s in ("train", val_split):
        x = torch.from_numpy(np.stack([to_array(im, channels, size) for im, _ in decoded[s]]))
        y = torch.tensor([ci for _, ci in decoded[s]], dtype=torch.int64)
        tensors.append(ImageTensors(x, y))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(str(cache) + ".json"), lambda p: p.write_text(json.dumps({"classes": classes,
                                                                                     "skipped": skipped})))
        atomic_write(cache, lambda p: save_file({"train_x": tensors[0].images, "train_y": tensors[0].labels,
                                                 "val_x": tensors[1].images, "val_y": tensors[1].labels}, str(p)))
    return DataSplits(f"folder:{path}", tensors[0], tensors[1], classes, skipped)


def load_dataset(name: str, data_dir: str | None = None, download: bool = False, skip_bad_images: bool = False,
                 cache_dir: str | None = None, progress: Callable | None = None) -> DataSplits:
    """One entry point for every dataset name in :data:`DATASETS`."""
    if name == "digits":
        return load_digits_splits()
    if name in ("mnist", "fashion-mnist"):
        return load_idx_splits(name, data_dir, download)
    if name in ("cifar10", "cifar100"):
        return load_cifar_splits(name, data_dir, download)
    if name == "folder":
        if not data_dir:
            raise ValueError("--dataset folder needs --data-dir DIR (a folder or .zip with train/<class>/* and "
                             "val/<class>/* or test/<class>/*)")
        return load_folder_splits(data_dir, skip_bad_images, cache_dir=cache_dir, progress=progress)
    if name == "fake":
        return load_fake_splits()
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "vitkit")
