"""``vitkit reproduce CLAIM``: the paper's claims (data size, position embeddings, transfer, patch size,
self-supervision) as sweeps of ordinary training runs at laptop scale, each with a CSV, a figure and a summary
that says plainly whether the small-scale result agrees with the paper's trend. The claims are data (no torch:
``vitkit reproduce --help`` lists them at once); ``vitkit.reproduce.sweep.sweep`` trains them."""
from .claims import CLAIMS, Claim, Setup
from .runs import Run

__all__ = ["CLAIMS", "Claim", "Run", "Setup"]
