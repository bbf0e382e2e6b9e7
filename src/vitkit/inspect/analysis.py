"""The paper's analyses as arrays: attention rollout (Fig. 6, App. D.8), mean attention distance (Fig. 7 right,
App. D.7), position-embedding similarity (Fig. 7 centre) and the patch-embedding filters' principal components
(Fig. 7 left). Pure functions of attention tensors / weights, with thin wrappers that run a model."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------------------ from attentions
def readout_rows(rel: torch.Tensor, num_prefix_tokens: int, readout: int | None = None) -> torch.Tensor:
    """(B, T, T) token-to-token weights -> (B, N): how the tokens the head reads draw on the patches. ``readout``
    leading tokens are read (the class token; with DeiT's distillation token, both, averaged as its heads are);
    0: the mean over the patch tokens (GAP; MAP approximately). None: the class token when there is a prefix.
    Register tokens are neither read nor shown: they are prefix tokens past the readout."""
    readout = (1 if num_prefix_tokens else 0) if readout is None else readout
    if readout:
        return rel[:, :readout, num_prefix_tokens:].mean(dim=1)
    return rel[:, num_prefix_tokens:, num_prefix_tokens:].mean(dim=1)


def rollout_from_attentions(attns: list[torch.Tensor], num_prefix_tokens: int, grid: tuple[int, int],
                            residual: float = 0.5, readout: int | None = None) -> torch.Tensor:
    """Abnar & Zuidema (2020): average heads, add the residual as identity, renormalise rows, multiply through the
    layers. Returns (B, gh, gw): how much the output token draws on each patch - the class token, or for GAP
    models the mean over patch tokens (what the head sees); ``readout`` as in ``readout_rows``."""
    B, _, T, _ = attns[0].shape
    eye = torch.eye(T, dtype=torch.float64, device=attns[0].device)
    rollout = eye.expand(B, T, T).clone()
    for a in attns:
        a = a.double().mean(dim=1)  # b h t t -> b t t
        a = residual * eye + (1 - residual) * a
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a @ rollout  # later layers mix what the earlier ones produced
    out = readout_rows(rollout, num_prefix_tokens, readout)
    out = out / out.sum(dim=-1, keepdim=True)
    return out.reshape(B, *grid).float()


def patch_distances(grid: tuple[int, int], patch_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) Euclidean distance in pixels between patch centres, row-major over the grid."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    pos = torch.stack([rows.flatten() * patch_size[0], cols.flatten() * patch_size[1]], dim=1).double()
    return torch.cdist(pos, pos)


def mean_distance_from_attentions(attns: list[torch.Tensor], num_prefix_tokens: int, grid: tuple[int, int],
                                  patch_size: tuple[int, int]) -> np.ndarray:
    """(layers, heads) "attention distance" in pixels: for each patch query, the attention-weighted distance to the
    patch keys (the class token's share left out and the rest renormalised), averaged over queries and images."""
    d = patch_distances(grid, patch_size).to(attns[0].device)
    out = []
    for a in attns:
        p = a.double()[:, :, num_prefix_tokens:, num_prefix_tokens:]  # b h n n
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        out.append((p * d).sum(-1).mean(dim=(0, 2)))  # b h n -> h
    return torch.stack(out).cpu().numpy()


# ------------------------------------------------------------------------------------------------ from weights
def pos_embed_similarity(model) -> np.ndarray:  # type: ignore[no-untyped-def]
    """(gh, gw, gh, gw): cosine similarity of each patch's position embedding with every other one."""
    pe = model.pos_embed
    if pe is None:
        raise ValueError("this model has no position embedding (pos_embed='none')")
    grid = model.patch_embed.grid_size
    e = F.normalize(pe[0, model.config.pos_prefix_tokens:].detach().float(), dim=-1)
    return (e @ e.T).reshape(*grid, *grid).cpu().numpy()


def filter_components(weight: torch.Tensor, n: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """Principal components of the patch-embedding filters ``weight`` (D, C, P, Q): (n, C, P, Q) components and
    the fraction of variance each explains."""
    D = weight.shape[0]
    w = weight.detach().double().reshape(D, -1)
    w = w - w.mean(dim=0, keepdim=True)
    _, s, vt = torch.linalg.svd(w, full_matrices=False)
    k = min(n, vt.shape[0])
    var = (s ** 2) / (s ** 2).sum()
    return vt[:k].reshape(k, *weight.shape[1:]).float().cpu().numpy(), var[:k].float().cpu().numpy()


def patch_embed_filters(model, n: int = 28) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    return filter_components(model.patch_embed.proj.weight, n)


def pixel_filters(model) -> tuple[torch.Tensor, str]:  # type: ignore[no-untyped-def]
    """The weights of the layer that sees the pixels, and what it is: the patch embedding E (Fig. 7 left), or in a
    hybrid (§3.1), whose patch embedding sees CNN feature channels rather than an image, the stem's first conv."""
    backbone = getattr(model.patch_embed, "backbone", None)
    if backbone is None:
        return model.patch_embed.proj.weight, "the patch-embedding filters"
    first = next(m for m in backbone.modules() if isinstance(m, torch.nn.Conv2d))
    return first.weight, f"the filters of the hybrid stem's first convolution ({model.config.hybrid})"


# ------------------------------------------------------------------------------------------------ running a model
@torch.no_grad()
def attention_maps(model, images: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every layer's attention probabilities, (B, heads, T, T), from the exact path."""
    was = model.training
    model.eval()
    _, attns = model.forward_attention(images)
    model.train(was)
    return [a.float().cpu() for a in attns]


def _grid_of(model, images: torch.Tensor) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return model.patch_embed.grid_for((images.shape[-2], images.shape[-1]))


def attention_rollout(model, images: torch.Tensor) -> np.ndarray:  # type: ignore[no-untyped-def]
    """(B, gh, gw) rollout of the output token's attention onto the patches (paper Fig. 6)."""
    attns = attention_maps(model, images)
    return rollout_from_attentions(attns, model.num_prefix_tokens, _grid_of(model, images),
                                   readout=model.num_readout_tokens).numpy()


def mean_attention_distance(model, images: torch.Tensor, batch_size: int = 64) -> np.ndarray:  # type: ignore
    """(layers, heads) mean attention distance in pixels over ``images`` (paper Fig. 7 right)."""
    patch = model.patch_embed.cell
    parts, weights = [], []
    for chunk in images.split(batch_size):
        attns = attention_maps(model, chunk)
        parts.append(mean_distance_from_attentions(attns, model.num_prefix_tokens, _grid_of(model, chunk), patch))
        weights.append(len(chunk))
    return np.average(np.stack(parts), axis=0, weights=weights)


# ------------------------------------------------------------------------------------------------ intermediate layers
def feature_pca(model, images: torch.Tensor, layer: int = -1,  # type: ignore[no-untyped-def]
                components: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The patch tokens of block ``layer`` (``forward_intermediates``), projected on their first ``components``
    principal components over all the images' patches, each scaled to [0, 1]: (B, gh, gw, components) and each
    component's share of the variance. Three components read as RGB: patches the block represents alike share a
    colour (the picture DINOv2's authors draw of its features)."""
    with torch.no_grad():
        (maps,) = model.forward_intermediates(images, indices=[layer], intermediates_only=True, output_fmt="NLC")
    b, n, d = maps.shape
    tokens = maps.reshape(b * n, d).double()
    tokens = tokens - tokens.mean(dim=0)
    _, s, v = torch.linalg.svd(tokens, full_matrices=False)
    k = min(components, v.shape[0])
    proj = tokens @ v[:k].T  # (B N, k)
    lo, hi = proj.min(dim=0).values, proj.max(dim=0).values
    proj = (proj - lo) / (hi - lo).clamp_min(1e-12)
    grid = _grid_of(model, images)
    share = (s**2 / (s**2).sum())[:k]
    return proj.reshape(b, *grid, k).float().cpu().numpy(), share.float().cpu().numpy()
