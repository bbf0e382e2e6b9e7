"""Hugging Face ``datasets``: an image + label dataset saved with ``save_to_disk``, parquet files, or a Hub id (its
parquet files, downloaded by huggingface_hub into the Hub cache).

Read through the ``datasets`` library (the optional "data" extra): Arrow files are memory-mapped, so a dataset
larger than memory costs only the pages in use, and rows are read by index, which gives the sampler's order,
each rank's part of an epoch and mid-epoch resumption as for a folder. Each image is handed over as its encoded
bytes (``Image(decode=False)``) and decoded by vitkit as every other image is (folder.load_images).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from .folder import MAX_IMAGE_BYTES, load_images
from .images import BadImageError
from .splits import DataSplits
from .stream import check_size

VAL_SPLITS = ("validation", "val", "test", "valid")
LABEL_COLUMNS = ("label", "labels", "fine_label", "class", "cls")


def _datasets():  # type: ignore[no-untyped-def]
    try:
        import datasets  # the optional "data" extra: only --dataset hf reads them
    except ImportError:
        raise ValueError("--dataset hf reads with the datasets package: pip install 'vitkit[data]'") from None
    return datasets


def open_dataset(path: str, cache_dir: str | None = None) -> Any:
    """A DatasetDict from a ``save_to_disk`` folder, a folder of parquet files (``train-*.parquet``,
    ``validation-*``/``val-*``/``test-*``, also under ``data/``), or a Hub id (``hub_snapshot``)."""
    ds = _datasets()
    p = Path(path)
    try:
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            d = ds.load_from_disk(str(p))
            return d if isinstance(d, ds.DatasetDict) else ds.DatasetDict({"train": d})
        if p.is_dir() or p.suffix == ".parquet":
            files = _parquet_files(p)
            return ds.load_dataset("parquet", data_files=files, cache_dir=cache_dir)
        if p.exists():
            raise ValueError(f"{path}: not a save_to_disk folder, a parquet file or a folder of parquet files")
        if path.startswith(("/", ".", "~")) or path.count("/") > 1:  # a Hub id is NAME or OWNER/NAME
            raise FileNotFoundError(f"{path}: no such folder or file (a Hub id is NAME or OWNER/NAME)")
        return ds.load_dataset("parquet", data_files=_parquet_files(hub_snapshot(path)), cache_dir=cache_dir)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - the Hub and Arrow raise many kinds: one line naming the dataset
        raise ValueError(f"--dataset hf --data-dir {path}: could not read it ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); a Hub id needs internet or the dataset in the Hub "
                         "cache, a folder save_to_disk's files or parquet files") from None


def hub_snapshot(repo_id: str) -> Path:
    """A Hub dataset's parquet files, downloaded once into the Hub cache by huggingface_hub (offline, with
    HF_HUB_OFFLINE=1, the cached snapshot): the same cache and rules as the model weights."""
    from huggingface_hub import snapshot_download  # a dependency of datasets

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["*.parquet", "*.json", "*.md"]))
    except Exception as e:  # noqa: BLE001 - no network, no such repo, a gated one: one line naming the dataset
        raise ValueError(f"--dataset hf --data-dir {repo_id}: could not read it from the Hub ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}); a Hub id needs internet, or the dataset already in the "
                         "Hub cache (HF_HOME) with HF_HUB_OFFLINE=1") from None


def _parquet_files(p: Path) -> dict[str, list[str]]:
    if p.is_file():
        return {"train": [str(p)]}
    found: dict[str, list[str]] = {}
    for split in ("train", *VAL_SPLITS):
        files = sorted(p.glob(f"{split}-*.parquet")) + sorted(p.glob(f"{split}.parquet")) + \
            sorted(p.glob(f"data/{split}-*.parquet")) + sorted(p.glob(f"{split}/*.parquet")) + \
            sorted(p.glob(f"*/{split}/*.parquet"))  # the Hub's parquet conversion: <config>/<split>/0000.parquet
        if files:
            found[split] = [str(f) for f in files]
    if not found:
        raise FileNotFoundError(f"{p}: no parquet files named train-*.parquet / validation-*.parquet (or under "
                                "data/), and no save_to_disk files (dataset_dict.json)")
    configs = sorted({Path(f).relative_to(p).parts[0] for fs in found.values() for f in fs
                      if len(Path(f).relative_to(p).parts) == 3 and Path(f).relative_to(p).parts[1] in found})
    if len(configs) > 1:  # the Hub's conversion of a dataset with several configurations: their rows were merged
        raise ValueError(f"{p}: parquet files of {len(configs)} configurations ({', '.join(configs[:6])}); vitkit "
                         f"reads one: give --data-dir {p}/{configs[0]} (or another's folder)")
    return found


class HFReader:
    """Reads row ``"<split>\\t<row>"`` of a DatasetDict's image column as its file bytes."""

    def __init__(self, path: str, dataset: Any, image_column: str) -> None:
        self.path, self.column = Path(path), image_column
        image = _datasets().Image(decode=False)
        self.splits = {s: d.cast_column(image_column, image) for s, d in dataset.items()}

    def where(self, name: str) -> str:
        split, row = name.split("\t")
        return f"{self.path}[{split}][{row}]"

    def read(self, name: str) -> bytes:
        split, row = name.split("\t")
        cell = self.splits[split][int(row)][self.column]
        data = cell.get("bytes") if isinstance(cell, dict) else None
        if data is None and isinstance(cell, dict) and cell.get("path"):
            try:
                data = Path(cell["path"]).read_bytes()
            except OSError as e:
                raise BadImageError(self.where(name), f"cannot read {cell['path']} ({e})") from None
        if not data:
            raise BadImageError(self.where(name), "no image bytes in this row")
        check_size(len(data), MAX_IMAGE_BYTES, self.where(name))
        return data


