"""MkDocs hook: the learning path's two pictures of the idea, drawn with matplotlib at every build (not pasted), the
shapes read off the real model:

- ``figures/patch-grid.png``: a photo cut into its 14 x 14 grid of 16 x 16 patches, and the first patches as the
  sequence the Transformer reads;
- ``figures/vit-diagram.png``: the model as the paper's Fig. 1 draws it, with the tensor shape at each arrow.
"""
from __future__ import annotations

import io
from functools import lru_cache

from pages import generated_file

NAME = "vit_base_patch16_224"


def on_files(files, config):  # type: ignore[no-untyped-def]
    for name, draw in (("patch-grid.png", patch_grid), ("vit-diagram.png", vit_diagram)):
        files.append(generated_file(config, f"figures/{name}", draw()))
    return files


def _photo():  # type: ignore[no-untyped-def]
    """The 224 x 224 crop of scikit-learn's sample photo that "shape by shape" uses, (224, 224, 3) uint8."""
    from sklearn.datasets import load_sample_image

    return load_sample_image("china.jpg")[100:324, 200:424]


def _png(fig) -> bytes:  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


@lru_cache(maxsize=1)  # every language of the site is a build of its own
def patch_grid() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    photo, p = _photo(), 16
    n = photo.shape[0] // p
    fig = plt.figure(figsize=(10, 4.6))
    grid = GridSpec(3, 12, figure=fig, width_ratios=[1] * 12, height_ratios=[1, 1, 1], wspace=0.15, hspace=0.35)
    ax = fig.add_subplot(grid[:, :5])
    ax.imshow(photo)
    for k in range(1, n):
        ax.axhline(k * p - 0.5, color="white", lw=0.8)
        ax.axvline(k * p - 0.5, color="white", lw=0.8)
    ax.set_title(f"{photo.shape[0]} x {photo.shape[1]} image: {n} x {n} = {n * n} patches of {p} x {p} pixels")
    ax.set_xticks([]), ax.set_yticks([])
    for i in range(18):  # the first patches in raster order: row 0, then row 1
        r, c = divmod(i, n)
        sub = fig.add_subplot(grid[i // 6, 6 + i % 6])
        sub.imshow(photo[r * p:(r + 1) * p, c * p:(c + 1) * p])
        sub.set_xticks([]), sub.set_yticks([])
        sub.set_title(f"$x_p^{{{i + 1}}}$", fontsize=9)
    fig.text(0.72, 0.02, f"... and on to $x_p^{{{n * n}}}$; each patch flattened is {p} * {p} * 3 = "
             f"{p * p * 3} numbers", ha="center", fontsize=9)
    return _png(fig)


def _shapes() -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the diagram names, from ViT-B/16 run on PyTorch's meta device (no memory, no
    weights): what the model computes, not what the picture claims."""
    import torch

    import vitkit

    with torch.device("meta"):
        m = vitkit.create_model(NAME)
        x = torch.empty(1, 3, 224, 224)
        tokens = m.patch_embed(x)
        z0 = m.embed(x)
        zl = m.blocks(z0)
        y = m.norm(zl)[:, 0]
        logits = m.head(y)
    c = m.config
    return {"x": tuple(x.shape), "patches": (1, tokens.shape[1], c.patch_size ** 2 * c.in_chans),
            "tokens": tuple(tokens.shape), "z0": tuple(z0.shape), "pos": tuple(m.pos_embed.shape),
            "zL": tuple(zl.shape), "y": tuple(y.shape), "logits": tuple(logits.shape), "depth": (c.depth,),
            "heads": (c.num_heads,), "mlp": (int(c.embed_dim * c.mlp_ratio),)}


@lru_cache(maxsize=1)
def vit_diagram() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    s = _shapes()
    fig, ax = plt.subplots(figsize=(10, 7.4))
    ax.set_xlim(0, 10), ax.set_ylim(0, 13.2), ax.axis("off")

    def box(x, y, w, h, text, color, size=10):  # type: ignore[no-untyped-def]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.08", fc=color, ec="#333"))
        ax.text(x, y, text, ha="center", va="center", fontsize=size)

    def arrow(y0, y1, label, x=3.2):  # type: ignore[no-untyped-def]
        ax.annotate("", (x, y1), (x, y0), arrowprops=dict(arrowstyle="->", lw=1.4))
        ax.text(x + 0.15, (y0 + y1) / 2, label, va="center", fontsize=9, family="monospace", color="#1a4d8f")

    # the main path, bottom to top as in the paper's Fig. 1
    n, flat = s["patches"][1:]
    box(3.2, 0.6, 4.2, 0.7, "image $x$", "#fde9c9")
    arrow(0.95, 1.75, f"{s['x']}")
    box(3.2, 2.1, 4.2, 0.7, f"cut into N = {n} patches $x_p$, each flattened\nto $P^2 C$ = {flat} numbers",
        "#fde9c9", 9)
    arrow(2.45, 3.25, f"{s['patches']}")
    box(3.2, 3.6, 4.2, 0.7, "linear projection $E$  (Eq. 1)", "#f9d3d3")
    arrow(3.95, 4.75, f"{s['tokens']}")
    box(3.2, 5.1, 4.2, 0.7, "prepend the class token $x_{class}$", "#f9d3d3")
    arrow(5.45, 6.25, f"{s['z0']}")
    box(3.2, 6.6, 4.2, 0.7, f"+ position embedding $E_{{pos}}$ {s['pos']}", "#f9d3d3")
    arrow(6.95, 7.75, f"$z_0$ {s['z0']}")
    box(3.2, 8.3, 4.2, 1.0, f"Transformer encoder\n{s['depth'][0]} blocks (Eq. 2, 3)", "#d8e8f8", 11)
    arrow(8.8, 9.65, f"$z_L$ {s['zL']}")
    box(3.2, 10.0, 4.2, 0.7, "LayerNorm of the class token: $y = LN(z_L^0)$  (Eq. 4)", "#d8f0d8", 9)
    arrow(10.35, 11.15, f"$y$ {s['y']}")
    box(3.2, 11.5, 4.2, 0.7, "head (MLP in pre-training, linear to fine-tune)", "#d8f0d8", 9)
    arrow(11.85, 12.55, f"logits {s['logits']}")
    ax.text(3.2, 12.85, "class", ha="center", fontsize=10)

    # one encoder block, as Fig. 1 (right) draws it
    bx = 8.1
    ax.add_patch(FancyBboxPatch((6.7, 2.2), 2.8, 9.2, boxstyle="round,pad=0.1", fc="#f2f7fd", ec="#333", ls="--"))
    ax.text(bx, 11.1, f"one block, x {s['depth'][0]}", ha="center", fontsize=10, weight="bold")
    d, heads = s["z0"][2], s["heads"][0]
    steps = [(3.2, "LayerNorm"), (4.6, f"multi-head self-attention\n{heads} heads, $D_h$ = {d // heads}"),
             (6.0, "+ (residual)"), (7.4, "LayerNorm"), (8.8, f"MLP: {d} -> {s['mlp'][0]} -> {d}\nGELU between"),
             (10.2, "+ (residual)")]
    for y, text in steps:
        box(bx, y, 2.4, 0.8 if "\n" in text else 0.55, text, "#ffffff", 8.5)
    for (y0, _), (y1, _) in zip(steps, steps[1:]):
        ax.annotate("", (bx, y1 - 0.42), (bx, y0 + 0.42), arrowprops=dict(arrowstyle="->", lw=1))
    ax.text(bx, 2.55, f"in and out: {s['z0']}", ha="center", fontsize=8, family="monospace", color="#1a4d8f")
    ax.annotate("", (6.6, 8.3), (5.45, 8.3), arrowprops=dict(arrowstyle="-", ls=":", lw=1))
    return _png(fig)
