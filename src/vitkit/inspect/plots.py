"""PNG plots (matplotlib, Agg): training curves, confusion matrix, and the inspection figures."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ..training.runlog import plot_curves  # noqa: E402,F401  (a run's curves; kept importable from here)


NAMED_CLASSES = 60  # a confusion matrix of more classes is drawn at a fixed size, by class index


def plot_confusion(confusion: list[list[int]], classes: list[str], out: Path, title: str = "Confusion matrix") -> None:
    cm = np.asarray(confusion)
    n = len(classes)
    named = n <= NAMED_CLASSES  # half an inch a class, each named; more (ImageNet's 1,000) would be a poster
    side = 0.5 * n if named else 10  # (1,000 classes at half an inch: 500 inches a side, 2.5 billion pixels)
    fig, ax = plt.subplots(figsize=(max(5, side + 2), max(4, side + 1.5)))
    im = ax.imshow(cm, cmap="Blues", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="images")
    if named:
        ax.set_xticks(range(n), classes, rotation=45, ha="right"), ax.set_yticks(range(n), classes)
    ax.set_xlabel("predicted" + ("" if named else " (class index)"))
    ax.set_ylabel("true" + ("" if named else " (class index)")), ax.set_title(title)
    if n <= 20:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if cm[i, j] > cm.max() / 2 else "black")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _image_for_display(image: np.ndarray) -> np.ndarray:
    """(C, H, W) float or uint8 -> (H, W[, 3]) in [0, 1]."""
    img = np.asarray(image, dtype=np.float64)
    img = (img - img.min()) / max(img.max() - img.min(), 1e-8)
    return img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)


def _upsample(grid_map: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    t = torch.as_tensor(grid_map, dtype=torch.float32)[None, None]
    return F.interpolate(t, size=hw, mode="bilinear", align_corners=False)[0, 0].numpy()


def share_scale(heat: np.ndarray) -> tuple[np.ndarray, float]:
    """``heat`` as shares (summing to 1) and the top of its colour scale: its peak, but at least 4x the uniform
    share, so a uniform map is drawn in the scale's lower quarter instead of all in its top colour."""
    share = heat / max(float(heat.sum()), 1e-12)
    return share, max(float(share.max()), 4.0 / share.size)


def plot_overlay(image: np.ndarray, heat: np.ndarray, out: Path, title: str) -> None:
    """The image beside it with ``heat`` (a patch-grid map of attention shares, summing to 1) laid over it: the
    paper's Fig. 6 style. The colours run from 0 to at least 4x the uniform share (1 / patches): a map scaled to its
    own min and max makes a near-uniform one look as sharply focused as any, so the title gives its peak too."""
    img = _image_for_display(image)
    heat, vmax = share_scale(heat)
    h = _upsample(heat, img.shape[:2])
    title = f"{title}\npeak {float(heat.max()) * heat.size:.1f}x the uniform share"
    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    axes[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
    axes[0].set_title("input"), axes[0].axis("off")
    axes[1].imshow(img, cmap="gray" if img.ndim == 2 else None)
    im = axes[1].imshow(h, cmap="jet", alpha=0.5, vmin=0.0, vmax=vmax)
    axes[1].set_title(title), axes[1].axis("off")
    fig.colorbar(im, ax=axes[1], fraction=0.046, label=f"attention share (uniform: 1/{heat.size})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _tiles(n: int, cols: int, w: float, h: float):  # type: ignore[no-untyped-def]
    """A figure with ``n`` panels in rows of ``cols``, axes off: (figure, axes grid, [(index, axes), ...])."""
    cols = min(n, cols)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows + 0.6), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    return fig, axes, list(enumerate(axes.flat))[:n]


def plot_attention_heads(image: np.ndarray, maps: dict[str, np.ndarray], out: Path, layer: int) -> None:
    """Each head's attention from the output token(s) to the patches, one panel per head, over the image: ``maps``
    {token name: (heads, gh, gw)}, one group of rows per token (DeiT's distillation token beside the class token)."""
    img = _image_for_display(image)
    heads = next(iter(maps.values())).shape[0]
    panels_of = [(name, h) for name in maps for h in range(heads)]
    fig, axes, panels = _tiles(len(panels_of), min(heads, 6), 2.4, 2.4)
    for i, ax in panels:
        name, h = panels_of[i]
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
        im = ax.imshow(_upsample(maps[name][h], img.shape[:2]), cmap="jet", alpha=0.5)
        ax.set_title(f"{name} · head {h}" if len(maps) > 1 else f"head {h}", fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.02, label="attention")
    fig.suptitle(f"Layer {layer}: attention of the {' and the '.join(maps)} to each patch")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_attention_distance(dist: np.ndarray, out: Path, title: str = "Mean attention distance",
                            uniform: float | None = None) -> None:
    """Paper Fig. 7 (right): one dot per head, network depth on x; ``uniform`` (the distance if every patch
    attended to all patches equally) as a dashed line, so local heads stand out below it."""
    layers, heads = dist.shape
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if uniform is not None:
        ax.axhline(uniform, color="gray", ls="--", lw=1, label="uniform attention")
    for h in range(heads):
        ax.scatter(np.arange(1, layers + 1), dist[:, h], s=18, label=f"head {h}")
    ax.set_xlabel("network depth (layer)"), ax.set_ylabel("mean attention distance (pixels)")
    ax.set_title(title), ax.grid(alpha=0.3)
    ax.set_xticks(range(1, layers + 1))
    if heads <= 16 or uniform is not None:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_pos_embed_similarity(sim: np.ndarray, out: Path) -> None:
    """Paper Fig. 7 (centre): for each patch (row, col) a small grid of its similarity to all patches."""
    gh, gw = sim.shape[:2]
    fig, axes = plt.subplots(gh, gw, figsize=(min(1.0 * gw, 12) + 1, min(1.0 * gh, 12) + 0.5), squeeze=False)
    for r in range(gh):
        for c in range(gw):
            im = axes[r, c].imshow(sim[r, c], vmin=-1, vmax=1, cmap="viridis")
            axes[r, c].set_xticks([]), axes[r, c].set_yticks([])
            if c == 0:
                axes[r, c].set_ylabel(str(r + 1), fontsize=7)
            if r == gh - 1:
                axes[r, c].set_xlabel(str(c + 1), fontsize=7)
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.02, label="cosine similarity")
    fig.suptitle("Position embedding similarity (input patch row / column)")
    fig.savefig(out, dpi=100, bbox_inches="tight")  # the colour bar's label lies outside the axes' box
    plt.close(fig)


