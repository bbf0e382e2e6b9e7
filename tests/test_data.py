"""Every dataset loader on local files, and the batch augmentation."""
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data.augment import BatchAugment, random_crop
from vitkit.data.datasets import (FASHION_MNIST_SYSTEM_DIR, load_dataset, load_folder_splits, load_idx_splits,
                                  read_idx)
from vitkit.data.images import BadImageError, open_image, to_array
from vitkit.training.recipes import choose_recipe

from helpers import cifar_slice, digits_arrays, write_digits_folder, write_idx


def test_digits_is_the_real_sklearn_set_with_a_fixed_split():
    d = load_dataset("digits")
    assert (len(d.train), len(d.val), d.in_chans, d.img_size, d.num_classes) == (1437, 360, 1, (8, 8), 10)
    assert d.train.images.dtype == torch.uint8 and int(d.train.images.max()) == 255
    assert torch.equal(load_dataset("digits").val.labels, d.val.labels)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_files_plain_and_gzipped(tmp_path, gz):
    x, y = digits_arrays()
    x28 = np.stack([np.asarray(Image.fromarray(a).resize((28, 28))) for a in x[:60]])
    write_idx(tmp_path, "train", x28[:50], y[:50], gz)
    write_idx(tmp_path, "t10k", x28[50:], y[50:60], gz)
    d = load_idx_splits("mnist", str(tmp_path), download=False)
    assert d.train.images.shape == (50, 1, 28, 28) and d.val.images.shape == (10, 1, 28, 28)
    assert torch.equal(d.train.images[3, 0], torch.from_numpy(x28[3]))
    assert d.train.labels.tolist() == y[:50].tolist()


def test_truncated_idx_names_the_file(tmp_path):
    write_idx(tmp_path, "train", np.zeros((4, 28, 28)), np.zeros(4), gz=False)
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte: IDX header says"):
        read_idx(p)


@pytest.mark.skipif(not Path(FASHION_MNIST_SYSTEM_DIR).is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_from_the_debian_package():
    d = load_dataset("fashion-mnist")
    assert (len(d.train), len(d.val), d.img_size, d.classes[9]) == (60000, 10000, (28, 28), "Ankle boot")


def test_cifar10_in_torchvision_format(tmp_path, monkeypatch):
    import pickle

    import torchvision

    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 6)]:
        with open(root / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": list(range(n))}, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    # the files are ours, so torchvision's md5 check of the official archive does not apply
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    d = load_dataset("cifar10", str(tmp_path))
    assert d.train.images.shape == (20, 3, 32, 32) and d.val.images.shape == (6, 3, 32, 32)
    assert d.classes[0] == "c0"


def test_cifar_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="--download"):
        load_dataset("cifar10", str(tmp_path))


def test_idx_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\[\.gz\] not found in .*--download"):
        load_dataset("mnist", str(tmp_path))


@pytest.mark.parametrize("name", ["cifar10", "fashion-mnist"])
def test_a_failed_download_names_dataset_and_folder(tmp_path, monkeypatch, name):
    """--download with the network unreachable: torchvision's sources are pointed at a closed local port, so the
    test never downloads (and fails the same way with or without internet)."""
    import torchvision

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "mirrors", ["http://127.0.0.1:9/"])
    with pytest.raises(FileNotFoundError, match=rf"{name}: --download into {tmp_path} failed \(.*\); without internet"):
        load_dataset(name, str(tmp_path), download=True)


def test_folder_of_grayscale_pngs_and_its_zip(tmp_path):
    root = write_digits_folder(tmp_path / "digits", per_class=5, size=16, val_split="test")
    d = load_folder_splits(str(root), cache_dir=str(tmp_path / "cache"))
    assert (len(d.train), len(d.val), d.in_chans, d.img_size, d.classes[:3]) == (50, 50, 1, (16, 16), ["0", "1", "2"])
    assert choose_recipe(d) == "digits"
    z = tmp_path / "digits.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for p in sorted(root.rglob("*.png")):
            zf.write(p, Path("wrapped") / p.relative_to(root))
    dz = load_folder_splits(str(z), cache_dir=str(tmp_path / "cache"))
    assert torch.equal(dz.train.images, d.train.images) and torch.equal(dz.val.labels, d.val.labels)
    # second load comes from the cache and is identical
    again = load_folder_splits(str(z), cache_dir=str(tmp_path / "cache"))
    assert torch.equal(again.train.images, dz.train.images)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2


