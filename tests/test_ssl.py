"""Learning from unlabeled images (issue 59): the paper's masked patch prediction (§4.6, B.1.2) and MAE, checked
against Hugging Face's ViTMAEForPreTraining (weights it writes, the same noise), timm, and values worked out by hand."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vitkit.cli.main import main
from vitkit.model import ViTConfig, VisionTransformer
from vitkit.model.ssl import (MaskedAutoencoder, MaskedPatchPrediction, mpp_targets, patchify, quantised_colour,
                              unpatchify)

from helpers import write_digits_folder

transformers = pytest.importorskip("transformers")
TINY = ["--depth", "1", "--embed-dim", "32", "--num-heads", "2"]


def _encoder(**kw):
    c = dict(img_size=16, patch_size=4, in_chans=3, num_classes=0, embed_dim=32, depth=2, num_heads=4)
    return VisionTransformer(ViTConfig(**{**c, **kw}))


def test_patchify_is_hugging_faces_and_unpatchify_undoes_it():
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    x = torch.randn(2, 3, 16, 24)
    hf = ViTMAEForPreTraining(ViTMAEConfig(image_size=16, patch_size=4, hidden_size=8, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=16, decoder_hidden_size=8,
                                           decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                                           decoder_intermediate_size=16))
    assert torch.equal(patchify(x[..., :16], 4), hf.patchify(x[..., :16]))
    assert torch.equal(unpatchify(patchify(x, 4), 4, (4, 6), 3), x)


def test_the_colour_classes_are_each_channels_three_bits_of_the_raw_pixels():
    """(1.0, 0.0, 0.5): levels 7, 0 and 4 of 8 -> 7*64 + 0*8 + 4 = 452; one channel: 8 classes."""
    assert quantised_colour(torch.tensor([[1.0, 0.0, 0.5]]), 3).tolist() == [452]
    assert quantised_colour(torch.tensor([[0.999], [0.124], [0.125]]), 1).tolist() == [7, 0, 1]
    raw = torch.zeros(1, 3, 8, 8)
    raw[:, 0, :4, :4] = 1.0  # the top-left patch: red 1, green 0, blue 0 -> 7*64 = 448
    raw[:, 2, 4:, 4:] = torch.tensor([[0.2, 0.4], [0.6, 0.8]]).repeat(2, 2)  # mean 0.5 -> level 4
    assert mpp_targets(raw, 4, "mean").tolist() == [[448, 0, 0, 4]]
    four = mpp_targets(raw, 4, "4x4")  # each 1x1 cell of the 4x4 patch (patch 4): the pixels themselves
    assert four.shape == (1, 4, 16) and four[0, 0].tolist() == [448] * 16
    assert four[0, 3].tolist()[:4] == [1, 3, 1, 3]  # 0.2 -> 1, 0.4 -> 3 (row 0 of the bottom-right patch)
    assert torch.equal(mpp_targets(raw, 4, "l2"), patchify(raw, 4))


def test_mpp_corrupts_half_the_patches_eighty_ten_ten():
    mpp = MaskedPatchPrediction(_encoder(img_size=32))
    corrupted, to_mask, to_other = mpp.choose(torch.rand(3, 400, 64, generator=torch.Generator().manual_seed(0)))
    assert (corrupted.sum(1) == 32).all()  # exactly 50% of every image's patches
    share = corrupted.sum().item()
    assert abs(to_mask.sum().item() / share - 0.8) < 0.02 and abs(to_other.sum().item() / share - 0.1) < 0.02
    assert not (to_mask & ~corrupted).any() and not (to_mask & to_other).any()


def test_mpp_learns_the_colours_of_the_pixels_not_of_the_standardised_values(tmp_path):
    """Colours quantised after standardisation are not the image's; the objective un-standardises the batch first:
    its targets are the uint8 pixels' own colours."""
    from vitkit.data.augment import BatchAugment
    from vitkit.training.config import TrainConfig
    from vitkit.training.objectives import objective_for

    rng = np.random.default_rng(0)
    u8 = torch.from_numpy(rng.integers(0, 256, (8, 3, 16, 16), dtype=np.uint8))
    aug = BatchAugment([0.45, 0.5, 0.55], [0.2, 0.25, 0.3], (16, 16), 10)
    x, _ = aug(u8, torch.zeros(8, dtype=torch.long), train=False)
    obj = objective_for(TrainConfig(objective="mpp"), aug)
    mine = mpp_targets(obj.raw(x), 4, "mean")
    assert torch.equal(mine, mpp_targets(u8.float() / 255, 4, "mean"))  # the pixels' colours, exactly
    assert len(mine.unique()) > 20  # (un-standardised with the 0-255 statistics, every patch was colour 511)
    assert (mpp_targets(x.clamp(0, 1), 4, "mean") != mine).float().mean() > 0.5  # standardised: other colours