def plot_filters(components: np.ndarray, variance: np.ndarray, out: Path,
                 what: str = "the patch-embedding filters") -> None:
    """Paper Fig. 7 (left): the principal components of the patch-embedding filters (or ``what``) as tiles."""
    fig, _, panels = _tiles(len(components), 7, 1.4, 1.5)
    for i, ax in panels:
        ax.imshow(_image_for_display(components[i]), cmap="gray" if components.shape[1] == 1 else None)
        ax.set_title(f"{100 * variance[i]:.1f}%", fontsize=7)
    fig.suptitle(f"Principal components of {what} (% variance)")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_explanations(image: np.ndarray, maps: dict[str, np.ndarray], out: Path, title: str) -> None:
    """The image as the model saw it, then each method's map (image resolution, [0, 1]) laid over it, side by side
    with one colour bar; ``title`` (the class explained and its probability) on top."""
    img = _image_for_display(image)
    fig, axes = plt.subplots(1, 1 + len(maps), figsize=(2.6 * (1 + len(maps)), 3.2), squeeze=False)
    axes = axes[0]
    for ax in axes:
        ax.axis("off")
    axes[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
    axes[0].set_title("input (as the model saw it)", fontsize=9)
    for ax, (name, heat) in zip(axes[1:], maps.items()):
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
        im = ax.imshow(heat, cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
        ax.set_title(name, fontsize=9)
    if maps:
        fig.colorbar(im, ax=list(axes), fraction=0.015, label="relevance (low - high)")
    fig.suptitle(title)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_faithfulness(rows: list[dict], out: Path, title: str = "Faithfulness") -> None:
    """Deletion (lower is better) and insertion (higher is better) areas per method, random orders as a line."""
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.6 * len(rows) + 3), 3.6))
    for ax, key, better in ((axes[0], "deletion_auc", "lower is better"), (axes[1], "insertion_auc",
                                                                            "higher is better")):
        ax.bar(names, [r[key] for r in rows], color="#3b6fd8")
        ax.axhline(rows[0]["random_" + key], color="gray", ls="--", lw=1, label="random order")
        ax.set_title(f"{key.split('_')[0]} AUC ({better})", fontsize=10)
        ax.set_ylabel("area (the axis does not start at 0)", fontsize=8)
        values = [r[key] for r in rows] + [rows[0]["random_" + key]]
        pad = max(0.02, 0.25 * (max(values) - min(values)))  # the differences are the point: not from 0
        ax.set_ylim(max(0.0, min(values) - pad), min(1.0, max(values) + pad))
        ax.tick_params(axis="x", labelrotation=20, labelsize=8), ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_features(image: np.ndarray, pca: np.ndarray, share: np.ndarray, out: Path, layer: int) -> None:
    """The image beside the first three principal components of one block's patch tokens as RGB, at the image's
    size (each patch a flat block of colour: the map has one value per patch)."""
    img = _image_for_display(image)
    rgb = np.repeat(np.repeat(pca, img.shape[0] // pca.shape[0], axis=0), img.shape[1] // pca.shape[1], axis=1)
    fig, axes = plt.subplots(1, 2, figsize=(8, 4 * img.shape[0] / img.shape[1] + 0.6))
    axes[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
    axes[0].set_title(f"input, {img.shape[0]}x{img.shape[1]}"), axes[0].axis("off")
    axes[1].imshow(rgb[..., :3] if rgb.shape[-1] >= 3 else rgb[..., 0], cmap=None if rgb.shape[-1] >= 3 else "gray")
    explained = ", ".join(f"{100 * s:.0f}%" for s in share)
    axes[1].set_title(f"block {layer}: patch tokens, first principal components as RGB\n"
                      f"({pca.shape[0]}x{pca.shape[1]} patches; variance {explained})", fontsize=9)
    axes[1].axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
