"""Flags shared by several commands."""
from __future__ import annotations

import argparse
from typing import Any

# flag -> ViTConfig key; these build the ``model_args`` overrides
MODEL_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--img-size": ("img_size", int, "input resolution (int)"),
    "--patch-size": ("patch_size", int, "patch size P"),
    "--embed-dim": ("embed_dim", int, "hidden size D"),
    "--depth": ("depth", int, "number of layers L"),
    "--num-heads": ("num_heads", int, "attention heads"),
    "--mlp-ratio": ("mlp_ratio", float, "MLP size / D"),
    "--pool": ("pool", str, "cls | gap"),
    "--pos-embed": ("pos_embed", str, "learn | sincos2d | none"),
    "--num-classes": ("num_classes", int, "classes of the head"),
    "--in-chans": ("in_chans", int, "image channels"),
    "--hybrid": ("hybrid", str, "CNN stem for the paper's hybrid model, e.g. resnet18:1 (with --patch-size 1)"),
    "--drop-path": ("drop_path_rate", float, "stochastic depth rate"),
    "--drop": ("drop_rate", float, "dropout before the head"),
}


def add_model_flags(p: argparse.ArgumentParser, with_model: bool = True) -> None:
    g = p.add_argument_group("model")
    if with_model:
        g.add_argument("--model", default=argparse.SUPPRESS, help="preset name (vitkit.list_models())")
    for flag, (key, typ, help_) in MODEL_FLAGS.items():
        g.add_argument(flag, dest=f"model__{key}", type=typ, default=argparse.SUPPRESS, help=help_)


def model_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    return {k[len("model__"):]: v for k, v in vars(ns).items() if k.startswith("model__")}


def add_data_flags(p: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    from ..data.datasets import DATASETS

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default=default, help="dataset (default: digits)")
    g.add_argument("--data-dir", default=argparse.SUPPRESS, help="where the dataset lies (folder or .zip)")
    g.add_argument("--download", action="store_true", default=argparse.SUPPRESS,
                   help="download with torchvision (needs internet)")
    g.add_argument("--skip-bad-images", action="store_true", default=argparse.SUPPRESS,
                   help="skip (and count) undecodable images in a folder instead of stopping")
    g.add_argument("--cache-dir", default=argparse.SUPPRESS, help="decoded-dataset cache (default ~/.cache/vitkit)")


def load_data_from_args(ns: argparse.Namespace, default: str = "digits"):  # type: ignore[no-untyped-def]
    from ..data.datasets import default_cache_dir, load_dataset

    return load_dataset(getattr(ns, "dataset", None) or default, getattr(ns, "data_dir", None),
                        getattr(ns, "download", False), getattr(ns, "skip_bad_images", False),
                        getattr(ns, "cache_dir", None) or default_cache_dir())
