"""Labelled and unlabelled images in one run (issue 83): ``--semi joint`` trains the classifier's cross-entropy and
MAE's loss (Das et al., WACV 2024) in one step, MAE on the training images ``--train-fraction`` left out and the
labelled ones; the checkpoint is an ordinary classifier with MAE's decoder beside it."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from vitkit.cli.main import main
from vitkit.data.datasets import load_dataset
from vitkit.model.ssl import JointMAE, MaskedAutoencoder, patchify, standardise_patches
from vitkit.training.config import TrainConfig
from vitkit.training.trainer import Trainer

FAST = dict(dataset="digits", epochs=2, batch_size=32, lr=1e-3, warmup_epochs=0.5, compile=False, precision="fp32",
            attention="sdpa", channels_last=False, threads=1)


def test_the_joint_loss_is_the_cross_entropy_plus_the_weighted_mae_loss_by_hand():
    """The step's loss against one computed here from the module's parts: the classifier's cross-entropy on the
    labelled batch, and MAE's squared error on the hidden patches (each standardised, He et al.'s norm_pix_loss) of
    the images drawn, with the mask the drawn noise orders."""
    t = Trainer(TrainConfig(**FAST, semi="joint", semi_weight=0.3, unlabeled_ratio=2, train_fraction=0.2),
                log=lambda s: None, progress=False)
    assert isinstance(t.module, JointMAE) and t.module.encoder is t.model
    x, y = t.data.train.images[:8], t.data.train.labels[:8]
    xs, target = t.augment(x, y, train=True, generator=torch.Generator().manual_seed(1))
    loss = t.objective.loss(t.module, xs, target, torch.Generator().manual_seed(5))

    g = torch.Generator().manual_seed(5)  # the same draws, in the objective's order: images, crops, flips, masks
    idx = torch.randint(len(t.pool), (16,), generator=g)
    u = t.augment.weak(t.pool[idx], g)
    noise = torch.rand(16, t.model.patch_embed.num_patches, generator=g)
    keep = noise.argsort(1)[:, :int(t.model.patch_embed.num_patches * 0.25)]
    hidden = torch.ones_like(noise, dtype=torch.bool).scatter(1, keep, False)
    pred = MaskedAutoencoder.forward(t.module, u, noise=noise).pred
    err = (pred - standardise_patches(patchify(u, t.model.patch_embed.cell))).pow(2).mean(-1)
    mae = err[hidden].mean()
    torch.testing.assert_close(loss, F.cross_entropy(t.model(xs), target) + 0.3 * mae)


def test_the_unlabelled_pool_is_the_left_out_images_and_the_labelled_never_the_validated():
    full = load_dataset("digits")
    t = Trainer(TrainConfig(**FAST, semi="joint", train_fraction=0.25, holdout=0.2), log=lambda s: None,
                progress=False)
    labelled, held = t.data.train.images, t.data.val.images
    assert len(t.pool) == len(full.train) - len(held)  # every training image but the ones validated on
    rows = {bytes(im.numpy()) for im in t.pool}
    assert all(bytes(im.numpy()) in rows for im in labelled)
    assert not any(bytes(im.numpy()) in rows for im in held)  # (digits has no two images alike among these)


def test_a_joint_run_trains_saves_a_classifier_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--semi", "joint", "--train-fraction", "0.2", "--epochs", "2", "-b", "32", "--output", str(run)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--semi joint: MAE's loss (weight 0.5" in out and "1,150 unlabelled and the 287 labelled" in out
    assert json.loads((run / "best" / "ssl.json").read_text())["method"] == "mae"  # the decoder beside it
    assert main(["eval", "--checkpoint", str(run / "best")]) == 0  # read as an ordinary classifier
    assert "top-1" in capsys.readouterr().out
    state = torch.load(run / "last" / "train_state.pt", weights_only=False)
    assert any(k.startswith("decoder_") for k in state["model"])  # resumable with its decoder
    assert main([*args[:-4], "--epochs", "3", "--output", str(run), "--resume", "auto"]) == 0
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "epoch" in r][-1] == 3


def test_semi_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="semi joint: learns a classifier"):
        TrainConfig(dataset="digits", semi="joint", objective="mae")
    with pytest.raises(ValueError, match="freeze_body trains the head alone: one or the other"):
        TrainConfig(dataset="digits", semi="joint", freeze_body=True)  # (was "optimizer got an empty parameter list")
    with pytest.raises(ValueError, match="semi must be one of"):
        TrainConfig(dataset="digits", semi="fixmatch-typo")
    from vitkit.data.splits import DataSplits
    from vitkit.training.trainer import unlabelled_pool

    d = load_dataset("digits")
    streamed = DataSplits("photos", object(), d.val, d.classes)
    with pytest.raises(ValueError, match="held in memory, and photos is streamed"):
        unlabelled_pool(TrainConfig(dataset="digits", semi="joint"), streamed, streamed)


def test_the_encoders_learning_rates_are_the_classifiers_own_beside_the_decoder():
    """--layer-decay and --body-lr-scale through the joint module: each encoder parameter's scale as for the bare
    classifier; the decoder's the head's (the rates given)."""
    from vitkit.training.optim import param_groups

    cfg = TrainConfig(**FAST, semi="joint", layer_decay=0.75, body_lr_scale=0.5)
    t = Trainer(cfg, log=lambda s: None, progress=False)
    scale = {id(p): g["lr_scale"] for g in param_groups(t.model, cfg) for p in g["params"]}
    joint = {id(p): g["lr_scale"] for g in param_groups(t.module, cfg) for p in g["params"]}
    assert all(joint[i] == s for i, s in scale.items())
    decoder = [p for n, p in t.module.named_parameters() if not n.startswith("encoder.")]
    assert decoder and all(joint[id(p)] == 1.0 for p in decoder)


def test_more_unlabelled_images_from_a_folder_join_the_pool_at_the_labelled_size(tmp_path):
    """--unlabeled DIR: a folder's images (its train/ alone: class folders ignored, val/ never read) at the labelled
    images' size; another channel count is refused by name."""
    from helpers import write_digits_folder

    more = write_digits_folder(tmp_path / "more", per_class=3, size=16)  # 30 in train/, 30 in val/ (not read)
    said = []
    t = Trainer(TrainConfig(**FAST, semi="joint", train_fraction=0.5, unlabeled=str(more)), log=said.append,
                progress=False)
    assert len(t.pool) == 1437 + 30 and t.pool.shape[1:] == (1, 8, 8)
    assert any("--unlabeled" in s and "30 images at 8x8" in s for s in said)
    rgb = write_digits_folder(tmp_path / "rgb", per_class=1, size=16, mode="RGB")
    with pytest.raises(ValueError, match="images of 3 channels, and digits's have 1"):
        Trainer(TrainConfig(**FAST, semi="joint", unlabeled=str(rgb)), log=lambda s: None, progress=False)
    with pytest.raises(ValueError, match="learnt from by --semi joint or fixmatch"):
        TrainConfig(**FAST, unlabeled=str(more))


