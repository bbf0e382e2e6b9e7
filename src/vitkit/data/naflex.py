"""A streamed split read as NaFlex batches (model/naflex.py): each image kept at its aspect ratio, resized to fit a
token budget and cut into patches by the DataLoader workers, batches padded to the budget.

The fixed-size path squashes every photo to one size; here a 4:3 photo and a 1:2 one each keep their shape, at as
many patches as the budget allows. Everything else is the streamed split's: the same files, decode, sampler, workers
and bad-file handling (stream.py), so a NaFlex run differs from a fixed-size streamed run only in the pixels' shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
from PIL import Image

from ..model.config import to_2tuple
from ..model.naflex import collate, patchify, size_for_budget
from .images import BadImageError, to_array
from .stream import StreamedImages, _collate

MAX_DECODE_SIDE = 4096


def naflex_patches(img: Image.Image, channels: int, patch: int | tuple[int, int], max_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoded image at its NaFlex size (resized as the fixed-size path resizes), as (patches, coords)."""
    a = to_array(img, channels, size_for_budget(img.height, img.width, patch, max_tokens))
    return patchify(torch.from_numpy(a), patch)


def decode_side(patch: int | tuple[int, int], max_tokens: int) -> int:
    """The longer side an image is decoded to at least: its NaFlex size at up to 4:1, never upsampled from less."""
    return min(MAX_DECODE_SIDE, max(to_2tuple(patch)) * math.ceil(math.sqrt(max_tokens)) * 2)


class NaFlexImages(StreamedImages):
    """A streamed split whose batches are NaFlex batches (uint8 patches) of at most ``max_tokens`` patches each;
    ``take`` and the statistics still see the images at the split's fixed size."""

    def __init__(self, split: StreamedImages, patch: int | tuple[int, int], max_tokens: int) -> None:
        super().__init__(split.reader, split.names, split.labels, split.prep, split.channels, split.skip_bad,
                         split.workers)
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        self.patch, self.max_tokens = to_2tuple(patch), max_tokens
        self.naflex_prep = dataclasses.replace(split.prep, decode_side=max(split.prep.decode_side,
                                                                           decode_side(patch, max_tokens)))

    def fixed(self) -> StreamedImages:
        """The same images at the split's one size (for ``take`` and the mean and std)."""
        return StreamedImages(self.reader, self.names, self.labels, self.prep, self.channels, self.skip_bad,
                              self.workers)

    def subset(self, idx: torch.Tensor) -> "NaFlexImages":
        return NaFlexImages(self.fixed().subset(idx), self.patch, self.max_tokens)

    def take(self, idx: list[int] | torch.Tensor) -> torch.Tensor:
        return self.fixed().take(idx)

    def stats_sample(self) -> torch.Tensor:
        return self.fixed().stats_sample()

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int, str]:
        name = self.names[i]
        try:
            img, _ = self.naflex_prep.decode(self.reader.read(name), self.reader.where(name))
            patches = naflex_patches(img, self.channels, self.patch, self.max_tokens)
        except BadImageError as e:
            return None, int(self.labels[i]), str(e)
        return patches, int(self.labels[i]), ""

    def collate_fn(self) -> Callable:
        return functools.partial(_collate, stack=functools.partial(collate, max_tokens=self.max_tokens))


def as_naflex(data, patch: int | tuple[int, int], max_tokens: int):
    """``data`` (DataSplits, streamed) with both splits read as NaFlex batches."""
    if not isinstance(data.train, StreamedImages):
        raise ValueError(f"{data.name}: NaFlex reads each image from its file at its own size; this dataset is "
                         "held in memory at one size (--naflex needs --dataset folder, shards or hf)")
    how = f"NaFlex: each image at its aspect ratio, at most {max_tokens} patches of {to_2tuple(patch)}"
    return dataclasses.replace(data, train=NaFlexImages(data.train, patch, max_tokens),
                               val=NaFlexImages(data.val, patch, max_tokens), how=how)
