"""Datasets as uint8 tensors in memory: decoded once, cached, then augmented in batches on the device.

Every loader returns :class:`DataSplits` (train + val) of :class:`ImageTensors`.
"""
from __future__ import annotations

import contextlib
import gzip
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torchvision

from . import DATASETS, FILE_DATASETS  # noqa: F401 - the dataset names, here as before
from .folder import load_folder_splits
from .hf import load_hf_splits
from .shards import load_shard_splits
from .images import to_array
from .splits import DataSplits, ImageTensors, load_cached, save_cached

FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


# --------------------------------------------------------------------------------------------- digits
def load_digits_splits(val_fraction: float = 0.2, seed: int = 0, cache_dir: str | None = None) -> DataSplits:
    """scikit-learn's 1,797 real 8x8 handwritten digits (values 0-16), a fixed stratified split; kept in
    ``cache_dir`` per scikit-learn version, since importing scikit-learn takes 2 s of every run that reads them."""
    classes = [str(i) for i in range(10)]
    key = f"digits-sklearn{version('scikit-learn')}-{val_fraction}-{seed}"
    cache = Path(cache_dir) / f"{key}.safetensors" if cache_dir else None
    if (hit := load_cached(cache)) is not None:
        return DataSplits("digits", hit[0], hit[1], classes)
    from sklearn.datasets import load_digits  # scikit-learn's import (≈2 s) only for the digits
    from sklearn.model_selection import train_test_split  # (the same)

    d = load_digits()
    x = torch.from_numpy(np.round(d.images * (255 / 16)).astype(np.uint8))[:, None]  # n h w -> n 1 h w
    y = torch.from_numpy(d.target.astype(np.int64))
    tr, va = train_test_split(np.arange(len(y)), test_size=val_fraction, random_state=seed, stratify=d.target)
    train, val = ImageTensors(x[tr], y[tr]), ImageTensors(x[va], y[va])
    save_cached(cache, train, val, {"classes": classes})
    return DataSplits("digits", train, val, classes)


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


def load_dataset(name: str, data_dir: str | None = None, download: bool = False, skip_bad_images: bool = False,
                 cache_dir: str | None = None, progress: Callable | None = None, max_side: int = 128,
                 crop: dict[str, Any] | None = None, mode: str = "auto",
                 say: Callable[[str], None] | None = None, unlabeled: bool = False,
                 budget_s: float | None = None, classes: list[str] | None = None) -> DataSplits:
    """One entry point for every dataset name in :data:`DATASETS` (``crop``: a folder's images resized and cropped
    as pretrained weights expect them, ``images.crop_spec``; ``mode``: a folder in memory or streamed, or ``auto``,
    folder.load_folder_splits, which ``say``s what it chose; ``unlabeled``: self-supervision reads a folder without
    splits or classes too; ``budget_s``: the seconds a --time-limit leaves, which listing and decoding must fit,
    folder.mode_within_budget; ``classes``: only these classes' images, DataSplits.with_classes)."""
    data = _load(name, data_dir, download, skip_bad_images, cache_dir, progress, max_side, crop, mode, say,
                 unlabeled, budget_s)
    return data.with_classes(classes) if classes else data


def _load(name: str, data_dir: str | None, download: bool, skip_bad_images: bool, cache_dir: str | None,
          progress: Callable | None, max_side: int, crop: dict[str, Any] | None, mode: str,
          say: Callable[[str], None] | None, unlabeled: bool, budget_s: float | None) -> DataSplits:
    if name == "digits":
        return load_digits_splits(cache_dir=cache_dir)
    if name in ("mnist", "fashion-mnist"):
        return load_idx_splits(name, data_dir, download)
    if name in ("cifar10", "cifar100"):
        return load_cifar_splits(name, data_dir, download)
    if name == "folder":
        if not data_dir:
            raise ValueError("--dataset folder needs --data-dir DIR (a folder or .zip with train/<class>/* and "
                             "val/<class>/* or test/<class>/*)")
        return load_folder_splits(data_dir, skip_bad_images, cache_dir=cache_dir, progress=progress,
                                  max_side=max_side, crop=crop, mode=mode, say=say, unlabeled=unlabeled,
                                  budget_s=budget_s)
    if name == "shards":
        if not data_dir:
            raise ValueError("--dataset shards needs --data-dir DIR (WebDataset shards train-*.tar and val-*.tar, "
                             "as `vitkit shard` writes them)")
        return load_shard_splits(data_dir, skip_bad_images, cache_dir, progress, max_side, crop, mode, say,
                                 unlabeled=unlabeled, budget_s=budget_s)
    if name == "hf":
        if not data_dir:
            raise ValueError("--dataset hf needs --data-dir PATH: a save_to_disk folder, parquet files, or a Hub id")
        return load_hf_splits(data_dir, skip_bad_images, cache_dir, progress, max_side, crop, mode, say, budget_s)
    if name == "fake":
        return load_fake_splits()
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def default_cache_dir() -> str:
    """``$VITKIT_CACHE_DIR``, else ``~/.cache/vitkit`` (decoded datasets, and the calibration timings)."""
    from ..runtime.calibrate import cache_dir  # the one definition of vitkit's cache folder

    return str(cache_dir())
