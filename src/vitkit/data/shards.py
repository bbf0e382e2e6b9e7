"""WebDataset shards: ``vitkit shard`` writes them from a folder or zip, and ``--dataset shards`` trains on them.

A shard is a plain tar of samples, each a few members sharing a key: ``<key>.jpg`` (or .png, .webp, ...) and
``<key>.cls`` (the class index as text), ImageNet's WebDataset layout. They are written with the ``webdataset``
package's ``ShardWriter``; any shards in that layout read (``train-*.tar`` and ``val-*.tar``, or ``test-*.tar`` /
``validation-*.tar``, each name perhaps after a prefix such as ``imagenet1k-``, as the Hub's ImageNet-1k shards
are named, beside an optional ``classes.json`` or ``classes.txt`` naming the classes; ImageNet-1k's shards need
none).

vitkit reads them by an index of the members' offsets (tar headers only, listed once and cached), not as one
sequential stream: each image is then one read at a known offset, so the sampler's indices work as for a folder,
which gives every rank its own part of each epoch and resumes mid-epoch at the exact next batch. (A sequential
WebDataset pipeline resumes at a shard's start at best.)
"""
from __future__ import annotations

import hashlib
import json
import random
import tarfile
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from .folder import IMAGE_EXTENSIONS, MAX_IMAGE_BYTES, folder_items, load_images
from .images import BadImageError
from .splits import DataSplits
from .stream import check_size

IMAGE_KEYS = tuple(e.lstrip(".") for e in sorted(IMAGE_EXTENSIONS))
LABEL_KEY = "cls"
VAL_NAMES = ("val", "validation", "test")
CLASSES_FILE = "classes.json"
SHARD_IMAGES = 10_000  # images a shard holds at most (WebDataset's usual few hundred MB of JPEGs)


# ------------------------------------------------------------------------------------------ reading
class TarReader:
    """Reads a sample's image by its index entry, ``"<shard>\\t<offset>\\t<size>\\t<member>"``: a name that carries
    where the bytes are, so DataLoader workers need no table."""

    def __init__(self, root: Path) -> None:
        self.path, self.max_bytes = root, MAX_IMAGE_BYTES

    def where(self, name: str) -> str:
        shard, _, _, member = name.split("\t", 3)
        return f"{self.path / shard}:{member}"

    def read(self, name: str) -> bytes:
        shard, offset, size, _ = name.split("\t", 3)
        check_size(int(size), self.max_bytes, self.where(name))
        try:
            with open(self.path / shard, "rb") as f:
                f.seek(int(offset))
                data = f.read(int(size))
        except OSError as e:
            raise BadImageError(self.where(name), f"cannot read it ({type(e).__name__}: {e})") from None
        if len(data) != int(size):
            raise BadImageError(self.where(name), f"the shard ends {int(size) - len(data):,} bytes into it")
        return data


def shard_files(root: Path, need_val: bool = True) -> dict[str, list[Path]]:
    """``{"train": [...], "val": [...]}``: the shards of each split, in name order (``need_val`` False: the val
    list may be empty, for images read without labels)."""
    if root.is_file():
        raise ValueError(f"{root}: a file, not a folder of shards (train-000000.tar, ..., val-000000.tar, ...); a zip "
                         "of images in folders is --dataset folder")
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder of shards (train-000000.tar, ..., val-000000.tar, ...)")
    def named(split: str) -> list[Path]:  # "train-000000.tar", "train0.tar", "imagenet1k-train-0000.tar"
        return sorted(root.glob(f"{split}-*.tar")) or sorted(root.glob(f"{split}*.tar")) or \
            sorted(root.glob(f"*-{split}-*.tar"))

    train = named("train")
    val = next((found for v in VAL_NAMES if (found := named(v))), [])
    if not train or (not val and need_val):
        have = sorted(p.name for p in root.glob("*.tar"))[:6]
        raise FileNotFoundError(f"{root}: expected train-*.tar and val-*.tar (or test-*/validation-*) shards; found "
                                f"{have or 'no .tar files'}")
    return {"train": train, "val": val}


IMAGENET_PREFIX = "imagenet1k-"  # the Hub's ImageNet-1k shards (timm/imagenet-1k-wds): the classes are its 1,000


