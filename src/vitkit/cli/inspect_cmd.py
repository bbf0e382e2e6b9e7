"""``vitkit inspect {attention,rollout,distance,posemb,filters} --checkpoint DIR [--image IMG] --out FILE.png``."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_data_flags, add_weights_flags, load_data_from_args, load_weights

KINDS = ("attention", "rollout", "distance", "posemb", "filters")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS)
    add_weights_flags(p)
    p.add_argument("--image", default=None, help="image file (default: the first validation image of the dataset)")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--layer", type=int, default=-1, help="attention: which layer (default: the last)")
    p.add_argument("--num-images", type=int, default=256, help="distance: images sampled from the dataset")
    add_data_flags(p)


def _sample_images(args, model, pre, n: int):  # type: ignore[no-untyped-def]
    """Normalised images (and the raw first one, for display): from --image, else from the run's dataset."""
    import torch

    from ..data.preprocess import images_to_tensor, load_images, normalizer
    from .evaluate import _run_dataset_defaults

    if args.image:
        imgs = load_images([args.image])
        x = images_to_tensor(imgs, pre, model.config)
        return x, x[0].numpy()
    _run_dataset_defaults(args)
    data = load_data_from_args(args)
    if data.in_chans != model.config.in_chans:
        raise ValueError(f"{data.name} has {data.in_chans}-channel images; the model expects {model.config.in_chans}")
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(data.val), generator=g)[:n]
    raw = data.val.images[idx]
    return normalizer(pre, model.config).normalize(raw), raw[0].numpy()


def run(args: argparse.Namespace) -> int:
    from ..data.preprocess import preprocessing_of
    from ..inspect import analysis, plots
    from ..model.config import to_2tuple

    model = load_weights(args).eval()
    pre = preprocessing_of(model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.kind == "posemb":
        plots.plot_pos_embed_similarity(analysis.pos_embed_similarity(model), out)
    elif args.kind == "filters":
        weight, what = analysis.pixel_filters(model)
        if model.config.hybrid:
            print(f"hybrid model: its patch embedding sees {model.patch_embed.proj.in_channels} CNN feature channels, "
                  f"not pixels; showing {what}")
        comps, var = analysis.filter_components(weight)
        plots.plot_filters(comps, var, out, what)
    elif args.kind == "distance":
        x, _ = _sample_images(args, model, pre, args.num_images)
        dist = analysis.mean_attention_distance(model, x)
        grid = model.patch_embed.grid_for(tuple(x.shape[-2:]))
        patch = tuple(p * model.patch_embed.stride for p in to_2tuple(model.config.patch_size))
        uniform = float(analysis.patch_distances(grid, patch).mean())
        plots.plot_attention_distance(dist, out, f"Mean attention distance ({len(x)} images, {grid[0]}x{grid[1]} "
                                      f"patches of {patch[0]} px)", uniform)
        print(f"uniform attention would give {uniform:.2f} px")
        for layer, row in enumerate(dist, 1):
            print(f"layer {layer:2d}: " + " ".join(f"{d:6.2f}" for d in row))
    else:
        x, shown = _sample_images(args, model, pre, 1)
        x = x[:1]
        if args.kind == "rollout":
            heat = analysis.attention_rollout(model, x)[0]
            plots.plot_overlay(shown, heat, out, "attention rollout")
        else:
            attns = analysis.attention_maps(model, x)
            layer = args.layer if args.layer >= 0 else len(attns) + args.layer
            a = attns[layer][0]  # h t t
            grid = model.patch_embed.grid_for(tuple(x.shape[-2:]))
            n0 = model.num_prefix_tokens
            maps = (a[:, 0, n0:] if n0 else a[:, n0:, n0:].mean(1)).reshape(a.shape[0], *grid)
            plots.plot_attention_heads(shown, maps.numpy(), out, layer + 1)
    print(f"wrote {out}")
    return 0