def _columns(d: Any, path: str) -> tuple[str, str, list[str] | None]:
    """(image column, label column, class names from a ClassLabel or None)."""
    ds = _datasets()
    image = next((k for k, f in d.features.items() if isinstance(f, ds.Image)), None)
    label = next((k for k, f in d.features.items() if isinstance(f, ds.ClassLabel)), None)
    label = label or next((k for k in LABEL_COLUMNS if k in d.features), None)
    if image is None or label is None:
        found = {k: type(f).__name__ for k, f in d.features.items()}
        raise ValueError(f"{path}: expected an Image column and a label column (a ClassLabel, or one of "
                         f"{', '.join(LABEL_COLUMNS)}); found {found}")
    names = d.features[label].names if isinstance(d.features[label], ds.ClassLabel) else None
    return image, label, names


def class_indices(raw: dict[str, list[Any]], names: list[str] | None, where: str,
                  say: Callable[[str], None] | None = None) -> tuple[dict[str, list[int]], list[str]]:
    """Each split's labels as class indices, and the class names: a ClassLabel's; whole numbers as they are
    (0..max; 3.0 is 3); text as classes of its own, sorted (saved with the checkpoint as its class names, as a
    folder's class folders are). A fraction, a boolean or anything else is refused by name: 0.5 became class 0."""
    def whole(v: Any) -> bool:
        return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))

    values = [v for ys in raw.values() for v in ys]
    if names is not None or all(whole(v) for v in values):
        ints = {s: [int(v) for v in ys] for s, ys in raw.items()}
        return ints, names or [str(i) for i in range(max(max(ys, default=0) for ys in ints.values()) + 1)]
    if all(isinstance(v, str) for v in values):
        classes = sorted(set(values))
        index = {c: i for i, c in enumerate(classes)}
        if say is not None:
            say(f"{where}: text labels, {len(classes)} classes in sorted order ({', '.join(classes[:5])}"
                f"{', ...' if len(classes) > 5 else ''}), saved with the checkpoint as its class names")
        return {s: [index[v] for v in ys] for s, ys in raw.items()}, classes
    kind = str if isinstance(values[0], str) else int
    s, i, v = next((s, i, v) for s, ys in raw.items() for i, v in enumerate(ys)
                   if not (isinstance(v, str) if kind is str else whole(v)))
    raise ValueError(f"{where}[{s}][{i}]: label {v!r} ({type(v).__name__}) is not a class: expected whole numbers 0, "
                     "1, 2, ..., a ClassLabel, or text naming the classes (one kind in the whole column)")


def load_hf_splits(path: str, skip_bad_images: bool = False, cache_dir: str | None = None,
                   progress: Callable | None = None, max_side: int = 128, crop: dict[str, Any] | None = None,
                   mode: str = "auto", say: Callable[[str], None] | None = None,
                   budget_s: float | None = None) -> DataSplits:
    """A Hugging Face dataset's train and validation (or test) splits: in memory where they fit, else streamed."""
    d = open_dataset(path, cache_dir)
    val = next((s for s in VAL_SPLITS if s in d), None)
    if "train" not in d or val is None:
        raise ValueError(f"{path}: splits {sorted(d)}; expected train and one of {', '.join(VAL_SPLITS)}")
    image, label, names = _columns(d["train"], path)
    splits = {"train": d["train"], val: d[val]}
    raw = {s: list(x[label]) for s, x in splits.items()}  # a column read alone: no image decoded
    labels, classes = class_indices(raw, names, f"{path} column {label!r}", say)
    for s, ys in labels.items():
        bad = next((i for i, y in enumerate(ys) if not 0 <= y < len(classes)), None)
        if bad is not None:
            raise ValueError(f"{path}[{s}][{bad}]: label {ys[bad]} is outside the {len(classes)} classes")
    items = {s: [(f"{s}\t{i}", y) for i, y in enumerate(ys)] for s, ys in labels.items()}
    ids = [getattr(x, "_fingerprint", None) or json.dumps([f["filename"] for f in x.cache_files])
           for x in splits.values()]
    fingerprint = f"hf|{path}|{hashlib.sha256(json.dumps(ids).encode()).hexdigest()}"
    return load_images(path, HFReader(path, splits, image), items, classes, fingerprint, skip_bad_images, None,
                       cache_dir, progress, max_side, crop, mode, say, "hf", budget_s)