def _hf_mae(norm_pix: bool):
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(0)
    c = ViTMAEConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=256, decoder_hidden_size=32,
                     decoder_num_hidden_layers=2, decoder_num_attention_heads=2, decoder_intermediate_size=128,
                     mask_ratio=0.75, norm_pix_loss=norm_pix)
    return ViTMAEForPreTraining(c).eval()


@pytest.mark.parametrize("norm_pix", [True, False])
def test_mae_gives_hugging_faces_loss_and_reconstruction_for_the_same_noise(norm_pix):
    from vitkit.interop.mae import from_hf_mae

    hf = _hf_mae(norm_pix)
    mine = from_hf_mae(hf).eval()
    x, noise = torch.randn(3, 3, 32, 32), torch.rand(3, 64)
    with torch.no_grad():
        theirs = hf(pixel_values=x, noise=noise)
        ours = mine(x, noise=noise)
    assert torch.equal(ours.mask, theirs.mask.bool())
    assert torch.allclose(ours.pred, theirs.logits, atol=1e-5)
    assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=1e-5)
    # the encoder alone is an ordinary vitkit ViT: Hugging Face's ViTMAEModel output on the visible patches
    with torch.no_grad():
        enc = hf.vit(pixel_values=x, noise=noise).last_hidden_state
        keep = torch.argsort(noise, 1)[:, :16]
        z = mine.encoder.norm(mine.encoder.blocks(mine.encoder.embed_patches(mine.encoder.patch_embed(x), (8, 8),
                                                                              keep)))
    assert torch.allclose(z, enc, atol=1e-5)


def test_a_hugging_face_mae_continues_pre_training_from_its_saved_folder(tmp_path, capsys):
    """`vitkit pretrain --method mae --init` a folder transformers wrote (ViTMAEForPreTraining): its decoder with."""
    from vitkit.interop.mae import from_hf_mae

    hf = _hf_mae(True)
    hf.save_pretrained(tmp_path / "hf")
    mae = from_hf_mae(tmp_path / "hf")
    sd = {k: v for k, v in hf.state_dict().items()}
    assert torch.equal(mae.decoder_pred.weight, sd["decoder.decoder_pred.weight"])
    assert torch.equal(mae.encoder.pos_embed, sd["vit.embeddings.position_embeddings"])


def test_timm_mae_weights_are_a_plain_vit_without_a_head(tmp_path):
    timm = pytest.importorskip("timm")
    import vitkit

    t = timm.create_model("vit_base_patch16_224.mae", pretrained=False).eval()  # (its config: no head)
    from safetensors.torch import save_file

    save_file(t.state_dict(), str(tmp_path / "mae.safetensors"))
    mine = vitkit.load(str(tmp_path / "mae.safetensors")).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(mine.forward_features(x), t.forward_features(x), atol=1e-5)
    assert mine.config.num_classes == 0


def test_the_mae_reconstruction_is_the_visible_patches_and_the_prediction_in_pixels():
    torch.manual_seed(0)
    mae = MaskedAutoencoder(_encoder(), norm_pix_loss=True).eval()
    x = torch.randn(2, 3, 16, 16)
    noise = torch.rand(2, 16)
    with torch.no_grad():
        out = mae(x, noise=noise)
        rec = mae.reconstruct(x, out)
    out_noise = lambda _: noise  # noqa: E731 - the same mask again
    keep = ~out.mask.bool()
    assert torch.equal(patchify(rec, 4)[keep], patchify(x, 4)[keep])  # the visible patches as they are
    t = patchify(x, 4)
    for b in range(2):  # un-standardised with what the model could know: its visible patches' average level
        vis = t[b][keep[b]]
        mean, std = vis.mean(-1).mean(), (vis.var(-1) + 1e-6).sqrt().mean()
        want = out.pred[b] * std + mean
        assert torch.allclose(patchify(rec, 4)[b][~keep[b]], want[~keep[b]], atol=1e-5)
    # nothing of a hidden patch reaches the picture: other pixels there, the same reconstruction (issue 66: the
    # figures had painted each hidden patch's true brightness and contrast)
    hidden = unpatchify(torch.where(out.mask[..., None].bool(), torch.randn_like(t) * 5 + 3, t), 4, (4, 4), 3)
    with torch.no_grad():
        again = mae.reconstruct(hidden, mae(hidden, noise=out_noise(out)))
    assert torch.allclose(again, rec, atol=1e-5)


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("method", ["mae", "mpp"])
def test_pretrain_saves_an_ordinary_encoder_that_fine_tunes_and_its_parts_beside_it(method, tmp_path, capsys):
    import vitkit

    out = tmp_path / "pre"
    assert main(["pretrain", "--method", method, "--epochs", "2", *TINY, "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.strip().splitlines()[-1].startswith("final: " + ("val_loss=" if method == "mae"
                                                                 else "val_colour_top1="))
    for name in ("best", "last"):
        assert {p.name for p in (out / name).iterdir()} >= {"model.safetensors", "config.json", "ssl.safetensors",
                                                            "ssl.json"}
    assert json.loads((out / "best" / "ssl.json").read_text())["method"] == method
    enc = vitkit.load(str(out / "best"))
    assert isinstance(enc, VisionTransformer) and enc.config.num_classes == 0
    assert vitkit.from_pretrained(out / "best").config.depth == 1
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" in rows[-1] and ("val_top1" in rows[-1]) == (method == "mpp")
    assert main(["train", "--init", str(out / "best"), "--epochs", "1", "--output", str(tmp_path / "ft")]) == 0
    assert "final: val_top1=" in capsys.readouterr().out


