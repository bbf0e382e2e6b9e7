"""Position embeddings: the paper's learned 1-D table, its 2-D resampling (§3.2) and fixed 2-D sin-cos."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import to_2tuple


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: int | tuple[int, int],
    num_prefix_tokens: int = 1,
    old_grid: int | tuple[int, int] | None = None,
    interpolation: str = "bicubic",
) -> torch.Tensor:
    """Paper §3.2: "we perform 2D interpolation of the pre-trained position embeddings, according to their
    location in the original image". Prefix (class) tokens are kept as they are.

    ``pos_embed`` is ``(1, prefix + gh*gw, D)``; ``old_grid`` defaults to a square grid.
    """
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1:
        raise ValueError(f"pos_embed must be (1, tokens, dim), got {tuple(pos_embed.shape)}")
    new_grid = to_2tuple(new_grid)
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    n, dim = grid.shape[1], grid.shape[2]
    if old_grid is None:
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"pos_embed has {n} grid tokens (after {num_prefix_tokens} prefix), not a square grid; "
                             "pass old_grid=(H, W)")
        old_grid = (side, side)
    old_grid = to_2tuple(old_grid)
    if old_grid[0] * old_grid[1] != n:
        raise ValueError(f"old_grid {old_grid} has {old_grid[0] * old_grid[1]} cells but pos_embed has {n} grid tokens")
    if old_grid == new_grid:
        return pos_embed
    return torch.cat([prefix, interpolate_grid(grid, old_grid, new_grid, interpolation)], dim=1)


def interpolate_grid(grid: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple, interpolation: str = "bicubic"
                     ) -> torch.Tensor:
    """The patch rows of a table, (1, gh*gw, D) -> (1, h*w, D), in 2-D. No checks, so that it also runs under
    torch.export with a symbolic ``new_grid`` (an ONNX export with a dynamic H and W resamples in the graph)."""
    dim = grid.shape[2]
    out = grid.reshape(1, *old_grid, dim).permute(0, 3, 1, 2)  # 1 (h w) d -> 1 d h w
    out = F.interpolate(out.float(), size=new_grid, mode=interpolation, align_corners=False,
                        antialias=interpolation in ("bilinear", "bicubic"))
    return out.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(grid.dtype)  # 1 d h w -> 1 (h w) d


def sincos_2d_pos_embed(grid: tuple[int, int], dim: int, num_prefix_tokens: int = 0,
                        temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding as big_vision's ``posemb_sincos_2d``; prefix tokens get zeros.
    Returns ``(1, prefix + gh*gw, dim)``."""
    gh, gw = grid
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                          indexing="ij")
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float32) / max(quarter - 1, 1))
    y = y.flatten()[:, None] * omega[None, :]  # (h w) q
    x = x.flatten()[:, None] * omega[None, :]
    pe = torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)  # (h w) d
    return torch.cat([torch.zeros(num_prefix_tokens, dim), pe], dim=0)[None]
