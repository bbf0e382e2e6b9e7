"""NaFlex: images at their own aspect ratio and resolution, in one batch (SigLIP 2, Tschannen et al. 2025, after
NaViT, Dehghani et al. 2023; timm's NaFlexViT).

The paper resizes every image to one square size, so a 4:3 photo is squashed and a panorama more so. NaFlex keeps
each image's aspect ratio instead: it is resized to the largest size whose patch grid fits a token budget, cut
into its own grid of patches, and the batch is padded to the budget. Three tensors carry it (timm's names):

    patches  (B, L, P*P*C)  each image's patches, flattened as (P, P, C), then zeros up to the budget L
    coords   (B, L, 2)      each patch's (row, column) in its own image's grid
    valid    (B, L)         False for the padding

The model is the same ViT: x_p E (Eq. 1) is the linear map it always was; E_pos is resampled (§3.2) to each image's
grid and looked up by ``coords``; the attention takes a mask so that no token attends to padding; the pooling
averages (or attends over) valid tokens only. An image whose grid fits the budget gives the tokens it gives alone.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .config import to_2tuple


@dataclasses.dataclass
class NaFlexBatch:
    """A padded batch of variable-size images as patches (see the module's docstring). ``patches`` is uint8 as
    decoded and float once normalised; ``len`` is the number of images."""

    patches: torch.Tensor
    coords: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        b, n = self.valid.shape
        if self.patches.ndim != 3 or self.patches.shape[:2] != (b, n) or self.coords.shape != (b, n, 2):
            raise ValueError(f"a NaFlex batch needs patches (B, L, P*P*C), coords (B, L, 2) and valid (B, L); got "
                             f"{tuple(self.patches.shape)}, {tuple(self.coords.shape)}, {tuple(self.valid.shape)}")
        if b == 0:
            raise ValueError("empty NaFlex batch: no images")
        if not bool(self.valid.any(1).all()):
            raise ValueError("a NaFlex batch has an image with no valid patch")

    def __len__(self) -> int:
        return self.valid.shape[0]

    def __getitem__(self, index: slice) -> "NaFlexBatch":
        """The images ``index`` (a slice) selects, as a batch of their own."""
        return NaFlexBatch(self.patches[index], self.coords[index], self.valid[index])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "NaFlexBatch":
        return NaFlexBatch(*(t.to(device, non_blocking=non_blocking) for t in (self.patches, self.coords, self.valid)))

    def replace(self, **kw: torch.Tensor) -> "NaFlexBatch":
        return dataclasses.replace(self, **kw)

    def grids(self) -> list[tuple[int, int]]:
        """Each image's patch grid (rows, columns), from the largest valid coordinate."""
        c = self.coords.masked_fill(~self.valid[..., None], 0).amax(1) + 1  # (B, 2)
        return [(int(h), int(w)) for h, w in c.tolist()]


def size_for_budget(h: int, w: int, patch: int | tuple[int, int], max_tokens: int) -> tuple[int, int]:
    """The (H, W) an h x w image is resized to: about its aspect ratio, each side a multiple of the patch (at least
    one patch), and as large as fits ``max_tokens`` patches. SigLIP 2's search (Hugging Face's
    ``get_image_size_for_max_num_patches``, checked against it in tests): bisect the scale to 1e-5."""
    ph, pw = to_2tuple(patch)
    if h < 1 or w < 1:
        raise ValueError(f"image size {(h, w)} is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")

    def scaled(scale: float, side: int, p: int) -> int:
        return max(p, math.ceil(side * scale / p) * p)

    lo, hi, eps = 1e-6, 100.0, 1e-5
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (scaled(mid, h, ph) // ph) * (scaled(mid, w, pw) // pw) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return scaled(lo, h, ph), scaled(lo, w, pw)


def patchify(img: torch.Tensor, patch: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H, W) -> patches (N, P*P*C) flattened as (P, P, C) (PatchEmbed's and SigLIP 2's order) in raster order,
    and their (row, column) coordinates (N, 2)."""
    ph, pw = to_2tuple(patch)
    c, h, w = img.shape
    if h % ph or w % pw:
        raise ValueError(f"image size {(h, w)} is not a multiple of the patch size {(ph, pw)}")
    gh, gw = h // ph, w // pw
    x = img.reshape(c, gh, ph, gw, pw).permute(1, 3, 2, 4, 0).reshape(gh * gw, ph * pw * c)  # c (gh p)(gw q) -> ...
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    return x, torch.stack([rows.flatten(), cols.flatten()], dim=1)


def collate(items: list[tuple[torch.Tensor, torch.Tensor]], max_tokens: int) -> NaFlexBatch:
    """(patches, coords) per image -> one batch padded to ``max_tokens`` (one shape for every batch of a run)."""
    if not items:
        raise ValueError("empty NaFlex batch: no images")
    dim = items[0][0].shape[1]
    patches = items[0][0].new_zeros(len(items), max_tokens, dim)
    coords = torch.zeros(len(items), max_tokens, 2, dtype=torch.int64)
    valid = torch.zeros(len(items), max_tokens, dtype=torch.bool)
    for i, (p, c) in enumerate(items):
        if p.shape[0] > max_tokens:
            raise ValueError(f"image {i} has {p.shape[0]} patches, more than the budget of {max_tokens}")
        patches[i, :len(p)], coords[i, :len(p)], valid[i, :len(p)] = p, c, True
    return NaFlexBatch(patches, coords, valid)


def image_patches(img: torch.Tensor, patch: int | tuple[int, int], max_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One uint8 (C, H, W) image resized (bilinear, antialiased) to its NaFlex size and cut into patches."""
    size = size_for_budget(img.shape[1], img.shape[2], patch, max_tokens)
    if size != tuple(img.shape[1:]):
        img = F.interpolate(img[None].float(), size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        img = img.round().clamp(0, 255).to(torch.uint8)
    return patchify(img, patch)


def batch_images(images: list[torch.Tensor], patch: int | tuple[int, int], max_tokens: int) -> NaFlexBatch:
    """uint8 (C, H, W) images of any sizes -> a NaFlex batch (uint8 patches: normalise them before the model)."""
    return collate([image_patches(img, patch, max_tokens) for img in images], max_tokens)


def normalize(batch: NaFlexBatch, mean: torch.Tensor, std: torch.Tensor) -> NaFlexBatch:
    """uint8 patches -> float, standardised per channel (``mean``, ``std`` in 0-255 units, (C,)); padding stays 0."""
    c = mean.numel()
    x = batch.patches.float().unflatten(-1, (-1, c))  # b l (p q c) -> b l (p q) c
    x = ((x - mean.to(x.device)) / std.to(x.device)).flatten(-2) * batch.valid[..., None]
    return batch.replace(patches=x)


def hflip(batch: NaFlexBatch, flip: torch.Tensor, patch: int | tuple[int, int]) -> NaFlexBatch:
    """Mirror the images ``flip`` (B,) marks: each patch's pixels mirrored and its column read from the other side.
    The tokens keep their order: position comes from ``coords``, so the model sees the mirrored image."""
    ph, pw = to_2tuple(patch)
    x = batch.patches.unflatten(-1, (ph, pw, -1))  # b l (p q c) -> b l p q c
    x = torch.where(flip[:, None, None, None, None], x.flip(3), x).flatten(-3)
    widths = torch.tensor([g[1] for g in batch.grids()], device=batch.coords.device)
    cols = torch.where(flip[:, None], widths[:, None] - 1 - batch.coords[..., 1], batch.coords[..., 1])
    cols = cols.masked_fill(~batch.valid, 0)
    return batch.replace(patches=x, coords=torch.stack([batch.coords[..., 0], cols], dim=-1))
