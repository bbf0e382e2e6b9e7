"""A ViT as a backbone: the blocks' patch tokens as feature maps, other input sizes and patch sizes.

timm's names and semantics (``forward_intermediates``, ``prune_intermediate_layers``, ``set_input_size``,
``features_only``), checked against timm's outputs in tests/test_backbone.py, so code written for a timm backbone
(a segmentation or detection neck, a probe) takes a vitkit model as it is.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import to_2tuple
from .posembed import resample_pos_embed

FORMATS = ("NCHW", "NLC")


def take_indices(num_blocks: int, indices: int | Sequence[int] | None) -> tuple[list[int], int]:
    """The blocks to read, as timm's ``feature_take_indices``: None all, an int the last n, a sequence those blocks
    (negative from the end); and the deepest of them."""
    if indices is None:
        indices = num_blocks
    if isinstance(indices, (bool, str, bytes)) or not isinstance(indices, (int, Sequence)):
        raise ValueError(f"indices must be an int (the last n blocks) or a list of block indices, got {indices!r}")
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f"indices={indices}: the last n blocks, n from 1 to {num_blocks} (this model has "
                             f"{num_blocks} blocks)")
        return list(range(num_blocks - indices, num_blocks)), num_blocks - 1
    if not indices:
        raise ValueError("indices is empty: name at least one block")
    taken = []
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not -num_blocks <= i < num_blocks:
            raise ValueError(f"block index {i!r} is out of range: this model has {num_blocks} blocks (0 to "
                             f"{num_blocks - 1}, or -1 to -{num_blocks} from the end)")
        taken.append(i % num_blocks)
    return taken, max(taken)


def resample_patch_embed(weight: torch.Tensor, new_size: int | tuple[int, int]) -> torch.Tensor:
    """E for another patch size, (D, C, p, q) -> (D, C, p', q'), by FlexiViT's pseudo-inverse resize (Beyer et al.
    2023, as timm's ``resample_patch_embed``): the new filters give a resized patch the tokens the old filters gave
    the original patch, as nearly as a linear map can (exactly when the patch grows)."""
    old, new = tuple(weight.shape[-2:]), to_2tuple(new_size)
    if old == new:
        return weight
    n = old[0] * old[1]
    basis = torch.eye(n, dtype=torch.float64, device=weight.device).reshape(n, 1, *old)  # every one-pixel patch
    # In float64 throughout: a resize that shrinks a side has singular values of exactly 0, and float32 rounding
    # would turn them into tiny ones that the pseudo-inverse blows up.
    resize = F.interpolate(basis, size=new, mode="bicubic", antialias=True, align_corners=False).reshape(n, -1)
    pinv = torch.linalg.pinv(resize)  # (new, old): the least-squares inverse of the resize
    flat = weight.double().reshape(-1, n) @ pinv.T  # (D * C, p' * q')
    return flat.reshape(*weight.shape[:2], *new).to(weight.dtype)


class Backbone:
    """The backbone methods of ``VisionTransformer`` (a mixin: they read its blocks, embedding and norms)."""

    def forward_intermediates(self, x: torch.Tensor, indices: int | Sequence[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False
                              ) -> tuple[torch.Tensor, list] | list:
        """The patch tokens after the chosen blocks (``indices``: None all, an int the last n, a list those
        blocks), the prefix tokens (class, distillation, registers) split off: each a feature map (B, D, h, w) with
        ``output_fmt="NCHW"``, or (B, h*w, D) with ``"NLC"``; ``norm`` passes each through the final LayerNorm.
        Returns ``(final tokens after the norm, maps)``, or the maps alone with ``intermediates_only``; with
        ``return_prefix_tokens`` each map is a pair ``(map, prefix tokens (B, n, D))``. As timm's."""
        if output_fmt not in FORMATS:
            raise ValueError(f"output_fmt must be one of {FORMATS}, got {output_fmt!r}")
        if x.ndim == 4 and x.shape[0] == 0:
            raise ValueError("an empty batch: forward_intermediates needs at least one image")
        taken, last = take_indices(len(self.blocks), indices)
        b, grid = x.shape[0], self._check_input(x)
        z = self.embed(x)
        maps, prefix = [], []
        for i, block in enumerate(self.blocks[:last + 1] if stop_early else self.blocks):
            z = block(z)
            if i in taken:
                y = self.norm(z) if norm else z
                prefix.append(y[:, :self.num_prefix_tokens])
                y = y[:, self.num_prefix_tokens:]
                maps.append(y.reshape(b, *grid, -1).permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y)
        if return_prefix_tokens and self.num_prefix_tokens:  # as timm: a model without them gives the maps alone
            maps = list(zip(maps, prefix))
        return maps if intermediates_only else (self.norm(z), maps)

    def prune_intermediate_layers(self, indices: int | Sequence[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the blocks after the deepest of ``indices`` (and the final norm, the head): a backbone that runs
        only what its features need. Returns the blocks' indices counted from the start."""
        taken, last = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:last + 1]
        changes: dict[str, object] = {"depth": last + 1}
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm, self.head, self.attn_pool = nn.Identity(), nn.Identity(), None
            if hasattr(self, "head_dist"):
                self.head_dist = nn.Identity()
            changes["num_classes"] = 0
        self.config = dataclasses.replace(self.config, **changes)
        return taken

    def set_input_size(self, img_size: int | tuple[int, int] | None = None,
                       patch_size: int | tuple[int, int] | None = None) -> None:
        """Rebuild the model for another input size and/or patch size, once: E_pos resampled in 2-D to the new
        grid (§3.2; a sin-cos table recomputed), E resampled to the new patch size (FlexiViT's pseudo-inverse)."""
        c, embed = self.config, self.patch_embed
        new_patch = to_2tuple(patch_size) if patch_size is not None else embed.patch_size
        new_img = to_2tuple(img_size) if img_size is not None else to_2tuple(c.img_size)
        new_config = dataclasses.replace(c, img_size=new_img, patch_size=new_patch)  # checked before anything changes
        if new_patch != embed.patch_size:
            if hasattr(embed, "backbone"):
                raise ValueError(f"a hybrid's patches are cells of its CNN's feature map: its patch size "
                                 f"{embed.patch_size} cannot change")
            embed.proj.weight = nn.Parameter(resample_patch_embed(embed.proj.weight.detach(), new_patch),
                                             requires_grad=embed.proj.weight.requires_grad)
            embed.proj.kernel_size = embed.proj.stride = embed.patch_size = new_patch
        old_grid, grid = embed.grid_size, embed.grid_for(new_img)
        if self.pos_embed is not None and grid != old_grid:
            if c.pos_embed == "sincos2d":
                self.register_buffer("pos_embed", self._sincos(grid).to(self.pos_embed), persistent=False)
            else:
                table = resample_pos_embed(self.pos_embed.detach(), grid, c.pos_prefix_tokens, old_grid)
                self.pos_embed = nn.Parameter(table, requires_grad=self.pos_embed.requires_grad)
        embed.grid_size, embed.num_patches = grid, grid[0] * grid[1]
        self.config = new_config


class FeatureExtractor(nn.Module):
    """``create_model(..., features_only=True)``: the model, pruned after its deepest ``out_indices`` block, whose
    forward gives the chosen blocks' feature maps, as timm's ``features_only`` for a ViT (its FeatureGetterNet).
    ``feature_info`` lists each map's channels and reduction (the patch size)."""

    def __init__(self, model: nn.Module, out_indices: int | Sequence[int] = 3, norm: bool = False,
                 output_fmt: str = "NCHW") -> None:
        super().__init__()
        if output_fmt not in FORMATS:
            raise ValueError(f"output_fmt must be one of {FORMATS}, got {output_fmt!r}")
        self.out_indices = model.prune_intermediate_layers(out_indices, prune_norm=not norm)
        self.model, self.norm, self.output_fmt = model, norm, output_fmt
        reduction = model.patch_embed.cell[0]
        self.feature_info = [{"num_chs": model.config.embed_dim, "reduction": reduction, "module": f"blocks.{i}"}
                             for i in self.out_indices]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_intermediates(x, self.out_indices, norm=self.norm, output_fmt=self.output_fmt,
                                                intermediates_only=True)
