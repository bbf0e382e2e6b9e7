"""Flags shared by several commands."""
from __future__ import annotations

import argparse
import re
from typing import Any


def parse_image_size(values: list[str] | str) -> int | tuple[int, int]:
    """``224`` -> 224; ``224x160``, ``224,160`` or ``224 160`` -> (224, 160) (height, width)."""
    text = " ".join([values] if isinstance(values, str) else values).strip().lower()
    m = re.fullmatch(r"(\d+)(?:\s*[x, ]\s*(\d+))?", text)
    if not m or int(m.group(1)) == 0 or (m.group(2) and int(m.group(2)) == 0):
        raise argparse.ArgumentTypeError(f"expected a size such as 224, 224x160 or 224 160 (height width), got "
                                         f"{text!r}")
    h, w = int(m.group(1)), int(m.group(2) or m.group(1))
    return h if h == w else (h, w)


class ImageSize(argparse.Action):
    """``--img-size 224``, ``--img-size 224x160`` or ``--img-size 224 160``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(nargs="+", metavar="H [W]")
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option: str | None = None) -> None:
        try:
            setattr(ns, self.dest, parse_image_size(values))
        except argparse.ArgumentTypeError as e:
            parser.error(f"{option}: {e}")


# flag -> ViTConfig key; these build the ``model_args`` overrides
MODEL_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--img-size": ("img_size", ImageSize, "input resolution: 224, or H W / HxW for a non-square one"),
    "--patch-size": ("patch_size", int, "patch size P"),
    "--embed-dim": ("embed_dim", int, "hidden size D"),
    "--depth": ("depth", int, "number of layers L"),
    "--num-heads": ("num_heads", int, "attention heads"),
    "--mlp-ratio": ("mlp_ratio", float, "MLP size / D"),
    "--pool": ("pool", str, "cls | gap | map"),
    "--pos-embed": ("pos_embed", str, "learn | sincos2d | none"),
    "--num-classes": ("num_classes", int, "classes of the head"),
    "--in-chans": ("in_chans", int, "image channels"),
    "--hybrid": ("hybrid", str, "CNN stem for the paper's hybrid model, e.g. resnetv2:3,4,9 or resnet18:1 "
                                "(with --patch-size 1)"),
    "--reg-tokens": ("reg_tokens", int, "register tokens (Darcet et al. 2024; docs: After the paper)"),
    "--layer-scale": ("layer_scale", float, "LayerScale with this starting gain, e.g. 1e-5 (CaiT, DeiT III)"),
    "--qk-norm": ("qk_norm", bool, "LayerNorm on each head's queries and keys (ViT-22B)"),
    "--drop-path": ("drop_path_rate", float, "stochastic depth rate"),
    "--drop": ("drop_rate", float, "dropout before the head"),
}


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads (default: PyTorch's, one per core; batches of images split well across them)")


def apply_threads(ns: argparse.Namespace) -> None:
    if getattr(ns, "threads", None):
        import sys

        import torch

        from ..runtime.threads import usable_cores

        if ns.threads > usable_cores():
            print(f"--threads {ns.threads}: {usable_cores()}, the cores this process may use (more threads wait for "
                  "each other)", file=sys.stderr)
        torch.set_num_threads(min(ns.threads, usable_cores()))


def add_model_flags(p: argparse.ArgumentParser, with_model: bool = True) -> None:
    g = p.add_argument_group("model")
    if with_model:
        g.add_argument("--model", default=argparse.SUPPRESS, help="preset name (vitkit.list_models())")
    for flag, (key, typ, help_) in MODEL_FLAGS.items():
        kind = ({"action": typ} if typ is ImageSize else {"action": "store_const", "const": True} if typ is bool
                else {"type": typ})
        g.add_argument(flag, dest=f"model__{key}", default=argparse.SUPPRESS, help=help_, **kind)


def model_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    return {k[len("model__"):]: v for k, v in vars(ns).items() if k.startswith("model__")}


def add_data_flags(p: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    from ..data import DATASETS

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default=default, help="dataset (default: digits)")
    g.add_argument("--data-dir", default=argparse.SUPPRESS, help="where the dataset lies (folder or .zip)")
    g.add_argument("--download", action="store_true", default=argparse.SUPPRESS,
                   help="download with torchvision (needs internet)")
    g.add_argument("--skip-bad-images", action="store_true", default=argparse.SUPPRESS,
                   help="skip (and count) undecodable images in a folder instead of stopping")
    g.add_argument("--cache-dir", default=argparse.SUPPRESS, help="decoded-dataset cache (default ~/.cache/vitkit)")
    g.add_argument("--classes", type=class_names, metavar="A,B,...", default=argparse.SUPPRESS,
                   help="only these classes' images, by name, joined by commas (e.g. cat,dog,frog of CIFAR-10; a "
                        "folder's class folder names; digits 0-9)")


def class_names(text: str) -> list[str]:
    """``--classes a,b,c``: the names, spaces around them dropped."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected class names joined by commas, got {text!r}")
    return names


