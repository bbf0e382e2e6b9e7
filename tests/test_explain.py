"""Class-specific explanations against independent references: the grad-cam package called directly on timm's ViT,
Chefer et al.'s (2021b) equations written out here on timm's ViT, and a hand-computed occlusion ranking."""
import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit.cli.main import main
from vitkit.inspect.explanations import METHODS, explain, faithfulness
from vitkit.serving.predictor import available_methods

from conftest import tiny_config


def _timm_and_vitkit(**kw):
    timm = pytest.importorskip("timm")
    from vitkit.interop import from_timm

    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=6,
                           depth=3, **kw).eval()
    with torch.no_grad():
        tm.head.weight.normal_(0, 0.5)  # timm zero-initialises the head: every class would tie
    return tm, from_timm(tm).eval()


def _to_image_scaled(grid_maps: torch.Tensor, hw) -> np.ndarray:
    up = F.interpolate(grid_maps.float()[:, None], size=hw, mode="bilinear", align_corners=False)[:, 0]
    lo, hi = up.amin(dim=(1, 2), keepdim=True), up.amax(dim=(1, 2), keepdim=True)
    return ((up - lo) / (hi - lo)).numpy()


def test_gradcam_is_the_grad_cam_package_called_directly_on_timms_vit():
    pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    tm, model = _timm_and_vitkit()
    x = torch.randn(4, 3, 32, 32)
    targets = [0, 3, 5, 1]

    def reshape_transform(t, h=4, w=4):  # the package's ViT tutorial
        return t[:, 1:, :].reshape(t.size(0), h, w, t.size(2)).transpose(2, 3).transpose(1, 2)

    with GradCAM(model=tm, target_layers=[tm.blocks[-1].norm1], reshape_transform=reshape_transform) as cam:
        want = cam(input_tensor=x, targets=[ClassifierOutputTarget(t) for t in targets])
    got = explain(model, x, targets, "gradcam")
    assert got.maps.shape == want.shape == (4, 32, 32)
    for g, w in zip(got.maps, want):
        assert np.corrcoef(g.ravel(), w.ravel())[0, 1] > 0.99
    assert got.target.tolist() == targets


def test_grad_rollout_equals_chefers_equations_on_timms_vit():
    """Chefer, Gur & Wolf (ICCV 2021), Eq. 5-6, written out on timm's attention (its non-fused path):
    Ā = E_h[(∇A ⊙ A)^+] with ∇A = ∂y_t/∂A; R = I; R <- R + Ā R; the class token's row over the patches."""
    tm, model = _timm_and_vitkit()
    attns = []
    for b in tm.blocks:
        b.attn.fused_attn = False
        b.attn.attn_drop.register_forward_hook(lambda _m, _i, out: attns.append(out))
    x = torch.randn(3, 3, 32, 32)
    logits = tm(x)
    t = logits.argmax(-1)
    grads = torch.autograd.grad(logits[torch.arange(3), t].sum(), attns)
    T = attns[0].shape[-1]
    R = torch.eye(T, dtype=torch.float64).repeat(3, 1, 1)
    for a, g in zip(attns, grads):
        heads = [(g[:, h].double() * a[:, h].detach().double()).clamp(min=0) for h in range(a.shape[1])]
        R = R + torch.bmm(sum(heads) / len(heads), R)
    want = _to_image_scaled(R[:, 0, 1:].reshape(3, 4, 4), (32, 32))
    got = explain(model, x, None, "grad-rollout")
    assert got.target.tolist() == t.tolist()
    np.testing.assert_allclose(got.maps, want, atol=1e-5)


def test_maps_depend_on_the_class_for_gradient_methods_only():
    _, model = _timm_and_vitkit()
    x = torch.randn(3, 3, 32, 32)
    for method in METHODS:
        a, b = explain(model, x, 1, method), explain(model, x, 4, method)
        assert (a.target == 1).all() and (b.target == 4).all() and not np.allclose(a.prob, b.prob)
        diff = np.abs(a.maps - b.maps).max()
        if method in ("grad-rollout", "gradcam"):
            assert diff > 0.05, method
        else:
            assert diff == 0.0, method


