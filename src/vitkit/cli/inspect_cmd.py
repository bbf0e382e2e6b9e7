"""``vitkit inspect {attention,rollout,distance,posemb,filters,features} --checkpoint DIR [--image IMG] --out
FILE.png``, ``vitkit inspect explain --checkpoint DIR [IMAGE ...] --method all --target CLASS --out DIR``, and
``vitkit inspect reconstruct --checkpoint RUN/best [IMAGE ...] --out FILE.png`` for a self-supervised checkpoint.
``--input-size H W`` runs any of them at another (non-square) size, ``--keep-aspect`` at the image's own aspect
ratio."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_data_flags, add_weights_flags, load_data_from_args, load_weights, positive_int

KINDS = ("attention", "rollout", "distance", "posemb", "filters", "features", "explain", "reconstruct")


def add_parser(p: argparse.ArgumentParser) -> None:
    from ..inspect import METHODS

    p.add_argument("kind", choices=KINDS)
    p.add_argument("images", nargs="*", help="explain, reconstruct: image files or folders (default: --num-images "
                   "validation images of the dataset)")
    add_weights_flags(p)
    p.add_argument("--image", default=None, help="image file (default: the first validation image of the dataset)")
    p.add_argument("--out", required=True, help="PNG file to write (explain: a folder)")
    p.add_argument("--layer", type=int, default=-1, help="attention, features: which block, from 0 (negative: from "
                   "the end; default: the last)")
    p.add_argument("--input-size", type=int, nargs=2, metavar=("H", "W"), default=None,
                   help="run the model at H x W (any multiple of the patch, non-square too): E_pos resampled in 2-D "
                        "(§3.2) and the images resized to it")
    p.add_argument("--keep-aspect", action="store_true",
                   help="with --image: run at the image's own aspect ratio (its longer side at the model's size, "
                        "both sides rounded to the patch)")
    p.add_argument("--num-images", type=positive_int, default=None,
                   help="distance: images sampled from the dataset (default 256); explain: without image files, "
                        "validation images explained (default 8); reconstruct: validation images shown (default 4)")
    g = p.add_argument_group("explain")
    g.add_argument("--method", default="all", help=f"{', '.join(METHODS)}, several joined by commas, or all")
    g.add_argument("--target", default=None, help="the class to explain, by name or index (default: each image's "
                   "predicted class)")
    g.add_argument("--steps", type=positive_int, default=16, help="points on the deletion / insertion curves")
    g.add_argument("--random-orders", type=positive_int, default=4, help="random patch orders for the baseline")
    g.add_argument("--no-faithfulness", action="store_true", help="draw the maps only")
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
    raw = data.val.take(idx)
    return normalizer(pre, model.config).normalize(raw), raw[0].numpy()


def run(args: argparse.Namespace) -> int:
    from ..data.preprocess import preprocessing_of
    from ..inspect import analysis, plots

    if args.images and args.kind not in ("explain", "reconstruct"):
        raise ValueError(f"inspect {args.kind} takes one image, as --image IMG; image files as arguments are for "
                         "inspect explain and reconstruct")
    if args.kind == "explain":
        return explain(args)
    if args.kind == "reconstruct":
        return reconstruct(args)
    model = resized(load_weights(args).eval(), args)
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
        x, _ = _sample_images(args, model, pre, args.num_images or 256)
        dist = analysis.mean_attention_distance(model, x)
        grid = model.patch_embed.grid_for(tuple(x.shape[-2:]))
        patch = model.patch_embed.cell
        uniform = float(analysis.patch_distances(grid, patch).mean())
        plots.plot_attention_distance(dist, out, f"Mean attention distance ({len(x)} images, {grid[0]}x{grid[1]} "
                                      f"patches of {patch[0]} px)", uniform)
        print(f"uniform attention would give {uniform:.2f} px")
        for layer, row in enumerate(dist, 1):
            print(f"layer {layer:2d}: " + " ".join(f"{d:6.2f}" for d in row))
    else:
        x, shown = _sample_images(args, model, pre, 1)
        x = x[:1]
        if args.kind == "features":
            layer = _block(model, args.layer)
            pca, share = analysis.feature_pca(model, x, layer)
            plots.plot_features(shown, pca[0], share, out, layer)
            print(f"block {layer}: a {pca.shape[1]}x{pca.shape[2]} map of {model.config.embed_dim}-dim patch tokens; "
                  f"first principal components {', '.join(f'{100 * s:.1f}%' for s in share)} of the variance")
        elif args.kind == "rollout":
            heat = analysis.attention_rollout(model, x)[0]
            plots.plot_overlay(shown, heat, out, "attention rollout")
        else:
            attns = analysis.attention_maps(model, x)
            layer = _block(model, args.layer)
            a = attns[layer][0]  # h t t
            grid = model.patch_embed.grid_for(tuple(x.shape[-2:]))
            n0 = model.num_prefix_tokens  # register tokens are left out of the maps: they are not patches
            if model.num_readout_tokens:
                names = ("class token", "distillation token")[:model.num_readout_tokens]
                maps = {name: a[:, i, n0:] for i, name in enumerate(names)}
            else:
                maps = {"output token (mean over the patches)": a[:, n0:, n0:].mean(1)}
            plots.plot_attention_heads(shown, {k: v.reshape(a.shape[0], *grid).numpy() for k, v in maps.items()},
                                       out, layer + 1)
    print(f"wrote {out}")
    return 0


def _block(model, layer: int) -> int:  # type: ignore[no-untyped-def]
    """--layer as a block index from 0, or one line naming the range."""
    from ..model.backbone import take_indices

    return take_indices(len(model.blocks), [layer])[0][0]


def resized(model, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model rebuilt once for --input-size, or for --image at its own aspect ratio with --keep-aspect."""
    size = args.input_size
    if args.keep_aspect:
        if args.input_size:
            raise ValueError("--keep-aspect and --input-size both set the size: give one")
        if not args.image:
            raise ValueError("--keep-aspect takes the aspect ratio of --image IMG; without an image, give "
                             "--input-size H W")
        from ..data.preprocess import image_size
        from ..model.config import to_2tuple

        h, w = image_size(args.image)
        (uh, uw), scale = model.patch_embed.cell, max(to_2tuple(model.config.img_size)) / max(h, w)
        size = [max(uh, round(h * scale / uh) * uh), max(uw, round(w * scale / uw) * uw)]
    if size:
        model.set_input_size(img_size=tuple(size))
        print(f"input size {size[0]}x{size[1]}: {model.patch_embed.grid_size[0]}x{model.patch_embed.grid_size[1]} "
              "patches, position embeddings resampled in 2-D (§3.2)")
    return model


