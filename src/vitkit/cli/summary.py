"""``vitkit summary``: torchinfo's layer table and parameter count, and the forward FLOPs counted from the config."""
from __future__ import annotations

import argparse

from .common import add_model_flags, model_overrides


def add_parser(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--checkpoint", default=None, help="a save_pretrained folder instead of --model")
    p.add_argument("--depth-shown", type=int, default=3, help="module nesting shown in the table")
    p.add_argument("-b", "--batch-size", type=int, default=1)


def run(args: argparse.Namespace) -> int:
    import torchinfo

    from ..model import create_model, flops_per_image, from_pretrained
    from ..model.config import to_2tuple

    if args.checkpoint:
        model = from_pretrained(args.checkpoint, **model_overrides(args))
    else:
        model = create_model(getattr(args, "model", "vit_base_patch16_224"), **model_overrides(args))
    c = model.config
    print(f"config: {c.to_dict()}")
    stats = torchinfo.summary(model, input_size=(args.batch_size, c.in_chans, *to_2tuple(c.img_size)),
                              depth=args.depth_shown, col_names=("output_size", "num_params"), verbose=0)
    # torchinfo counts a linear layer's multiply-adds once per image, not once per token (201 M for ViT-B/16
    # instead of 17.6 G), so its total is left out and the matmuls are counted from the config instead
    print("\n".join(line for line in str(stats).splitlines() if not line.startswith("Total mult-adds")))
    print(f"parameters: {model.num_params:,}")
    print(f"forward: {flops_per_image(c) / 1e9:.2f} GFLOP per image (2 x the multiply-adds of the matmuls and the "
          "attention)")
    return 0