def test_real_cifar10_jpeg_zip_slice(tmp_path):
    z = cifar_slice(tmp_path, per_class=3)
    if z is None:
        pytest.skip("shared CIFAR-10 zip not present")
    d = load_folder_splits(str(z))
    assert (len(d.train), len(d.val), d.in_chans, d.img_size) == (30, 30, 3, (32, 32))
    assert d.classes == sorted(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                                "truck"])
    assert choose_recipe(d) == "cifar10"


def test_corrupt_image_is_named_or_skipped(tmp_path):
    root = write_digits_folder(tmp_path / "f", per_class=3)
    bad = root / "train" / "3" / "broken.png"
    bad.write_bytes((root / "train" / "3").glob("*.png").__next__().read_bytes()[:40])
    with pytest.raises(BadImageError, match="broken.png"):
        load_folder_splits(str(root))
    d = load_folder_splits(str(root), skip_bad_images=True)
    assert d.skipped == 1 and len(d.train) == 30


def test_a_large_decode_on_a_process_a_core_gives_the_same_pixels_and_names_a_bad_image(tmp_path, monkeypatch):
    """Splits of PARALLEL_FROM images or more are decoded by a process a core (CIFAR-10's 60,000 JPEGs: 8.2 s in one
    on 2 cores): the same tensors, in the same order, as one process decodes, and a bad image named or skipped."""
    from vitkit.data import folder

    root = write_digits_folder(tmp_path / "f", per_class=6)
    bad = root / "train" / "3" / "broken.png"
    bad.write_bytes((root / "train" / "3").glob("*.png").__next__().read_bytes()[:40])
    one = load_folder_splits(str(root), skip_bad_images=True)
    monkeypatch.setattr(folder, "PARALLEL_FROM", 8)
    monkeypatch.setattr(folder, "CHUNK", 7)  # chunks that end inside a class, and a last short one
    monkeypatch.setattr(folder, "usable_cores", lambda: 2)
    many = load_folder_splits(str(root), skip_bad_images=True)
    assert torch.equal(one.train.images, many.train.images) and torch.equal(one.train.labels, many.train.labels)
    assert torch.equal(one.val.images, many.val.images) and many.skipped == one.skipped == 1
    with pytest.raises(BadImageError, match="broken.png: "):
        load_folder_splits(str(root))


def test_empty_class_and_mismatched_classes(tmp_path):
    root = write_digits_folder(tmp_path / "f", per_class=2)
    (root / "train" / "empty").mkdir()
    with pytest.raises(ValueError, match="train/empty has no images"):
        load_folder_splits(str(root))
    (root / "train" / "empty").rmdir()
    for p in (root / "val" / "7").iterdir():
        p.unlink()
    (root / "val" / "7").rmdir()
    with pytest.raises(ValueError, match=r"classes differ between train/ and val/: only in train \['7'\]"):
        load_folder_splits(str(root))


def test_folder_without_splits_says_what_it_expects(tmp_path):
    (tmp_path / "x" / "cats").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="expected .*/train/<class>/<image>"):
        load_folder_splits(str(tmp_path / "x"))


def test_fake_data_loader():
    d = load_dataset("fake")
    assert d.train.images.shape[1:] == (3, 16, 16) and d.num_classes == 4


def test_image_decoding_exif_alpha_and_channels(tmp_path):
    im = Image.new("RGBA", (4, 2), (255, 0, 0, 0))  # fully transparent red -> white
    a = to_array(im, 3)
    assert a.shape == (3, 2, 4) and (a == 255).all()
    rgb = Image.new("RGB", (6, 3), (10, 20, 30))
    exif = rgb.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    p = tmp_path / "r.jpg"
    rgb.save(p, exif=exif)
    loaded = open_image(p.read_bytes(), str(p))
    assert loaded.size == (3, 6)
    assert to_array(loaded, 1).shape == (1, 6, 3)
    with pytest.raises(BadImageError, match=r"6x3 = 18 pixels, more than the limit of 10 an image may decode to$"):
        open_image(p.read_bytes(), "big.jpg", max_pixels=10)


