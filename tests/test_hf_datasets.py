"""Hugging Face datasets (issue 50): a DatasetDict saved with save_to_disk, or parquet files, read offline through
the datasets library: the same images and labels as the folder they were made from, streamed or in memory."""
from __future__ import annotations

import json

import pytest
import torch

from vitkit.cli.main import main
from vitkit.data.augment import batches
from vitkit.data.folder import load_folder_splits
from vitkit.data.hf import load_hf_splits

from helpers import write_digits_folder

datasets = pytest.importorskip("datasets")
CPU = torch.device("cpu")


def _from_folder(root):
    """The folder's images as a DatasetDict built by the datasets library itself (ClassLabel names)."""
    classes = sorted(p.name for p in (root / "train").iterdir())
    feat = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    parts = {}
    for split, name in (("train", "train"), ("val", "validation")):
        files = [(p, classes.index(p.parent.name)) for c in classes for p in sorted((root / split / c).iterdir())]
        parts[name] = datasets.Dataset.from_dict(
            {"image": [{"bytes": p.read_bytes(), "path": None} for p, _ in files], "label": [y for _, y in files]},
            features=feat)
    return datasets.DatasetDict(parts)


def _pairs(split):
    x, y = next(batches(split, list(range(len(split))), len(split), False, CPU))
    return sorted((int(c), bytes(im.flatten().tolist())) for im, c in zip(x, y))


@pytest.mark.parametrize("form", ["save_to_disk", "parquet"])
def test_a_hugging_face_dataset_reads_as_the_folder_it_was_made_from(tmp_path, form):
    root = write_digits_folder(tmp_path / "d", per_class=3, size=16)
    dd = _from_folder(root)
    if form == "save_to_disk":
        path = tmp_path / "saved"
        dd.save_to_disk(str(path))
    else:
        path = tmp_path / "pq"
        (path / "data").mkdir(parents=True)
        for split, d in dd.items():
            d.to_parquet(str(path / "data" / f"{split}-00000-of-00001.parquet"))
    folder = load_folder_splits(str(root), cache_dir=str(tmp_path / "c"), mode="memory")
    for mode in ("memory", "stream"):
        hf = load_hf_splits(str(path), cache_dir=str(tmp_path / "c"), mode=mode)
        assert hf.classes == folder.classes and (hf.img_size, hf.in_chans) == (folder.img_size, 1)
        if mode == "stream":
            hf.train.workers = 2  # each worker reads the memory-mapped Arrow files
        assert _pairs(hf.train) == _pairs(folder.train) and _pairs(hf.val) == _pairs(folder.val)


def test_train_on_a_saved_dataset_end_to_end(tmp_path, capsys):
    root = write_digits_folder(tmp_path / "d", per_class=4, size=16)
    _from_folder(root).save_to_disk(str(tmp_path / "saved"))
    assert main(["train", "--dataset", "hf", "--data-dir", str(tmp_path / "saved"), "--epochs", "1", "-b", "8",
                 "--data-mode", "stream", "--workers", "1", "--cache-dir", str(tmp_path / "c"),
                 "--output", str(tmp_path / "run"), "--depth", "1", "--embed-dim", "16", "--num-heads", "1"]) == 0
    assert "40 train / 40 val images, 16x16x1, 10 classes, streamed" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "run" / "last" / "config.json").read_text())
    assert cfg["preprocessing"]["class_names"] == [str(i) for i in range(10)]


def test_bad_hugging_face_input_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    no_image = datasets.DatasetDict({s: datasets.Dataset.from_dict({"pixels": [[1, 2]], "label": [0]})
                                     for s in ("train", "test")})
    no_image.save_to_disk(str(tmp_path / "noimg"))
    cases = [(str(tmp_path / "noimg"), "expected an Image column and a label column"),
             ("someone/not-cached", "could not read it"),
             (str(tmp_path / "nothing-here"), "nothing-here: no such folder or file")]
    for path, message in cases:
        assert main(["train", "--dataset", "hf", "--data-dir", path, "--epochs", "1",
                     "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_a_label_outside_the_classes_is_named(tmp_path):
    feat = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8, 8), 3).save(buf, "PNG")
    img = {"bytes": buf.getvalue(), "path": None}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"image": [img] * 3, "label": [0, 1, -1]},
                                                                   features=feat),
                               "validation": datasets.Dataset.from_dict({"image": [img], "label": [0]},
                                                                        features=feat)})
    dd.save_to_disk(str(tmp_path / "s"))
    with pytest.raises(ValueError, match=r"s\[train\]\[2\]: label -1 is outside the 2 classes"):
        load_hf_splits(str(tmp_path / "s"), cache_dir=str(tmp_path / "c"))


def test_a_hub_dataset_reads_offline_from_the_hub_cache(tmp_path):
    """The Hub path, without a network: the dataset's parquet files where huggingface_hub caches a download (blobs,
    a snapshot of symlinks, refs/main), read with HF_HUB_OFFLINE=1 as a user's second run reads them."""
    import hashlib
    import os
    import subprocess
    import sys

    root = write_digits_folder(tmp_path / "d", per_class=3, size=16)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "datasets--someone--digits"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    for split, d in _from_folder(root).items():
        tmp = tmp_path / f"{split}.parquet"
        d.to_parquet(str(tmp))
        blob = repo / "blobs" / hashlib.sha256(tmp.read_bytes()).hexdigest()
        blob.write_bytes(tmp.read_bytes())
        link = repo / "snapshots" / commit / "data" / f"{split}-00000-of-00001.parquet"
        link.symlink_to(os.path.relpath(blob, link.parent))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "vitkit", "train", "--dataset", "hf", "--data-dir", "someone/digits",
                        "--epochs", "1", "-b", "8", "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "r"),
                        "--depth", "1", "--embed-dim", "16", "--num-heads", "1"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "someone/digits: 30 train / 30 val images, 16x16x1, 10 classes" in r.stdout
