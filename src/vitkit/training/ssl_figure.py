"""The figure a self-supervised run draws at each evaluation (``recon/epoch-NNN.png`` in its run folder) and
``vitkit inspect reconstruct`` draws for a checkpoint: a few validation images, each as it is, as the model saw it
(MAE: the masked patches grey; MPP: the corrupted ones grey) and as it predicted it (MAE: the reconstruction, its
per-patch normalisation undone; MPP: each corrupted patch in the mean colour it predicted)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import torch
import torch.nn as nn

from ..model.ssl import MaskedAutoencoder, mpp_picture, patchify, unpatchify

FIGURE_IMAGES = 4  # images a figure shows
FIGURE_SEED = 7  # the masks a figure draws: the same every epoch, so the figures compare


@torch.no_grad()
def ssl_pictures(module: nn.Module, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(original, seen, predicted) images in [0, 1] (B, C, H, W) and the batch's loss, for standardised ``x`` with
    the standardisation ``mean`` and ``std`` (C,) in 0-1 units."""
    was = module.training
    module.eval()
    gen = torch.Generator().manual_seed(FIGURE_SEED)
    m, s = mean.view(1, -1, 1, 1).to(x), std.view(1, -1, 1, 1).to(x)
    raw = (x * s + m).clamp(0, 1)
    if isinstance(module, MaskedAutoencoder):
        out = module(x, generator=gen)
        filled = (module.reconstruct(x, out) * s + m).clamp(0, 1)
        pe = module.encoder.patch_embed
        patches = patchify(raw, pe.cell)  # (a hybrid's token: its cell of the image)
        seen = unpatchify(torch.where(out.mask[..., None], torch.full_like(patches, 0.5), patches), pe.cell,
                          pe.grid_size, pe.in_chans)
    else:
        out = module(x, raw, generator=gen)
        seen, filled = mpp_picture(module, raw, out)
    module.train(was)
    return raw, seen, filled, float(out.loss)


def how_filled(module: nn.Module) -> str:
    """What the figure's predicted patches are made of, for its title: what is the model's and what is not."""
    if isinstance(module, MaskedAutoencoder) and module.norm_pix_loss:
        return ("the hidden patches' brightness and contrast are the visible patches' average (the model predicts "
                "each patch's pattern, not its level)")
    if isinstance(module, MaskedAutoencoder):
        return "the hidden patches as predicted, in pixels"
    return "each corrupted patch in the colour the model predicted"


def draw(raw: torch.Tensor, seen: torch.Tensor, filled: torch.Tensor, path: Path, title: str) -> None:
    """A row per image: original, what the model saw, what it predicted."""
    import matplotlib  # matplotlib's import (≈0.5 s): only where a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    n = len(raw)
    fig, axes = plt.subplots(n, 3, figsize=(6, 2 * n + 0.4), squeeze=False)
    for i in range(n):
        for j, (img, name) in enumerate(((raw, "image"), (seen, "what it saw"), (filled, "what it predicted"))):
            a = img[i].float().cpu()
            axes[i][j].imshow(a[0] if a.shape[0] == 1 else a.permute(1, 2, 0), cmap="gray" if a.shape[0] == 1 else None,
                              vmin=0, vmax=1, interpolation="nearest")
            axes[i][j].set_xticks([])
            axes[i][j].set_yticks([])
            if i == 0:
                axes[i][j].set_title(name, fontsize=9)
    # each line wrapped to the figure's width (the reconstruction's wording was cut off at the edge)
    fig.suptitle("\n".join(textwrap.fill(line, 80) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
