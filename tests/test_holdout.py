"""--holdout (issue 66: settings chosen on a validation split carved from the training images, never on the test
split): which images validate, checked against the folder's own files."""
from __future__ import annotations

import torch

from vitkit.cli.main import main
from vitkit.data.splits import DataSplits, ImageTensors

from helpers import write_digits_folder


def _splits(per_class: list[int]) -> DataSplits:
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(per_class)])
    images = torch.arange(len(labels), dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    test = ImageTensors(torch.full((3, 1, 2, 2), 255, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64))
    return DataSplits("toy", ImageTensors(images, labels), test, [str(c) for c in range(len(per_class))])


def test_the_held_out_images_are_a_class_balanced_share_of_the_training_images_and_the_test_split_is_unread():
    d = _splits([40, 20, 2, 1])
    h = d.holding_out(0.25)
    assert torch.bincount(h.val.labels).tolist() == [10, 5, 1]  # a class of one image keeps it to train on
    assert torch.bincount(h.train.labels).tolist() == [30, 15, 1, 1]
    seen = set(h.train.images[:, 0, 0, 0].tolist())
    held = set(h.val.images[:, 0, 0, 0].tolist())
    assert not seen & held and len(seen | held) == 63  # every training image once; none of the test split's (255)
    assert 255 not in held and "validating on 16 held-out training images" in h.describe()
    # after --train-fraction: held out of the share trained on, the same images on every call
    a, b = d.with_train_fraction(0.5, holdout=0.2), d.with_train_fraction(0.5, holdout=0.2)
    assert torch.equal(a.val.images, b.val.images) and len(a.train) + len(a.val) == 32


def test_train_with_holdout_validates_on_training_images(tmp_path, capsys):
    root = write_digits_folder(tmp_path / "d", per_class=10, size=16)
    assert main(["train", "--dataset", "folder", "--data-dir", str(root), "--holdout", "0.2", "--epochs", "1",
                 "--batch-size", "16", "--depth", "1", "--embed-dim", "32", "--num-heads", "2",
                 "--output", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "80 train / 20 val images" in out and "(--holdout 0.2;" in out
