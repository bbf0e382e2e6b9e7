"""``vitkit pretrain --method {mpp,mae}``: learn from the images alone (no label is read), with every flag of ``vitkit
train`` (data, budget, resume, torchrun) and the method's own; the run folder's best/ and last/ hold the encoder as
an ordinary vitkit checkpoint (``vitkit train --init RUN/best`` fine-tunes it) and the objective's parts beside it."""
from __future__ import annotations

import argparse
import sys

from . import train


def add_parser(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("self-supervision")
    g.add_argument("--method", dest="objective", choices=("mpp", "mae"), required=True,
                   help="mpp: the paper's masked patch prediction (Appendix B.1.2: 50%% of the patch embeddings "
                        "corrupted, their 3-bit mean colours predicted); mae: He et al.'s masked autoencoder (75%% "
                        "of the patches hidden from the encoder, their pixels reconstructed by a light decoder)")
    g.add_argument("--mask-ratio", dest="mask_ratio", type=float, default=argparse.SUPPRESS,
                   help="the share of each image's patches masked (mpp 0.5, mae 0.75)")
    g.add_argument("--mpp-target", dest="mpp_target", choices=("mean", "4x4", "l2"), default=argparse.SUPPRESS,
                   help="mpp: the 3-bit mean colour (512 classes, the paper's), a 4x4 downsized patch in 3-bit "
                        "colours, or the patch's pixels by L2 regression")
    g.add_argument("--norm-pix-loss", dest="norm_pix_loss", action=argparse.BooleanOptionalAction,
                   default=argparse.SUPPRESS, help="mae: each target patch standardised by its own mean and "
                                                  "variance (He et al.'s; the default)")
    for flag, dest, what in (("--decoder-width", "decoder_width", "width (default: He et al.'s 512 for encoders "
                                                                   "of 384 wide and more, half the encoder's width "
                                                                   "for smaller ones)"),
                             ("--decoder-depth", "decoder_depth", "blocks (default: He et al.'s 8 for encoders of "
                                                                  "384 wide and more, 2 for smaller ones)"),
                             ("--decoder-heads", "decoder_heads", "attention heads (default: one per 32 of its "
                                                                  "width, He et al.'s 16 at 512)")):
        g.add_argument(flag, dest=dest, type=int, default=argparse.SUPPRESS, help=f"mae: the decoder's {what}")
    g.add_argument("--blr", type=float, default=argparse.SUPPRESS,
                   help="the learning rate per 256 images a step (lr = blr x global batch / 256; the recipes': mae "
                        "1.5e-4, He et al.'s; mpp 1e-3). At a budget of tens of epochs MAE does far better with "
                        "1e-3 (measured: docs/results.md, Learning without labels)")
    train.add_parser(p)
    for action in p._actions:
        if action.dest in LABELS_ONLY:  # what reads labels has no meaning here: not listed, and refused where given
            action.help = argparse.SUPPRESS
        elif action.dest == "init":  # train's --init speaks of fine-tuning; here it continues a pre-training
            action.help = ("continue pre-training from weights: a `vitkit pretrain` checkpoint (its encoder, and its "
                           "decoder or head where they are of this --method), a Hugging Face ViTMAE folder, or any "
                           "encoder --init of vitkit train reads (a new decoder); the flags say what changes")


# train's flags that act on labels or on a fine-tuned head; pre-training reads no labels and has no head to tune
LABELS_ONLY = ("smoothing", "mixup", "cutmix", "freeze_body", "num_classes", "layer_decay", "body_lr_scale")
MAE_ONLY = ("decoder_width", "decoder_depth", "decoder_heads", "norm_pix_loss")  # (flags given: in args at all)
MPP_ONLY = ("mpp_target",)


def run(args: argparse.Namespace) -> int:
    given = vars(args)
    other = MAE_ONLY if args.objective == "mpp" else MPP_ONLY
    wrong = [f"--{k.replace('_', '-')}" for k in other if k in given]
    labels = [f"--{k.replace('_', '-')}" for k in LABELS_ONLY if k in given]
    if labels:
        print(f"vitkit pretrain: error: {', '.join(labels)} {'acts' if len(labels) == 1 else 'act'} on labels or a "
              "fine-tuned head, which pre-training has none of: give it to `vitkit train --init` of the result",
              file=sys.stderr)
        return 2
    if wrong:  # accepted and ignored, they would say the run was something it was not
        owner = "MAE's (its decoder and pixel targets)" if args.objective == "mpp" else "MPP's (its colour targets)"
        print(f"vitkit pretrain: error: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} {owner}: not a "
              f"setting of --method {args.objective}", file=sys.stderr)
        return 2
    return train.run(args)