RESERVED = {"faithfulness"}  # explain's own outputs beside the figures


def figure_names(files: list[Path]) -> list[str]:
    """One figure name per image, all different: the file's stem; where stems repeat (a/cat.jpg, b/cat.jpg,
    a/cat.png) or name explain's own outputs, the extension and then the parent folders are added, and last an
    index. (By stem alone, three images made two figures, and one named faithfulness replaced the bar chart.)"""
    def candidates(f: Path) -> list[str]:
        ext = f.suffix.lstrip(".").lower()
        parents = [p.name for p in f.resolve().parents if p.name][:2]
        return [f.stem, f"{f.stem}-{ext}", *(f"{'-'.join(reversed(parents[:k]))}-{f.stem}-{ext}" for k in (1, 2))]

    names: list[str] = []
    for i, f in enumerate(files):
        shared = sum(g.stem == f.stem for g in files) > 1  # then no image gets the bare stem
        names.append(next((n for n in candidates(f)[shared:] if n not in names and n not in RESERVED),
                          f"{f.stem}-{f.suffix.lstrip('.').lower()}-{i + 1}"))
    return names


def explain(args: argparse.Namespace) -> int:
    """One figure per image (the input, then each method's map over it), faithfulness.csv and its bar chart."""
    import csv

    import torch

    from ..data.preprocess import image_files, images_to_tensor, load_images, naflex_note, preprocessing_of
    from ..inspect import plots
    from ..inspect.explanations import METHODS, check_method, class_names_of, explain, faithfulness, resolve_target

    methods = list(METHODS) if args.method == "all" else [check_method(m.strip()) for m in args.method.split(",")]
    if args.keep_aspect:  # the aspect ratio of the one image explained
        if len(args.images) != 1 or Path(args.images[0]).is_dir():
            raise ValueError("--keep-aspect explains one image file at its own aspect ratio; for several, give "
                             "--input-size H W")
        args.image = args.images[0]
    model = resized(load_weights(args).eval(), args)
    if note := naflex_note(preprocessing_of(model), model.config, "each image is explained"):
        print(note)
    if args.target is not None:  # an unknown class is said before any image is read; the class taken, always
        names = class_names_of(model)
        t = resolve_target(names, args.target)
        said = f"--target {args.target}: class {names[t]!r} (index {t})"
        if str(args.target) in names and str(args.target).isdigit() and int(args.target) != t \
                and int(args.target) < len(names):
            said += (f", the class of that name; index {args.target} is class {names[int(args.target)]!r} "
                     f"(--target {names[int(args.target)]})")
        print(said)
    pre = preprocessing_of(model)
    out = Path(args.out)
    if out.suffix.lower() == ".png":
        raise ValueError(f"--out {out}: explain writes a folder (a figure per image and faithfulness.csv)")
    if args.images:
        files = image_files(args.images)
        names = figure_names([Path(f) for f in files])
    else:
        files, names = [], [f"val-{i}" for i in range(args.num_images or 8)]
    writes = [out / f"{n}.png" for n in names] + ([] if args.no_faithfulness else
                                                  [out / "faithfulness.csv", out / "faithfulness.png"])
    if there := [p.name for p in writes if p.exists()]:  # e.g. --out a run folder: its curves.png is the user's
        raise FileExistsError(f"--out {out} already has {', '.join(there[:5])}{' ...' if len(there) > 5 else ''}, "
                              "which this command would write: choose another --out (nothing was overwritten)")
    if files:
        x = images_to_tensor(load_images(files, max_side=4096), pre, model.config)
    else:
        x, _ = _sample_images(args, model, pre, len(names))
        names = names[:len(x)]
    out.mkdir(parents=True, exist_ok=True)
    classes = class_names_of(model)
    results = {m: explain(model, x, args.target, m) for m in methods}
    with torch.no_grad():
        predicted = model(x.to(next(model.parameters()))).argmax(-1).tolist()
    mean = torch.tensor(pre["mean"]).view(-1, 1, 1)
    std = torch.tensor(pre["std"]).view(-1, 1, 1)
    first = results[methods[0]]
    for i, name in enumerate(names):
        t = int(first.target[i])
        title = f"{classes[t]} (p = {first.prob[i]:.3f})"
        if predicted[i] != t:
            title += f"; predicted {classes[predicted[i]]}"
        plots.plot_explanations((x[i] * std + mean).clamp(0, 1).numpy(), {m: r.maps[i] for m, r in results.items()},
                                out / f"{name}.png", title)
    print(f"wrote {len(names)} figures to {out}")
    if args.no_faithfulness:
        return 0
    scores = faithfulness(model, x, methods, args.target, steps=args.steps, random_orders=args.random_orders)
    rows = [r.row() for r in scores.values()]
    with open(out / "faithfulness.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plots.plot_faithfulness(rows, out / "faithfulness.png", f"Faithfulness on {len(x)} images (patches removed / "
                            "added in each map's order)")
    print(f"{'method':<16}{'deletion':>10}{'(random)':>10}{'insertion':>11}{'(random)':>10}  better than random "
          "(by 2 s.e.)")
    for r in rows:
        print(f"{r['method']:<16}{r['deletion_auc']:>10.3f}{r['random_deletion_auc']:>10.3f}{r['insertion_auc']:>11.3f}"
              f"{r['random_insertion_auc']:>10.3f}  {'yes' if r['better_than_random'] else 'not shown'}")
    print(f"wrote {out / 'faithfulness.csv'} and {out / 'faithfulness.png'}")
    return 0


def reconstruct(args: argparse.Namespace) -> int:
    """A self-supervised checkpoint's figure: images as they are, as the model saw them, as it predicted them."""
    import torch

    from ..data.preprocess import image_files, images_to_tensor, load_images, preprocessing_of
    from ..model.config import to_2tuple
    from ..model.ssl import load_ssl
    from ..training.ssl_figure import FIGURE_IMAGES, draw, how_filled, ssl_pictures

    if not args.checkpoint or not Path(args.checkpoint).is_dir():
        raise ValueError("inspect reconstruct: --checkpoint a self-supervised run's checkpoint folder (RUN/best or "
                         "RUN/last: the encoder with ssl.json and ssl.safetensors beside it)")
    encoder = load_weights(args).eval()
    if args.input_size or args.keep_aspect:  # (--input-size was ignored without a word)
        h, w = to_2tuple(encoder.config.img_size)
        flag = "--input-size" if args.input_size else "--keep-aspect"
        raise ValueError(f"inspect reconstruct draws at the size the model was pre-trained at, {h}x{w} (its "
                         f"decoder's position table is of that grid): leave out {flag}; the images are resized to it")
    module = load_ssl(args.checkpoint, encoder)
    pre = preprocessing_of(encoder)
    if args.images:
        x = images_to_tensor(load_images(image_files(args.images)), pre, encoder.config)
    else:
        x, _ = _sample_images(args, encoder, pre, args.num_images or FIGURE_IMAGES)
    mean, std = torch.tensor(pre["mean"]), torch.tensor(pre["std"])
    raw, seen, filled, loss = ssl_pictures(module, x, mean, std)
    out = Path(args.out)
    draw(raw, seen, filled, out, f"{json_method(args.checkpoint)}: loss {loss:.4f} on these {len(x)} images\n"
                                 f"{how_filled(module)}")
    print(f"wrote {out} ({how_filled(module)})")
    return 0


def json_method(folder: str) -> str:
    import json

    from ..model.ssl import SSL_CONFIG

    return json.loads((Path(folder) / SSL_CONFIG).read_text()).get("method", "self-supervised")