def test_more_unlabelled_images_from_webdataset_shards_join_the_pool(tmp_path):
    """--unlabeled SHARDS: the shards `vitkit shard` writes (its train shards alone read), or train shards with no
    val ones beside them, at the labelled images' size. (It said "no image files" before.)"""
    import shutil

    from helpers import write_digits_folder

    more = write_digits_folder(tmp_path / "more", per_class=3, size=16)
    assert main(["shard", "--data-dir", str(more), "--out", str(tmp_path / "shards")]) == 0
    t = Trainer(TrainConfig(**FAST, semi="fixmatch", train_fraction=0.5, unlabeled=str(tmp_path / "shards")),
                log=lambda s: None, progress=False)
    assert len(t.pool) == 1437 + 30 and t.pool.shape[1:] == (1, 8, 8)  # the 30 train images, not the val ones
    alone = tmp_path / "train-only"
    alone.mkdir()
    for f in (tmp_path / "shards").glob("train-*.tar"):
        shutil.copy(f, alone / f.name)
    t = Trainer(TrainConfig(**FAST, semi="fixmatch", train_fraction=0.5, unlabeled=str(alone)),
                log=lambda s: None, progress=False)
    assert len(t.pool) == 1437 + 30


def test_resuming_with_semi_given_or_left_out_against_the_run_is_refused_by_name(tmp_path, capsys):
    """A plain run resumed with --semi joint failed on the state's keys ("missing ['decoder_blocks.0...'"); a
    joint run resumed without the flag goes on as it was (its config.json says joint)."""
    plain, joint = str(tmp_path / "plain"), str(tmp_path / "joint")
    assert main(["train", "--epochs", "1", "-b", "64", "--output", plain]) == 0
    assert main(["train", "--epochs", "2", "-b", "64", "--output", plain, "--resume", "auto", "--semi", "joint"]) == 2
    assert "trained without --semi joint, and a resumed run goes on as it was" in capsys.readouterr().err
    assert main(["train", "--semi", "joint", "--epochs", "1", "-b", "64", "--output", joint]) == 0
    assert main(["train", "--epochs", "2", "-b", "64", "--output", joint, "--resume", "auto"]) == 0
    assert "--semi joint: MAE's loss" in capsys.readouterr().out


