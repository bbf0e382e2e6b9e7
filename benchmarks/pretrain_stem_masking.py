"""`vitkit pretrain` of a hybrid with another way of keeping its CNN stem from the hidden pixels, for comparing them
(issue 66, item 1):

    python benchmarks/pretrain_stem_masking.py {cells,masked,input} pretrain --method mae --dataset folder \
        --data-dir cifar10-jpg.zip --time-limit 4 --blr 1e-3 --output runs/stem-VARIANT

cells:  vitkit's MAE (PatchEmbed.visible_cells): each visible cell through the stem alone, zero-padded; a quarter
        of the pixels at 75% masking.
masked: the whole image through the stem, every layer masked, batch norm over the visible positions
        (model/masked_stem.py; vitkit's MPP, whose encoder reads every token).
input:  SimMIM's input masking alone: the hidden cells' pixels zero, the stem run as it is (batch norm over every
        position, the hidden zeros included).
None leaks a hidden pixel; they differ in what the visible tokens' features are made of and in what they cost.
Then `vitkit probe` each checkpoint (results/self-supervision-hybrid-masking.csv).
"""
import sys

import torch

from vitkit.cli.main import main
from vitkit.model import vit
from vitkit.model.masked_stem import cell_mask

VARIANTS = ("cells", "masked", "input")
if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
    sys.exit(__doc__)


def whole_image(self, x, keep, grid):  # type: ignore[no-untyped-def]
    """The visible tokens cut from the stem's feature map of the whole (masked) image."""
    visible = torch.zeros(x.shape[0], grid[0] * grid[1], dtype=torch.bool, device=x.device).scatter_(1, keep, True)
    if sys.argv[1] == "masked":
        tokens = self.masked(x, visible, grid)
    else:
        tokens = self(x * cell_mask(visible, grid, self.cell).to(x.dtype))
    return torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))


if sys.argv[1] != "cells":
    vit.PatchEmbed.visible_cells = whole_image
sys.exit(main(sys.argv[2:]))
