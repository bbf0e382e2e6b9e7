"""Photo-sized WebDataset shards in ImageNet's layout, made from a folder of small images, for timing a streamed
224-px run where ImageNet itself is not at hand (the GPU machine cannot download it).

    python benchmarks/photo_shards.py --images DIR_OR_ZIP --out DIR [--n 12000] [--size 500x375] [--quality 90]

Each image is resized (bicubic) to --size, ImageNet's typical photo (its mean is about 400x350), given a film grain
(--grain: Gaussian noise of that many gray levels), and saved as a JPEG of --quality; --n of them go to
imagenet1k-train-NNNN.tar (1,000 a shard) and a tenth as many to imagenet1k-validation-0000.tar, each sample a .jpg
beside a .cls (its class index). Upscaled small images are smoother than photos: without grain their JPEGs were
about 20 KB against ImageNet's 110, and decoded faster, the decoder's best case. As in ImageNet, some are not the
baseline JPEGs of one size: one in --progressive-every is progressive (decoded in several passes), one in
--large-every has 4 megapixels (2304x1728, a phone's photo; up to 12 MB decoded before any crop). Not a test: it
writes data.
"""
import argparse
import io
import os
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from vitkit.data.folder import folder_items

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--images", required=True, help="a folder or zip of train/<class>/* images (CIFAR-10's, say)")
p.add_argument("--out", required=True)
p.add_argument("--n", type=int, default=12_000)
p.add_argument("--size", default="500x375", help="WxH of every photo")
p.add_argument("--quality", type=int, default=90)
p.add_argument("--per-shard", type=int, default=1000)
p.add_argument("--grain", type=float, default=6.0, help="noise of this many gray levels (0: none)")
p.add_argument("--progressive-every", type=int, default=10, help="one photo in N a progressive JPEG (0: none)")
p.add_argument("--large-every", type=int, default=25, help="one photo in N of 2304x1728 (0: none)")
args = p.parse_args()
W, H = (int(v) for v in args.size.split("x"))
LARGE = (2304, 1728)
src, classes, items = folder_items(args.images)
train = items["train"]


def every(n: int, i: int) -> bool:
    return n > 0 and i % n == n - 1


def photo(i: int) -> tuple[str, bytes, int]:
    name, label = train[i % len(train)]
    size = LARGE if every(args.large_every, i) else (W, H)
    img = Image.open(io.BytesIO(src.reader.read(name))).convert("RGB").resize(size, Image.BICUBIC)
    if args.grain > 0:
        noise = np.random.default_rng(i).normal(0, args.grain, (size[1], size[0], 3))
        img = Image.fromarray(np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=args.quality, progressive=every(args.progressive_every, i))
    return f"n{i:08d}", buf.getvalue(), label


out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
with Pool(os.cpu_count()) as pool:
    for split, n in (("train", args.n), ("validation", max(1, args.n // 10))):
        pattern = str(out / f"imagenet1k-{split}-%04d.tar")
        with wds.ShardWriter(pattern, maxcount=args.per_shard, verbose=0) as sink:
            for key, jpg, label in pool.imap(photo, range(n), chunksize=64):
                sink.write({"__key__": key, "jpg": jpg, "cls": label})
(out / "classes.txt").write_text("\n".join(classes) + "\n")
size = sum(f.stat().st_size for f in out.glob("*.tar"))
print(f"{out}: {args.n:,} train and {max(1, args.n // 10):,} validation photos of {W}x{H} (1 in "
      f"{args.progressive_every} progressive, 1 in {args.large_every} of {LARGE[0]}x{LARGE[1]}; 0: none), "
      f"{size / (args.n * 1.1) / 1e3:.0f} KB each on average")
