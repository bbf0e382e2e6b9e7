"""WebDataset shards (issue 50): `vitkit shard` writes them with webdataset's ShardWriter, webdataset's own reader
reads them back, shards that webdataset's TarWriter wrote train with `--dataset shards`; bad shards are named."""
from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch

from vitkit.cli.main import main
from vitkit.data.augment import batches
from vitkit.data.folder import load_folder_splits
from vitkit.data.shards import load_shard_splits

from helpers import write_digits_folder

wds = pytest.importorskip("webdataset")
CPU = torch.device("cpu")


def _all(split):
    x, y = next(batches(split, list(range(len(split))), len(split), False, CPU))
    return x, y


def test_vitkit_shard_writes_what_webdataset_reads_and_trains_on_the_same_pixels(tmp_path, capsys):
    root = write_digits_folder(tmp_path / "d", per_class=5, size=16)
    out = tmp_path / "shards"
    assert main(["shard", "--data-dir", str(root), "--out", str(out), "--per-shard", "16"]) == 0
    assert "50 train and 50 val images in 8 shards of at most 16" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.tar"))[:2] == ["train-000000.tar", "train-000001.tar"]
    assert json.loads((out / "classes.json").read_text())["classes"] == [str(i) for i in range(10)]
    # webdataset's own reader: every sample has the image's file bytes and its class index
    samples = list(wds.WebDataset(sorted(str(p) for p in out.glob("train-*.tar")), shardshuffle=False))
    assert len(samples) == 50 and all(set(s) >= {"__key__", "png", "cls"} for s in samples)
    originals = {p.read_bytes(): int(p.parent.name) for p in (root / "train").rglob("*.png")}
    assert {s["png"]: int(s["cls"]) for s in samples} == originals
    assert [int(s["cls"]) for s in samples] != sorted(int(s["cls"]) for s in samples)  # shuffled for streaming
    # read by vitkit: the folder's images and labels, in the shards' order
    folder = load_folder_splits(str(root), cache_dir=str(tmp_path / "c"), mode="memory")
    for mode in ("memory", "stream"):
        sh = load_shard_splits(str(out), cache_dir=str(tmp_path / "c"), mode=mode)
        assert sh.classes == folder.classes and sh.img_size == folder.img_size and sh.in_chans == 1
        xs, ys = _all(sh.train)
        xf, yf = _all(folder.train)
        as_set = lambda x, y: sorted((int(c), bytes(im.flatten().tolist())) for im, c in zip(x, y))  # noqa: E731
        assert as_set(xs, ys) == as_set(xf, yf)
    assert main(["shard", "--data-dir", str(root), "--out", str(out)]) == 2  # nothing overwritten
    assert "is not empty" in capsys.readouterr().err


def _tar_shards(root, samples_by_split, classes=None):
    """Shards written by webdataset's TarWriter (an independent writer), ImageNet's {jpg|png, cls} keys."""
    root.mkdir(parents=True, exist_ok=True)
    for split, samples in samples_by_split.items():
        with wds.TarWriter(str(root / f"{split}-000000.tar")) as sink:
            for s in samples:
                sink.write(s)
    if classes is not None:
        (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root


def _png(value, size=16):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, "PNG")
    return buf.getvalue()


def _samples(n, classes=3):
    return [{"__key__": f"s{i:04d}", "png": _png(40 * (i % classes)), "cls": i % classes} for i in range(n)]


def test_shards_from_another_writer_train_end_to_end_with_their_class_names(tmp_path, capsys):
    root = _tar_shards(tmp_path / "s", {"train": _samples(48), "val": _samples(12)}, ["cat", "dog", "emu"])
    assert main(["train", "--dataset", "shards", "--data-dir", str(root), "--epochs", "2", "-b", "8",
                 "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "run"), "--data-mode", "stream",
                 "--workers", "1", "--depth", "1", "--embed-dim", "16", "--num-heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "48 train / 12 val images, 16x16x1, 3 classes, streamed from the files" in out
    cfg = json.loads((tmp_path / "run" / "last" / "config.json").read_text())
    assert cfg["preprocessing"]["class_names"] == ["cat", "dog", "emu"]


@pytest.mark.parametrize("case, message", [
    ("no_label", "sample 's0003' has no .cls member"),
    ("no_image", "sample 's0003' has no image member"),
    ("bad_label", "the class index must be an integer"),
    ("outside", "class index 7 is outside the 3 classes of classes.txt"),
    ("truncated", "not a readable tar shard, or cut short"),
    ("empty", "expected train-*.tar and val-*.tar"),
])
def test_a_bad_shard_is_one_line_naming_the_shard_and_member(tmp_path, capsys, case, message):
    train = _samples(8)
    if case == "no_label":
        del train[3]["cls"]
    elif case == "no_image":
        del train[3]["png"]
    elif case == "bad_label":
        train[3]["cls"] = b"dog"
    elif case == "outside":
        train[3]["cls"] = 7
    root = _tar_shards(tmp_path / "s", {"train": train, "val": _samples(4)} if case != "empty" else {},
                       ["cat", "dog", "emu"])
    if case == "truncated":
        shard = root / "train-000000.tar"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2 + 100])
    args = ["train", "--dataset", "shards", "--data-dir", str(root), "--epochs", "1", "-b", "4",
            "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if case in ("no_label", "no_image", "bad_label", "truncated"):
        assert str(root / "train-000000.tar") in err
        assert main(args + ["--skip-bad-images", "--output", str(tmp_path / "run2")]) == 0
        assert "bad images skipped" in capsys.readouterr().out


def test_an_image_cut_short_inside_a_shard_is_named_in_a_worker(tmp_path):
    import numpy as np
    from PIL import Image

    train = _samples(8)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16), np.uint8)).save(buf, "PNG")
    train[5]["png"] = buf.getvalue()  # noise: a PNG of a few hundred bytes, most of them pixels
    root = _tar_shards(tmp_path / "s", {"train": train, "val": _samples(4)})
    with tarfile.open(root / "train-000000.tar") as tf:
        m = next(m for m in tf.getmembers() if m.name == "s0005.png")
    shard = root / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[m.offset_data + 60: m.offset_data + m.size] = bytes(m.size - 60)  # the pixels zeroed: the header reads
    shard.write_bytes(bytes(data))
    sh = load_shard_splits(str(root), cache_dir=str(tmp_path / "c"), mode="stream")
    sh.train.workers = 1
    with pytest.raises(ValueError, match=r"train-000000\.tar:s0005\.png"):
        list(batches(sh.train, list(range(8)), 4, False, CPU))
