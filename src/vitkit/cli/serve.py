"""``vitkit serve {--checkpoint DIR | --model NAME.TAG} [--host 127.0.0.1] [--port 7860]``: the browser demo."""
from __future__ import annotations

import argparse

from .common import add_data_flags, add_weights_flags, load_weights, positive_int


def add_parser(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every one)")
    p.add_argument("--port", type=int, default=7860, help="the port (default 7860; 0 picks a free one)")
    p.add_argument("--max-upload-mb", type=float, default=10.0,
                   help="the largest upload accepted, in MiB; larger ones are answered 413 (default 10)")
    p.add_argument("--max-pixels", type=int, default=40_000_000,
                   help="the most pixels an uploaded image may hold, refused before it is decoded (default 40M)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per batch (default: measured at start-up, the fewest within 10%% of the "
                        "fastest)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="batches predicted at once (default: the usable cores / --threads)")
    p.add_argument("--max-batch", type=positive_int, default=16,
                   help="uploads waiting together are predicted as one batch")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="uploads waiting or running; past it: 503 busy, retry")
    p.add_argument("--num-examples", type=int, default=8, help="example images offered from the dataset")
    add_data_flags(p)


def _examples(args: argparse.Namespace, names: list[str], n: int):  # type: ignore[no-untyped-def]
    """The first validation image of each of the first ``n`` classes of the run's dataset (none if unavailable)."""
    import numpy as np
    from PIL import Image

    from .common import load_data_from_args
    from .evaluate import _run_dataset_defaults

    if n <= 0:
        return []
    _run_dataset_defaults(args)
    if not getattr(args, "dataset", None):
        return []
    try:
        data = load_data_from_args(args)
    except (OSError, ValueError) as e:
        print(f"no example images: {e}")
        return []
    out = []
    for c in range(min(n, data.num_classes)):
        idx = (data.val.labels == c).nonzero()
        if len(idx):
            a = data.val.take([int(idx[0])])[0].numpy()
            im = Image.fromarray(a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0)))
            out.append((names[c] if c < len(names) else str(c), im))
    return out


def run(args: argparse.Namespace) -> int:
    from ..data.preprocess import naflex_note, preprocessing_of
    from ..serving.app import serve
    from ..serving.predictor import Limits, Predictor

    model = load_weights(args)
    pre = preprocessing_of(model)
    limits = Limits(int(args.max_upload_mb * 1024 * 1024), args.max_pixels, workers=args.workers,
                    max_batch=args.max_batch, max_queue=args.max_queue)
    predictor = Predictor(model, pre, limits, threads=args.threads)
    if note := naflex_note(pre, model.config, "the attention overlay is drawn",
                           "the top-5 is predicted, as by `vitkit predict`,"):
        print(note)
    examples = _examples(args, predictor.names, args.num_examples)
    how = serve(predictor, args.host, args.port, examples,
          on_ready=lambda url: print(f"vitkit demo on {url}  ({len(examples)} example images)\n"
                                     f"{predictor.threads_note}; {predictor.workers} worker(s), batches of up to "
                                     f"{limits.max_batch}, {limits.max_queue} uploads queued at most", flush=True))
    print(f"vitkit demo stopped{f' ({how})' if how else ''}", flush=True)
    return 0
