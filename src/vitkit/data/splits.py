"""What every dataset loader returns: uint8 images and int64 labels in memory, a train and a validation split."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..model.serialization import atomic_write


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

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.images.shape)  # type: ignore[return-value]

    def identity(self) -> str:
        """Which images these are, as a resume checks it: their count and a digest of their labels and shape (read
        from wherever the labels live: on a GPU they are copied to the host first)."""
        digest = hashlib.sha256(self.labels.cpu().numpy().tobytes() + str(self.shape).encode()).hexdigest()[:16]
        return f"{len(self)} images, {digest}"

    def subset(self, idx: torch.Tensor) -> "ImageTensors":
        return ImageTensors(self.images[idx], self.labels[idx])

    def take(self, idx: list[int] | torch.Tensor) -> torch.Tensor:
        """The uint8 images at ``idx``."""
        return self.images[torch.as_tensor(idx, dtype=torch.int64)]

    def stats_sample(self) -> torch.Tensor:
        return self.images[:20000]


STATS_CHUNK = 256  # images converted to float at a time for mean_std (50 MB at 128 px)


def _per_class(labels: torch.Tensor, seed: int, count: Callable[[int], int]) -> torch.Tensor:
    """Sorted indices of ``count(n)`` images of each class of n, the first of a fixed shuffle (``seed``): the same
    images every call, and a smaller count's among a larger one's. Chosen on the host (labels resident on a GPU
    included), then cut wherever the images are."""
    labels = labels.cpu()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    picked = [of_c[:count(len(of_c))] for c in labels.unique().tolist() for of_c in [order[labels[order] == c]]]
    return torch.cat(picked).sort().values if picked else torch.zeros(0, dtype=torch.int64)


@dataclass
class DataSplits:
    """A train and a validation split: ``ImageTensors`` in memory, or ``stream.StreamedImages`` read from their
    files as the run goes (the same ``len``, ``labels``, ``shape``, ``subset``; batches cut by ``augment.batches``)."""

    name: str
    train: Any  # ImageTensors | StreamedImages
    val: Any
    classes: list[str]
    skipped: int = 0  # bad images skipped with --skip-bad-images
    how: str = ""  # how it is held, when not decoded in memory ("streamed from the files at ...")

    @property
    def streamed(self) -> bool:
        return not isinstance(self.train, ImageTensors)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_chans(self) -> int:
        return self.train.shape[1]

    @property
    def img_size(self) -> tuple[int, int]:
        return tuple(self.train.shape[2:])  # type: ignore[return-value]

    def to(self, device: torch.device) -> "DataSplits":
        """The same splits with their tensors on ``device`` (still uint8: a quarter of float32's memory)."""
        move = lambda t: ImageTensors(t.images.to(device), t.labels.to(device))  # noqa: E731
        return dataclasses.replace(self, train=move(self.train), val=move(self.val))

    def with_train_fraction(self, fraction: float, seed: int = 0, holdout: float = 0.0) -> "DataSplits":
        """The same splits with ``fraction`` of the training images, class-balanced: every class keeps
        ``round(fraction x its count)`` images (at least one), drawn with a fixed ``seed`` so every model in a
        comparison sees the same ones, and a smaller fraction's images are among a larger one's. With ``holdout``,
        that share of them is then the validation split (``holding_out``)."""
        if holdout:
            return self.with_train_fraction(fraction, seed).holding_out(holdout)
        if fraction >= 1:
            return self
        return dataclasses.replace(self, train=self.train.subset(self._fraction(fraction, seed)))

    def _fraction(self, fraction: float, seed: int) -> torch.Tensor:
        """The indices of ``with_train_fraction``'s images: ``round(fraction x its count)`` of each class."""
        return _per_class(self.train.labels, seed, lambda n: max(1, round(fraction * n)))

    def left_out(self, fraction: float, seed: int = 0) -> Any:
        """The training images ``with_train_fraction(fraction, seed)`` leaves out (none at 1)."""
        out = torch.ones(len(self.train), dtype=torch.bool)
        out[self._fraction(fraction, seed) if fraction < 1 else slice(None)] = False
        return self.train.subset(out.nonzero()[:, 0])

    def with_classes(self, names: list[str]) -> "DataSplits":
        """Only the images of the classes ``names`` (``--classes a,b,c``), relabelled 0..k-1 in the dataset's own
        order, which is also the order the checkpoint lists them in. A name the dataset lacks is refused with the
        names it has."""
        known = [str(c) for c in self.classes]
        if not names or names == known:  # (every class, in its order: the data as it is)
            return self
        if len(set(names)) != len(names):
            raise ValueError(f"--classes: {', '.join(n for n in dict.fromkeys(names) if names.count(n) > 1)} given "
                             "twice")
        if unknown := [n for n in names if n not in known]:
            shown = ", ".join(known[:30]) + (f", ... ({len(known)} in all)" if len(known) > 30 else "")
            raise ValueError(f"--classes: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a class of "
                             f"{self.name}; its classes: {shown}")
        keep = [i for i, c in enumerate(known) if c in names]
        new = torch.full((len(known),), -1, dtype=torch.int64)
        new[keep] = torch.arange(len(keep))

        def cut(split: Any) -> Any:
            labels = split.labels.cpu()
            part = split.subset(torch.isin(labels, torch.tensor(keep)).nonzero()[:, 0])  # (a new object)
            part.labels = new[part.labels.cpu()].to(split.labels.device)  # ImageTensors or StreamedImages alike
            return part

        how = f"classes {', '.join(known[i] for i in keep)} of {len(known)} (--classes)"
        return dataclasses.replace(self, train=cut(self.train), val=cut(self.val),
                                   classes=[self.classes[i] for i in keep],
                                   how=", ".join(filter(None, [self.how, how])))

    def holding_out(self, share: float) -> "DataSplits":
        """A class-balanced ``share`` of the training images as the validation split, the rest to train on; the
        dataset's own validation (or test) split is set aside unread. Settings chosen on this split have never seen
        the test images. Every class keeps one image to train on and gives at least one, where it has two."""
        held_idx = _per_class(self.train.labels, 1, lambda n: min(n - 1, max(1, round(share * n))))
        rest = torch.ones(len(self.train.labels), dtype=torch.bool)
        rest[held_idx] = False
        if not len(held_idx):
            raise ValueError(f"--holdout {share:g}: no class has two training images to give one to validation")
        how = f"validating on {len(held_idx)} held-out training images (--holdout {share:g}; {self.name}'s own " \
              "validation split unread)"
        return dataclasses.replace(self, train=self.train.subset(rest.nonzero()[:, 0]),
                                   val=self.train.subset(held_idx), how=", ".join(filter(None, [self.how, how])))

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Each channel's mean and standard deviation over (up to 20,000 of) the training images, in [0, 1]: summed
        a chunk at a time where they are (20,000 images of 128 px as float32 at once were 3.9 GiB beside the run's
        own, on a GPU too: issue 80, F10)."""
        x = self.train.stats_sample()
        s1 = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        s2 = torch.zeros_like(s1)
        for chunk in x.split(STATS_CHUNK):
            f = chunk.float().div_(255)
            s1 += f.sum(dim=(0, 2, 3)).double()
            s2 += f.square_().sum(dim=(0, 2, 3)).double()
        n = x.numel() // max(x.shape[1], 1)
        mean = s1 / max(n, 1)
        var = (s2 - n * mean.square()) / max(n - 1, 1)  # (unbiased, as torch.std)
        return mean.tolist(), var.clamp_min(0).sqrt().clamp_min(1e-3).tolist()

    def describe(self) -> str:
        h, w = self.img_size
        return (f"{self.name}: {len(self.train)} train / {len(self.val)} val images, {h}x{w}x{self.in_chans}, "
                + (f"{self.num_classes} classes" if self.num_classes != 1 else "one class") +
                (f", {self.skipped} bad images skipped" if self.skipped else "")
                + (f", {self.how}" if self.how else ""))


# ------------------------------------------------------------------------------------------ decoded once, then read
def load_cached(cache: Path | None, *meta_keys: str) -> tuple[ImageTensors, ImageTensors, dict[str, Any]] | None:
    """The train and validation tensors and the metadata (with ``meta_keys``) that ``save_cached`` wrote at
    ``cache``, or None: also for a cache that cannot be read whole (a damaged disk, a file cut short by hand), which
    is then decoded again and rewritten."""
    if cache is None or not cache.is_file():
        return None
    try:
        t = load_file(str(cache))
        meta = json.loads(Path(str(cache) + ".json").read_text())
        splits = ImageTensors(t["train_x"], t["train_y"]), ImageTensors(t["val_x"], t["val_y"])
    except (SafetensorError, OSError, ValueError, KeyError):  # ValueError: bad JSON, or tensors of the wrong kind
        return None
    if not isinstance(meta, dict) or any(k not in meta for k in meta_keys):
        return None
    return *splits, meta


def save_cached(cache: Path | None, train: ImageTensors, val: ImageTensors, meta: dict[str, Any]) -> None:
    """Keep decoded splits as safetensors (plain tensors: nothing executes on reading them back)."""
    if cache is None:
        return
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(str(cache) + ".json"), lambda p: p.write_text(json.dumps(meta)))
    atomic_write(cache, lambda p: save_file({"train_x": train.images, "train_y": train.labels,
                                             "val_x": val.images, "val_y": val.labels}, str(p)))