def test_muon_trains_the_encoders_block_matrices_through_the_joint_module_and_adamw_the_decoder():
    """CIFAR-10's recipe below 20 epochs a budget takes Muon: through the joint module it found no block matrices
    ("opt muon: the model has no trainable weight matrices") and the run stopped before its first step."""
    t = Trainer(TrainConfig(**{**FAST, "opt": "muon"}, semi="joint"), log=lambda s: None, progress=False)
    muon = {id(p) for g in t.optimizer.muon.param_groups for p in g["params"]}
    blocks = {id(p) for n, p in t.model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    decoder = {id(p) for n, p in t.module.named_parameters() if not n.startswith("encoder.")}
    assert muon == blocks and not muon & decoder


def test_a_joint_step_is_timed_and_cached_apart_from_the_plain_step():
    from vitkit.training.probe import step_workload
    from vitkit.training.build import build_model

    plain = TrainConfig(**FAST)
    model = build_model(plain, load_dataset("digits"))
    key = step_workload(plain, model, 32, torch.device("cpu"))
    joint = step_workload(TrainConfig(**FAST, semi="joint"), model, 32, torch.device("cpu"))
    more = step_workload(TrainConfig(**FAST, semi="joint", unlabeled_ratio=3), model, 32, torch.device("cpu"))
    assert len({json.dumps(k, sort_keys=True) for k in (key, joint, more)}) == 3


def test_the_joint_step_is_one_compiled_graph():
    """The classifier's forward and MAE's in one call, the noise drawn outside: torch.compile traces one graph with
    no break (a GPU run compiles its step; counted here with torch._dynamo.explain)."""
    import torch._dynamo

    from vitkit.model.ssl import draw_noise

    t = Trainer(TrainConfig(**FAST, semi="joint", train_fraction=0.5), log=lambda s: None, progress=False)
    g = torch.Generator().manual_seed(0)
    x, target = t.augment(t.data.train.images[:16], t.data.train.labels[:16], train=True, generator=g)
    u = t.objective.unlabelled(x, g)
    e = torch._dynamo.explain(t.module)(x, u, noise=draw_noise(t.module, u, g))
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons


# --semi fixmatch (Sohn et al., NeurIPS 2020)

def test_the_fixmatch_loss_is_the_labelled_cross_entropy_plus_the_confident_pseudo_labels_by_hand():
    """The objective's loss against one computed here: pseudo-labels are the argmax of the model's softmax on the weak
    views; only those at or above the threshold count, averaged over every unlabelled image (FixMatch's Eq. 4), and
    their targets train the strong views. The model is a fixed function of the image so the draws do not matter."""
    t = Trainer(TrainConfig(**FAST, semi="fixmatch", semi_threshold=0.6, unlabeled_ratio=2, train_fraction=0.2),
                log=lambda s: None, progress=False)
    assert t.objective.weight == 1.0  # FixMatch's lambda_u when --semi-weight is not given
    w = torch.randn(64, 10) * 3

    def fwd(x):  # a linear classifier of the pixels: confident on some images, not on others
        return x.flatten(1) @ w

    views = {}
    t.augment.weak = lambda u, g=None: views.setdefault("weak", torch.randn(len(u), 1, 8, 8))
    t.augment.strong = lambda u, g=None: views.setdefault("strong", torch.randn(len(u), 1, 8, 8))
    x, target = torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    loss = t.objective.loss(fwd, x, target, torch.Generator().manual_seed(0))
    p = F.softmax(fwd(views["weak"]), -1)
    confident = p.max(-1).values >= 0.6
    assert 0 < int(confident.sum()) < 16  # the case is one where the threshold decides
    per_image = F.cross_entropy(fwd(views["strong"]), p.argmax(-1), reduction="none")
    want = F.cross_entropy(fwd(x), target, label_smoothing=t.cfg.smoothing) + (per_image * confident).sum() / 16
    torch.testing.assert_close(loss, want)
    assert t.objective.confident_share() == pytest.approx(float(confident.float().mean()))
    assert t.objective.confident_share() is None  # read: the count starts again


def test_the_strong_view_is_randaugment_and_cutout_of_the_weak_crop():
    from vitkit.data.augment import BatchAugment, cutout

    x = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    cut = cutout(x, torch.Generator().manual_seed(0))
    grey = (cut == 127).all(1)  # one square an image, the three channels alike
    sides = grey.sum((1, 2)).float().sqrt()
    assert (sides <= 16.0 + 1e-6).all() and (grey.flatten(1).any(1)).float().mean() > 0.8
    rows, cols = grey.any(2), grey.any(1)  # a square (cut by the border, a rectangle): rows x cols pixels
    assert torch.equal(grey.sum((1, 2)), rows.sum(1) * cols.sum(1))
    aug = BatchAugment([0.5] * 3, [0.25] * 3, (32, 32), 10)
    photos = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    weak, strong = aug.weak(photos), aug.strong(photos, torch.Generator().manual_seed(1))
    assert strong.shape == weak.shape == (16, 3, 32, 32) and strong.dtype == torch.float32
    assert not torch.allclose(weak, strong)


def test_a_fixmatch_run_logs_its_confident_share_and_saves_a_plain_classifier(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--semi", "fixmatch", "--semi-threshold", "1e-6", "--train-fraction", "0.2", "--epochs", "2",
                 "-b", "32", "--output", str(run), "--compile", "false"]) == 0
    out = capsys.readouterr().out
    assert "--semi fixmatch: pseudo-labels of weakly augmented images where the model's softmax reaches 1e-06" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["confident_share"] for r in rows] == [1.0, 1.0]  # every softmax reaches 1e-6
    from safetensors import safe_open

    with safe_open(str(run / "best" / "model.safetensors"), "pt") as f:
        assert not any("decoder" in k for k in f.keys())  # nothing beside the classifier
    with pytest.raises(ValueError, match="semi_threshold must be > 0"):
        TrainConfig(semi="fixmatch", semi_threshold=0)
    with pytest.raises(ValueError, match="its strong augmentation works on images of one size"):
        TrainConfig(semi="fixmatch", naflex=True, dataset="folder", data_dir=str(tmp_path))