def test_pretraining_resumes_exactly_and_continues_with_its_decoder(tmp_path):
    from vitkit.training.config import TrainConfig
    from vitkit.training.trainer import Trainer

    cfg = dict(objective="mae", epochs=2, batch_size=64, model_args={"img_size": 8, "patch_size": 2, "embed_dim": 32,
                                                                       "depth": 1, "num_heads": 2},
               precision="fp32", compile=False, attention="sdpa", channels_last=False, tiers=None, threads=1)
    whole = Trainer(TrainConfig.from_dict({**cfg, "output": str(tmp_path / "a")}), log=lambda s: None, progress=False)
    whole.fit()
    t = Trainer(TrainConfig.from_dict({**cfg, "output": str(tmp_path / "b")}), log=lambda s: None, progress=False)
    step = t._optimizer_step

    def stop_at_7():
        step()
        if t.step == 7:
            t.request_stop()
    t._optimizer_step = stop_at_7
    t.fit()
    r = Trainer(TrainConfig.from_dict({**cfg, "output": str(tmp_path / "b"), "resume": str(tmp_path / "b")}),
                log=lambda s: None, progress=False)
    r.fit()
    for k, v in whole.module.state_dict().items():
        assert torch.equal(v, r.module.state_dict()[k]), k  # the decoder and the encoder, bit for bit


def test_a_flat_folder_of_images_pretrains(tmp_path, capsys):
    """The common case here: images, no train/ or class folders (any depth); every 20th held out."""
    root = write_digits_folder(tmp_path / "d", per_class=6, size=16)
    flat = tmp_path / "flat"
    (flat / "deeper").mkdir(parents=True)
    for i, p in enumerate(sorted(root.rglob("*.png"))):
        p.rename(flat / ("deeper" if i % 3 else ".") / f"{i}.png")
    assert main(["pretrain", "--method", "mpp", "--dataset", "folder", "--data-dir", str(flat), "--epochs", "1",
                 *TINY, "--output", str(tmp_path / "p"), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "114 train / 6 val images, 16x16x1, one class" in out
    assert "every 20th image set aside to validate (--holdout SHARE: a share of your choosing)" in out
    assert "mpp on one channel: 8 gray levels" in out  # MPP's colour target in one channel, said
    assert main(["pretrain", "--method", "mpp", "--dataset", "folder", "--data-dir", str(flat), "--epochs", "1",
                 "--holdout", "0.1", *TINY, "--output", str(tmp_path / "q"), "--cache-dir", str(tmp_path / "c")]) == 0
    assert "103 train / 11 val images" in capsys.readouterr().out


def test_bad_input_for_pretraining_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images")
    cases = [(["--dataset", "folder", "--data-dir", str(tmp_path / "empty")], "no image files"),
             (["--mask-ratio", "1.5"], "mask_ratio must be > 0 and < 1"),
             (["--img-size", "8", "--patch-size", "16"], "patch_size must be >= 1 and <= 8, got 16")]
    for i, (flags, said) in enumerate(cases):
        assert main(["pretrain", "--method", "mae", "--epochs", "1", *TINY, *flags,
                     "--output", str(tmp_path / f"r{i}")]) == 2, flags
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and said in err[0], (flags, err)
    assert main(["pretrain", "--method", "mae", "--epochs", "1", *TINY, "--output", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    assert main(["train", "--init", str(tmp_path / "ok" / "best" / "ssl.safetensors"), "--epochs", "1",
                 "--output", str(tmp_path / "ft")]) == 2
    err = capsys.readouterr().err
    assert "the objective's parts" in err and "--init the folder" in err and "Traceback" not in err