@pytest.mark.parametrize("pool", ["cls", "gap", "map"])
@pytest.mark.parametrize("patch,hw", [(4, (16, 24)), (8, (24, 40)), (16, (32, 48))])
def test_every_method_gives_maps_at_the_images_size_for_any_patch_pool_and_shape(pool, patch, hw):
    model = vitkit.VisionTransformer(tiny_config(img_size=hw, patch_size=patch, pool=pool, num_classes=4))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    x = torch.randn(3, 3, *hw)
    for method in METHODS:
        e = explain(model, x, None, method, batch_size=2)  # batches of 2 and 1
        assert e.maps.shape == (3, *hw) and e.maps.dtype == np.float32
        assert np.isfinite(e.maps).all() and e.maps.min() >= 0 and e.maps.max() <= 1
        assert np.allclose(e.prob.sum() > 0, True) and e.target.shape == (3,)


def test_hybrid_and_bfloat16_models_are_explained_and_left_as_they_were():
    model = vitkit.VisionTransformer(tiny_config(img_size=(16, 12), hybrid="conv:8,8"))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    model.train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x = torch.randn(2, 3, 16, 12)
    for method in METHODS:
        assert explain(model, x, 2, method).maps.shape == (2, 16, 12)
    assert model.training and all((p.grad == 1).all() for p in model.parameters())
    half = vitkit.VisionTransformer(tiny_config(img_size=16)).to(torch.bfloat16)
    torch.nn.init.normal_(half.head.weight, std=0.5)
    for method in METHODS:
        e = explain(half, torch.randn(2, 3, 16, 16), None, method)
        assert e.maps.shape == (2, 16, 16) and np.isfinite(e.maps).all()