def _class_names(root: Path, labels: set[int], imagenet: bool = False) -> list[str]:
    """classes.json ({"classes": [...]}, as vitkit shard writes it) or classes.txt (a name a line), else
    ImageNet-1k's names for its shards, else the indices found, as text."""
    if (root / CLASSES_FILE).is_file():
        try:
            found = json.loads((root / CLASSES_FILE).read_text())
            names = found if isinstance(found, list) else found["classes"]  # a plain list of names is one too
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{root / CLASSES_FILE}: not a class list: expected {{\"classes\": [names]}} (as vitkit "
                             f"shard writes it) or a list of names ({type(e).__name__}: {e})") from None
    elif (root / "classes.txt").is_file():
        names = [line.strip() for line in (root / "classes.txt").read_text().splitlines() if line.strip()]
    elif imagenet:
        names = (resources.files("vitkit") / "interop" / "imagenet1k_labels.txt").read_text().splitlines()
    else:
        return [str(i) for i in range(max(labels) + 1)] if labels else []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{root}: the class list must be a list of names, got {names!r}"[:300])
    return names


def index_shard(shard: Path, root: Path, skip_bad: bool, unlabeled: bool = False
                ) -> tuple[list[tuple[str, int]], list[str]]:
    """[(reader name, class index)] of one shard's samples, and what was skipped (``skip_bad``); a sample without
    an image or a label, a label that is not an integer, or a truncated shard is an error naming the shard and
    member otherwise. ``unlabeled`` (self-supervision, which reads no label): every sample's class is 0, with a
    ``.cls`` member or without."""
    out, skipped = [], []
    samples: dict[str, dict[str, Any]] = {}
    order: list[str] = []

    def bad(what: str) -> None:
        if not skip_bad:
            raise ValueError(f"{shard}: {what} (--skip-bad-images passes over such samples)")
        skipped.append(what)

    try:
        with tarfile.open(shard, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)  # WebDataset: the key ends at the first dot of the file name
                key = m.name[: len(m.name) - len(base)] + stem
                if key not in samples:
                    samples[key] = {}
                    order.append(key)
                ext = ext.lower()
                if ext == LABEL_KEY:
                    f = tf.extractfile(m)
                    samples[key][LABEL_KEY] = (f.read(64) if f else b"", m.name)
                elif ext in IMAGE_KEYS and "image" not in samples[key]:
                    samples[key]["image"] = (m.offset_data, m.size, m.name)
            end = tf.offset  # past the last member: a whole tar has its end-of-archive blocks (1,024 zeros) here
        with open(shard, "rb") as f:
            f.seek(end)
            if f.read(1024) != bytes(1024):  # Python's tarfile stops quietly at a header cut short
                raise tarfile.ReadError(f"no end-of-archive marker after byte {end:,}")
    except (tarfile.TarError, EOFError, OSError) as e:
        what = f"not a readable tar shard, or cut short after {len(order)} samples ({type(e).__name__}: {e})"
        bad(what)
        order = order[:-1]  # the last sample may be the one cut
    rel = str(shard.relative_to(root))
    for key in order:
        s = samples[key]
        if "image" not in s:
            bad(f"sample {key!r} has no image member (.{', .'.join(IMAGE_KEYS[:4])}, ...)")
            continue
        if unlabeled:
            label = 0
        elif LABEL_KEY not in s:
            bad(f"sample {key!r} has no .{LABEL_KEY} member (its class index)")
            continue
        else:
            raw, member = s[LABEL_KEY]
            try:
                label = int(raw.decode().strip())
            except (UnicodeDecodeError, ValueError):
                bad(f"{member}: the class index must be an integer, got {raw[:20]!r}")
                continue
        offset, size, name = s["image"]
        out.append((f"{rel}\t{offset}\t{size}\t{name}", label))
    return out, skipped


def load_shard_splits(path: str, skip_bad_images: bool = False, cache_dir: str | None = None,
                      progress: Callable | None = None, max_side: int = 128, crop: dict[str, Any] | None = None,
                      mode: str = "auto", say: Callable[[str], None] | None = None, unlabeled: bool = False,
                      budget_s: float | None = None, size: tuple[int, int] | None = None) -> DataSplits:
    """WebDataset shards in ``path`` as a DataSplits: in memory where they fit, else streamed (folder.load_images);
    ``unlabeled``: their images alone, as the one class "images" (self-supervision reads no label), the train
    shards alone enough; ``size``: every image at that size (``--unlabeled``: the labelled images')."""
    root = Path(path)
    files = shard_files(root, need_val=not unlabeled)
    stats = [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for ps in files.values() for p in ps]
    extra = [(n, (root / n).stat().st_mtime_ns) for n in (CLASSES_FILE, "classes.txt") if (root / n).is_file()]
    fingerprint = f"shards|{root.resolve()}|{hashlib.sha256(json.dumps([stats, extra]).encode()).hexdigest()}" \
        + ("|unlabeled" if unlabeled else "")
    items: dict[str, list[tuple[str, int]]] = {}
    skipped: list[str] = []
    for split, shards in files.items():
        items[split] = []
        for shard in (progress(shards, desc=f"indexing {split} shards") if progress else shards):
            found, bad = index_shard(shard, root, skip_bad_images, unlabeled)
            items[split] += found
            skipped += bad
    if unlabeled and not files["val"] and items["train"]:
        items["val"] = items["train"][:1]  # (train shards alone: a split of one image, never read for anything)
    if not items["train"] or not items["val"]:
        raise ValueError(f"{root}: no samples in the {'train' if not items['train'] else 'val'} shards")
    labels = {y for lst in items.values() for _, y in lst}
    imagenet = all(p.name.startswith(IMAGENET_PREFIX) for p in files["train"])
    classes = ["images"] if unlabeled else _class_names(root, labels, imagenet)
    if not unlabeled and imagenet and len(classes) == 1000 and say is not None and \
            not any((root / n).is_file() for n in (CLASSES_FILE, "classes.txt")):
        say(f"{root}: shards named as ImageNet-1k's ({IMAGENET_PREFIX}*) and no {CLASSES_FILE}: ImageNet-1k's 1,000 "
            f"classes, a 1,000-way head (the labels here run {min(labels)}-{max(labels)}; a {CLASSES_FILE} of your "
            "own classes changes that)")
    outside = sorted(y for y in labels if not 0 <= y < len(classes))
    if outside:
        name = next(n for lst in items.values() for n, y in lst if y == outside[0]).split("\t")
        source = next((n for n in (CLASSES_FILE, "classes.txt") if (root / n).is_file()), "ImageNet-1k")
        raise ValueError(f"{root / name[0]}:{name[3]}: class index {outside[0]} is outside the {len(classes)} "
                         f"classes of {source}")
    data = load_images(f"{path}", TarReader(root), items, classes, fingerprint, skip_bad_images, size, cache_dir,
                       progress, max_side, crop, mode, say, "shards", budget_s)
    data.skipped += len(skipped)
    return data


# ------------------------------------------------------------------------------------------ writing
def write_shards(data_dir: str, out: str, per_shard: int = SHARD_IMAGES, seed: int = 0,
                 say: Callable[[str], None] = print, progress: Callable | None = None) -> dict[str, int]:
    """A folder or zip (``train/<class>/*``, ``val/`` or ``test/``) as WebDataset shards in ``out``: each image's
    file as it is (no re-encoding) under ``<key>.<ext>`` and its class index under ``<key>.cls``; the training
    images in a seeded random order (a sequential reader's shuffle buffer then mixes classes), and
    ``classes.json`` with the class names. Refuses an ``out`` holding shards already."""
    try:
        import webdataset as wds  # the optional "data" extra: only this command writes shards
    except ImportError:
        raise ValueError("vitkit shard writes with the webdataset package: pip install 'vitkit[data]'") from None

    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"--out {dest} is a file; vitkit shard writes into a new or empty folder")
    if dest.is_dir() and any(dest.iterdir()):
        raise FileExistsError(f"--out {dest} is not empty ({', '.join(sorted(p.name for p in dest.iterdir())[:3])}"
                              "...); vitkit shard writes into a new or empty folder (nothing was written)")
    source = Path(data_dir).resolve()
    if source.is_dir() and (dest.resolve() == source or source in dest.resolve().parents):
        raise ValueError(f"--out {dest} lies inside --data-dir {data_dir}: the shards would be read as images of "
                         "the folder they are written from; choose a folder outside it")
    src, classes, items = folder_items(data_dir)
    dest.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, lst in items.items():
        name = "train" if split == "train" else "val"
        order = list(lst)
        if name == "train":
            random.Random(seed).shuffle(order)
        with wds.ShardWriter(str(dest / f"{name}-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
            for i, (member, ci) in enumerate(progress(order, desc=f"writing {name}") if progress else order):
                ext = Path(member).suffix.lower().lstrip(".")
                sink.write({"__key__": f"{name}/{i:08d}", ext: src.reader.read(member), LABEL_KEY: ci})
        counts[name] = len(order)
    (dest / CLASSES_FILE).write_text(json.dumps({"classes": classes, "images": counts}, indent=1))
    n_shards = len(list(dest.glob("*.tar")))
    say(f"{dest}: {counts['train']:,} train and {counts['val']:,} val images in {n_shards} shards of at most "
        f"{per_shard:,}, classes in {CLASSES_FILE}; train with: vitkit train --dataset shards --data-dir {dest}")
    return counts
