"""Batch augmentation on uint8 tensors already on the device: no per-image Python in the hot loop."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from ..model import naflex
from ..model.draws import draw
from ..model.naflex import NaFlexBatch
from .datasets import ImageTensors


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-image random crop of a zero-padded batch, (B, C, H, W) -> (B, C, H, W), by gather (no loop)."""
    if padding <= 0:
        return x
    B, C, H, W = x.shape
    xp = F.pad(x, (padding,) * 4)
    oy = draw(torch.randint, 0, 2 * padding + 1, (B,), generator=generator, on=x.device)
    ox = draw(torch.randint, 0, 2 * padding + 1, (B,), generator=generator, on=x.device)
    rows = (oy[:, None] + torch.arange(H, device=x.device))[:, None, :, None]  # b 1 h 1
    cols = (ox[:, None] + torch.arange(W, device=x.device))[:, None, None, :]  # b 1 1 w
    b = torch.arange(B, device=x.device)[:, None, None, None]
    c = torch.arange(C, device=x.device)[None, :, None, None]
    return xp[b, c, rows, cols]


def random_hflip(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    flip = (draw(torch.rand, x.shape[0], generator=generator, on=x.device) < 0.5)[:, None, None, None]
    return torch.where(flip, x.flip(-1), x)



# RandAugment magnitudes the strong view draws from (torchvision's scale: 31 steps, 30 the strongest)
STRONG_MAGNITUDES = (3, 9, 15, 21, 27)


def cutout(x: torch.Tensor, generator: torch.Generator | None = None, fill: int = 127) -> torch.Tensor:
    """DeVries & Taylor's Cutout as FixMatch uses it: in each image a square of side up to half the image's shorter
    side, centred anywhere (cut off at the borders), set to grey."""
    n, _, h, w = x.shape
    side, cy, cx = draw(torch.rand, 3, n, generator=generator, on=x.device)
    half = side * min(h, w) / 4  # (side x 0.5 x min(h, w)) / 2
    ys = torch.arange(h, device=x.device).view(1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, w)
    inside = ((ys - cy.view(-1, 1, 1) * h).abs() < half.view(-1, 1, 1)) & \
        ((xs - cx.view(-1, 1, 1) * w).abs() < half.view(-1, 1, 1))
    return x.masked_fill(inside[:, None], fill)


class BatchAugment:
    """uint8 batch -> normalised float batch (and soft targets when MixUp/CutMix are on).

    ``aa``: ``"rand"`` (RandAugment) or ``"trivial"`` (TrivialAugmentWide) from torchvision v2, applied to groups of
    ``aa_group`` images so that each group draws its own operation. ``aa_magnitude``: RandAugment's strength on the
    scale of 10 that AutoAugment's code, big_vision (``randaug(2, 10)``) and timm (``rand-m10``) use, where 10 is
    each operation's strongest; torchvision's own scale has 31 steps (its default 9 is about 3 of 10).
    MixUp (``mixup``: Beta(alpha, alpha), each image mixed with the batch's next, labels likewise) is big_vision's
    ``mixup(p=alpha)``.
    """

    def __init__(self, mean: list[float], std: list[float], img_size: tuple[int, int], num_classes: int,
                 crop_padding: int = 0, hflip: bool = False, aa: str | None = None, aa_group: int = 8,
                 mixup: float = 0.0, cutmix: float = 0.0, aa_magnitude: int | None = None) -> None:
        self.mean = torch.tensor(mean).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std).view(1, -1, 1, 1) * 255
        self.img_size, self.crop_padding, self.hflip, self.aa_group = tuple(img_size), crop_padding, hflip, aa_group
        rand = v2.RandAugment() if aa_magnitude is None else \
            v2.RandAugment(magnitude=aa_magnitude, num_magnitude_bins=11)  # step 10 of 0..10: the strongest
        self.aa = {None: None, "none": None, "rand": rand, "trivial": v2.TrivialAugmentWide()}[aa]
        mix = ([v2.MixUp(alpha=mixup, num_classes=num_classes)] if mixup > 0 else []) + \
              ([v2.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix > 0 else [])
        self.mix = v2.RandomChoice(mix) if mix else None

    def to(self, device: torch.device) -> "BatchAugment":
        """The standardisation's mean and std kept on ``device``: not copied there again for every batch."""
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float, resized to the model's size, standardised."""
        x = x.float()
        if tuple(x.shape[-2:]) != self.img_size:
            x = F.interpolate(x, size=self.img_size, mode="bilinear", align_corners=False, antialias=True)
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    def crop_flip(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The training crop (with ``crop_padding``) and, with ``hflip``, the flip of a uint8 batch."""
        x = random_crop(x, self.crop_padding, generator)
        return random_hflip(x, generator) if self.hflip else x

    def strong(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 -> standardised float, FixMatch's strong view (Sohn et al. 2020, its RandAugment variant): two
        RandAugment operations at a magnitude drawn for each group of ``aa_group`` images, the training crop and
        flip, then Cutout (a grey square of up to half the image's side)."""
        if not hasattr(self, "_strong"):  # (built on first use: only --semi fixmatch asks)
            self._strong = [v2.RandAugment(num_ops=2, magnitude=m) for m in STRONG_MAGNITUDES]
        groups = x.split(self.aa_group)
        # (the host's generator, as RandAugment's own draws: a choice read on the host, no wait for a device)
        which = torch.randint(len(self._strong), (len(groups),)).tolist()
        x = torch.cat([self._strong[k](g) for k, g in zip(which, groups)])
        return self.normalize(cutout(self.crop_flip(x, generator), generator))

    def weak(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 -> standardised float, cropped and flipped as training does, nothing else (MAE's augmentation)."""
        return self.normalize(self.crop_flip(x, generator))

    def __call__(self, x: torch.Tensor | NaFlexBatch, y: torch.Tensor, train: bool,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor | NaFlexBatch, torch.Tensor]:
        if isinstance(x, NaFlexBatch):  # images at their own sizes, as patches: flips and standardisation only
            if train and self.hflip:
                c = self.mean.numel()
                p = round((x.patches.shape[-1] / c) ** 0.5)
                x = naflex.hflip(x, draw(torch.rand, len(x), generator=generator, on=x.valid.device) < 0.5, p)
            return naflex.normalize(x, self.mean.flatten(), self.std.flatten()), y
        if train:
            if self.aa is not None:
                x = torch.cat([self.aa(g) for g in x.split(self.aa_group)])
            x = self.crop_flip(x, generator)
        x = self.normalize(x)
        if train and self.mix is not None:
            x, y = self.mix(x, y)
        return x, y


def batches(data: ImageTensors, indices: list[int] | torch.Tensor, batch_size: int, drop_last: bool,
            device: torch.device):
    """Yield (uint8 images, labels) on ``device`` for consecutive chunks of ``indices`` (read from the files by
    DataLoader workers for a streamed split)."""
    if not isinstance(data, ImageTensors):  # stream.StreamedImages
        yield from data.batches(indices, batch_size, drop_last, device)
        return
    idx = torch.as_tensor(indices, dtype=torch.int64).to(data.images.device)  # cut where the images live
    n = len(idx) - (len(idx) % batch_size if drop_last else 0)
    for i in range(0, n, batch_size):
        j = idx[i:i + batch_size]
        yield data.images[j].to(device, non_blocking=True), data.labels[j].to(device, non_blocking=True)