def test_semi_auto_reads_the_measurements_and_takes_a_route_only_where_it_beat_the_default():
    """``auto`` chooses from results/semi-supervised.csv (its copy in the code is checked against the file here):
    the default recipe where neither route beat it, a route where one did, and the default, saying so, where
    nothing was measured near this budget, label fraction or device."""
    import csv
    from dataclasses import replace
    from pathlib import Path

    from vitkit.training.semi_choice import MEASURED, Measured, choose_semi

    arms = {"default": None, "--semi joint": "joint", "--semi fixmatch": "fixmatch"}  # (not the --holdout rows)
    with open(Path(__file__).parents[1] / "results" / "semi-supervised.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["arm"] in arms]
    assert sorted(MEASURED, key=repr) == sorted(
        (Measured("cpu" if "EPYC" in r["machine"] or "Xeon" in r["machine"] else "cuda", float(r["budget_min"]),
                  float(r["train_fraction"]), arms[r["arm"]], float(r["val_top1"])) for r in rows), key=repr)
    cfg = TrainConfig(dataset="digits", semi="auto", train_fraction=0.1, time_limit=5)
    out, note = choose_semi(cfg, "cpu")  # default (63.12 + 62.35 + 67.69) / 3 beat fixmatch (56.76 + 63.08) / 2, joint
    assert out.semi is None and "semi: auto -> none" in note and "default 64.39%, fixmatch 59.92%, joint 49.77%" in note
    out, note = choose_semi(replace(cfg, time_limit=30), "cpu")
    assert out.semi is None and "neither route was measured" in note and "--time-limit 30" in note
    assert choose_semi(cfg, "cuda")[0].semi is None and choose_semi(replace(cfg, time_limit=None), "cpu")[0].semi is None
    won = MEASURED + (Measured("cpu", 4, 0.15, "fixmatch", 80.0),)  # (within a factor of 2 of 5 min and 0.1)
    out, note = choose_semi(cfg, "cpu", won)
    assert out.semi == "fixmatch" and note.startswith("semi: auto -> fixmatch: measured best at 4/5 min with "
                                                      "0.1/0.15 of the labels")  # (every measurement it read)
    out, note = choose_semi(replace(cfg, unlabeled="more-images"), "cpu")  # not read where no route trains
    assert out.unlabeled is None and "--unlabeled more-images is not read" in note
    assert choose_semi(replace(cfg, semi="joint"), "cpu") == (replace(cfg, semi="joint"), "")


def test_a_semi_auto_run_says_its_choice_and_keeps_it_in_the_plan(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--semi", "auto", "--train-fraction", "0.2", "--epochs", "1", "-b", "32", "--output",
                 str(run), "--compile", "false"]) == 0
    out = capsys.readouterr().out
    assert "semi: auto -> none: neither route was measured" in out and "--semi" not in out.split("semi: auto")[0]
    assert any("semi: auto -> none" in n for n in json.loads((run / "plan.json").read_text())["notes"])
    assert "semi: null" in (run / "config.yaml").read_text()
    # the same command again with --resume: it goes on as it was decided (not decided again, perhaps otherwise)
    assert main(["train", "--semi", "auto", "--train-fraction", "0.2", "--epochs", "2", "-b", "32", "--output",
                 str(run), "--compile", "false", "--resume", "auto"]) == 0
    assert "semi: auto" not in capsys.readouterr().out


