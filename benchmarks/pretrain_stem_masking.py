"""`vitkit pretrain` of a hybrid with another masking of its CNN stem, for comparing the two (issue 66, item 1):

    python benchmarks/pretrain_stem_masking.py {masked,input} pretrain --method mae --dataset folder \
        --data-dir cifar10-jpg.zip --time-limit 4 --blr 1e-3 --output runs/stem-VARIANT

masked: vitkit's (model/masked_stem.py): every layer masked, batch norm over the visible positions.
input:  SimMIM's input masking alone: the hidden cells' pixels zero, the stem run as it is (batch norm over every
        position, the hidden zeros included). Neither leaks a hidden pixel; they differ in what the visible tokens'
        features are made of. Then `vitkit probe` each checkpoint (results/self-supervision-hybrid-masking.csv).
"""
import sys

from vitkit.cli.main import main
from vitkit.model import vit
from vitkit.model.masked_stem import cell_mask

if len(sys.argv) < 2 or sys.argv[1] not in ("masked", "input"):
    sys.exit(__doc__)
if sys.argv[1] == "input":
    def input_masked(self, x, visible, grid):  # type: ignore[no-untyped-def]
        if not hasattr(self, "backbone"):
            return self(x)
        return self(x * cell_mask(visible, grid, self.cell).to(x.dtype))

    vit.PatchEmbed.masked = input_masked
sys.exit(main(sys.argv[2:]))