def test_random_crop_is_a_shifted_window_of_the_padded_image():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.uint8).reshape(2, 1, 5, 5)
    g = torch.Generator().manual_seed(0)
    out = random_crop(x, 2, g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        assert any(torch.equal(out[b], padded[b, :, i:i + 5, j:j + 5]) for i in range(5) for j in range(5))


def test_batch_augment_normalises_and_mixes():
    aug = BatchAugment([0.5], [0.25], (8, 8), 10, crop_padding=1, hflip=True, aa="trivial", mixup=0.8, cutmix=1.0)
    x = torch.full((16, 1, 8, 8), 128, dtype=torch.uint8)
    y = torch.arange(16) % 10
    xe, ye = aug(x, y, train=False)
    torch.testing.assert_close(xe, torch.full((16, 1, 8, 8), (128 / 255 - 0.5) / 0.25))
    xt, yt = aug(x, y, train=True)
    assert xt.shape == (16, 1, 8, 8) and yt.shape == (16, 10)
    torch.testing.assert_close(yt.sum(1), torch.ones(16))


def test_the_digits_read_back_from_the_cache_are_scikit_learns_split(tmp_path):
    """The digits are kept in vitkit's cache after the first read (importing scikit-learn costs 2 s a run): what
    comes back is scikit-learn's own images and stratified split, bit for bit."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from vitkit.data.datasets import load_digits_splits

    d = load_digits()
    tr, va = train_test_split(np.arange(len(d.target)), test_size=0.2, random_state=0, stratify=d.target)
    first = load_digits_splits(cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("digits-*.safetensors"))) == 1
    again = load_digits_splits(cache_dir=str(tmp_path))
    for got in (first, again):
        assert torch.equal(got.train.labels, torch.from_numpy(d.target[tr]))
        assert torch.equal(got.val.labels, torch.from_numpy(d.target[va]))
        want = torch.from_numpy(np.round(d.images[va] * 255 / 16).astype(np.uint8))[:, None]
        assert torch.equal(got.val.images, want) and got.classes == [str(i) for i in range(10)]


@pytest.mark.parametrize("damage", ["cut short", "empty", "bad json", "wrong tensors"])
def test_a_damaged_cache_is_decoded_again_and_rewritten(tmp_path, damage):
    """The cache is only a copy: one that cannot be read whole is a miss, never a traceback or wrong data."""
    from safetensors.torch import save_file

    from vitkit.data.datasets import load_digits_splits

    first = load_digits_splits(cache_dir=str(tmp_path))
    cache = next(tmp_path.glob("digits-*.safetensors"))
    if damage == "cut short":
        cache.write_bytes(cache.read_bytes()[:1000])
    elif damage == "empty":
        cache.write_bytes(b"")
    elif damage == "bad json":
        Path(str(cache) + ".json").write_text("{not json")
    else:
        save_file({"train_x": torch.zeros(3, 8, 8), "train_y": torch.zeros(3)}, str(cache))
    again = load_digits_splits(cache_dir=str(tmp_path))
    assert torch.equal(again.train.images, first.train.images) and torch.equal(again.val.labels, first.val.labels)
    assert load_digits_splits(cache_dir=str(tmp_path)).train.images.shape == first.train.images.shape  # rewritten


def test_the_mean_and_std_summed_a_chunk_at_a_time_are_torchs_over_the_whole(monkeypatch):
    """Issue 80 F10: mean_std turned up to 20,000 images to float32 at once (3.9 GiB at 128 px, on a GPU where they
    were resident); now a chunk at a time, with torch's mean and unbiased std over them all as the reference."""
    from vitkit.data import splits
    from vitkit.data.splits import DataSplits, ImageTensors

    g = torch.Generator().manual_seed(0)
    images = (torch.rand(50, 3, 9, 7, generator=g) ** 2 * 255).to(torch.uint8)  # skewed, unequal channels
    images[:, 1] //= 4
    data = DataSplits("x", ImageTensors(images, torch.zeros(50, dtype=torch.int64)),
                      ImageTensors(images[:2], torch.zeros(2, dtype=torch.int64)), ["a"])
    monkeypatch.setattr(splits, "STATS_CHUNK", 7)
    mean, std = data.mean_std()
    x = images.double() / 255
    assert mean == pytest.approx(x.mean(dim=(0, 2, 3)).tolist(), abs=1e-6)
    assert std == pytest.approx(x.std(dim=(0, 2, 3)).tolist(), abs=1e-6)