def test_bad_targets_methods_and_images_are_refused_in_one_line():
    model = vitkit.VisionTransformer(tiny_config(num_classes=3))
    model.preprocessing = {"class_names": ["ant", "bee", "wasp"]}
    x = torch.randn(2, 3, 16, 16)
    assert (explain(model, x, "bee", "rollout").target == 1).all()
    cases = [(dict(target="bees"), "unknown class 'bees'.*did you mean bee"),
             (dict(target=3), "class index 3 is out of range: the model has 3 classes"),
             (dict(target=[0, 1, 2]), "3 targets for 2 images"),
             (dict(method="gradcm"), "unknown explanation method 'gradcm'.*did you mean 'gradcam'")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            explain(model, x, **{"method": "rollout", **kw})
    with pytest.raises(ValueError, match="cannot take 18x16 images"):
        explain(model, torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match=r"expected normalised images of shape \(B, 3, H, W\)"):
        explain(model, torch.randn(1, 1, 16, 16))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small ViT trained on the real 8x8 digits (a few seconds)."""
    out = tmp_path_factory.mktemp("explain") / "run"
    assert main(["train", "--epochs", "4", "--depth", "2", "--output", str(out), "--precision", "fp32"]) == 0
    return out / "best"


def _digits_val(model, n):
    from vitkit.data.datasets import load_dataset
    from vitkit.data.preprocess import normalizer, preprocessing_of

    data = load_dataset("digits")
    return normalizer(preprocessing_of(model), model.config).normalize(data.val.images[:n])


def test_the_true_occlusion_ranking_beats_random_orders_on_a_trained_model(trained):
    model = vitkit.load(trained).eval()
    x = _digits_val(model, 24)
    gh, gw = model.patch_embed.grid_for(tuple(x.shape[-2:]))
    ph, pw = x.shape[-2] // gh, x.shape[-1] // gw
    with torch.no_grad():
        t = model(x).argmax(-1)
        p0 = torch.softmax(model(x), -1)[torch.arange(len(x)), t]
        effect = torch.zeros(len(x), gh, gw)
        for r in range(gh):
            for c in range(gw):
                occluded = x.clone()
                occluded[..., r * ph:(r + 1) * ph, c * pw:(c + 1) * pw] = 0
                effect[:, r, c] = p0 - torch.softmax(model(occluded), -1)[torch.arange(len(x)), t]
    maps = effect.repeat_interleave(ph, 1).repeat_interleave(pw, 2).numpy()
    f = faithfulness(model, x, maps, steps=8, random_orders=3)
    assert f.deletion.shape == (24, 9) and np.allclose(f.fractions, np.linspace(0, 1, 9))
    np.testing.assert_allclose(f.deletion[:, 0], p0.numpy(), atol=1e-5)  # nothing removed: the model's own answer
    assert f.deletion_auc < f.random_deletion_auc - 0.02
    reversed_ = faithfulness(model, x, -maps, steps=8, random_orders=3)  # least important first: worse than random
    assert reversed_.deletion_auc > f.random_deletion_auc


def test_cli_writes_a_figure_per_image_and_the_faithfulness_table(trained, tmp_path, capsys):
    from PIL import Image

    from helpers import digits_arrays

    images, _ = digits_arrays()
    files = []
    for i in range(2):
        files.append(tmp_path / f"digit{i}.png")
        Image.fromarray(images[i]).save(files[-1])
    out = tmp_path / "why"
    assert main(["inspect", "explain", "--checkpoint", str(trained), *map(str, files), "--target", "3",
                 "--out", str(out), "--steps", "4", "--random-orders", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["digit0.png", "digit1.png", "faithfulness.csv",
                                                     "faithfulness.png"]
    rows = list(csv.DictReader(open(out / "faithfulness.csv")))
    assert [r["method"] for r in rows] == list(METHODS) and all(r["images"] == "2" for r in rows)
    assert main(["inspect", "explain", "--checkpoint", str(trained), "--num-images", "3", "--method",
                 "grad-rollout,rollout", "--no-faithfulness", "--out", str(tmp_path / "val")]) == 0
    assert len(list((tmp_path / "val").glob("val-*.png"))) == 3
    capsys.readouterr()
    (tmp_path / "notes.png").write_text("not an image")
    for argv, msg in [(["--target", "cat"], "unknown class 'cat'"), (["--method", "gradcm"], "did you mean 'gradcam'"),
                      ([str(tmp_path / "notes.png")], "notes.png")]:
        assert main(["inspect", "explain", "--checkpoint", str(trained), "--out", str(tmp_path / "x"),
                     *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.cuda
def test_explanations_on_cuda_match_the_cpu():
    model = vitkit.VisionTransformer(tiny_config())
    torch.nn.init.normal_(model.head.weight, std=0.5)
    x = torch.randn(2, 3, 16, 16)
    for method in available_methods():  # (gradcam where its optional package is installed)
        cpu = explain(model, x, 1, method).maps
        gpu = explain(model.cuda(), x, 1, method).maps
        model.cpu()
        np.testing.assert_allclose(gpu, cpu, atol=1e-3)


def test_gains_over_random_and_the_verdict_are_the_hand_computed_ones():
    from vitkit.inspect import Faithfulness

    fr = np.array([0.0, 0.5, 1.0])
    flat = np.full((3, 3), 0.5)
    dele = np.array([[0.5, 0.1, 0.5], [0.5, 0.2, 0.5], [0.5, 0.3, 0.5]])  # areas 0.3, 0.35, 0.4 (trapezoid)
    f = Faithfulness("m", fr, dele, flat, flat, flat)
    g, se = f.gain("deletion")
    assert g == pytest.approx(0.5 - 0.35) and se == pytest.approx(np.std([0.2, 0.15, 0.1], ddof=1) / np.sqrt(3))
    assert f.gain("insertion") == (0.0, 0.0) and not f.better_than_random  # no gain in insertion
    assert Faithfulness("m", fr, dele, 1 - dele, flat, flat).better_than_random
    assert f.row()["deletion_gain"] == 0.15