def load_data_from_args(ns: argparse.Namespace, default: str = "digits",  # type: ignore[no-untyped-def]
                        crop: dict[str, Any] | None = None, mode: str = "auto"):
    from ..data.datasets import default_cache_dir, load_dataset

    return load_dataset(getattr(ns, "dataset", None) or default, getattr(ns, "data_dir", None),
                        getattr(ns, "download", False), getattr(ns, "skip_bad_images", False),
                        getattr(ns, "cache_dir", None) or default_cache_dir(), crop=crop, mode=mode,
                        classes=getattr(ns, "classes", None))


def add_weights_flags(p: argparse.ArgumentParser) -> None:
    """``--checkpoint PATH`` or ``--model NAME.TAG [--pretrained [SOURCE]]``: the weights a command runs."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--checkpoint", help="weights: a vitkit folder, or a timm / Hugging Face / JAX file or folder")
    g.add_argument("--model", dest="weights_model",
                   help="registered pretrained weights, NAME.TAG (`vitkit models --pretrained`); downloaded once")
    p.add_argument("--pretrained", nargs="?", const=True, default=True, metavar="SOURCE",
                   help="with --model: its registered weights (the default), or a Hub id / URL / file holding them")


def load_weights(args: argparse.Namespace, onnx: bool = False, **overrides: Any) -> Any:
    """The model ``add_weights_flags`` asked for; with ``onnx``, an ``.onnx`` file from ``vitkit export`` too (run
    by onnxruntime: logits only; flags it cannot honour are refused here, before any data is loaded)."""
    if getattr(args, "checkpoint", None):
        from ..interop import load

        if str(args.checkpoint).endswith(".onnx"):
            if not onnx:
                raise ValueError(f"{args.checkpoint}: this command needs the PyTorch weights (an ONNX file gives "
                                 "logits only: `vitkit eval` and `vitkit predict` run it); pass the run or "
                                 "checkpoint folder it was exported from")
            if overrides:
                raise ValueError(f"{args.checkpoint}: an ONNX file runs at the size it was exported at; "
                                 f"{', '.join(overrides)} cannot be changed")
            if getattr(args, "device", "auto") not in ("auto", "cpu"):
                raise ValueError(f"{args.checkpoint}: ONNX files run on the CPU here (onnxruntime's CPU provider); "
                                 f"--device {args.device} needs the PyTorch weights")
            if getattr(args, "precision", "fp32") not in ("fp32", "auto"):
                raise ValueError(f"{args.checkpoint}: an ONNX file runs in the number format it was exported in "
                                 f"(fp32, or int8 with --int8); --precision {args.precision} needs the PyTorch "
                                 "weights")
            from ..serving.onnx import OnnxModel

            return OnnxModel(args.checkpoint)

        return load(args.checkpoint, **overrides)
    from .. import create_model

    return create_model(args.weights_model, pretrained=args.pretrained, **overrides)


def weights_name(args: argparse.Namespace) -> str:
    return args.checkpoint or args.weights_model