def test_fixmatch_trains_without_the_recipes_label_smoothing_unless_asked():
    """Smoothing 0.1 over 10 classes trains the softmax towards 0.91 at most, under the 0.95 a pseudo-label needs: a
    30-minute CIFAR-10 run at 10% of the labels found 0% of them confident in each of 12 epochs. FixMatch's recipe has
    no smoothing: the recipe's is dropped (its tiers' too), and said; one the user sets stays."""
    from vitkit.training.plan import Sources, resolve

    said: list[str] = []
    cfg, _, _ = resolve(Sources({"dataset": "digits", "semi": "fixmatch", "train_fraction": 0.2}), said.append)
    assert cfg.smoothing == 0.0 and any(s.startswith("--semi fixmatch: no label smoothing (the recipe's 0.1") for s in said)
    assert all("smoothing" not in tier for tier in cfg.tiers or [])
    cfg, _, _ = resolve(Sources({"dataset": "digits", "semi": "fixmatch", "smoothing": 0.1}), lambda s: None)
    assert cfg.smoothing == 0.1  # the user's own
    cfg, _, _ = resolve(Sources({"dataset": "fashion-mnist", "semi": "fixmatch"}), lambda s: None)
    assert cfg.smoothing == 0.0 and all("smoothing" not in tier for tier in cfg.tiers or [])
    assert resolve(Sources({"dataset": "digits", "semi": "joint"}), lambda s: None)[0].smoothing == 0.1  # (joint: kept)
