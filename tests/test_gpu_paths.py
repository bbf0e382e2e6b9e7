"""What only a GPU runs, run on the CPU (issue 65): the trainer's data, checkpoint, resume and evaluation paths, the
pre-training objectives, inspection, serving and the probe, with their tensors on a played GPU (tests/device_shim.py:
``.numpy()`` on a device tensor and CPU/device mixing fail as on CUDA; host-device copies and waits counted).

The first GPU run crashed at its first checkpoint (``labels.numpy()`` on labels the trainer had moved to the GPU):
``test_a_run_on_a_gpu_saves_resumes_and_evaluates`` failed the same way on the CPU before the fix."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from device_shim import played_gpu
from vitkit import create_model
from vitkit.training.config import TrainConfig
from vitkit.training.trainer import READ_LOSS_EVERY, Trainer

QUIET = dict(log=lambda s: None, progress=False)


@pytest.fixture(params=["played", pytest.param("cuda", marks=pytest.mark.cuda)])
def gpu(request):
    """The test on a played GPU (every machine: its copies and waits counted), and on a real one (marked cuda: run by
    benchmarks/gpu_targets.sh's tests part on a GPU machine, skipped elsewhere)."""
    if request.param == "played":
        with played_gpu() as shim:
            yield shim
    else:
        yield None


def gpu_config(tmp_path, **kw) -> TrainConfig:
    """Every "auto" decided, as a plan would leave them (the planner's GPU timings are replayed in
    test_gpu_replay.py): the run's own paths are what is tested here."""
    base = dict(dataset="digits", epochs=1, device="cuda", precision="fp32", compile=False, batch_size=64,
                attention="sdpa", channels_last=False, workers=0, output=str(tmp_path / "run"), threads=1,
                gpu_batch=False)  # (the batch search on a played GPU would time the CPU)
    return TrainConfig(**{**base, **kw})


def test_the_played_gpu_refuses_what_cuda_refuses():
    with played_gpu(gpus=1) as gpu:
        x = torch.arange(6.0).to("cuda")
        assert x.device.type == "cuda" and x[1:].device.type == "cuda"  # views are where their storage is
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(6)
        assert (x + torch.tensor(1.0)).device.type == "cuda"  # a 0-dim CPU tensor is accepted, as on CUDA
        assert x[torch.tensor([0, 2])].tolist() == [0.0, 2.0]  # CPU indices into a GPU tensor: accepted too
        with pytest.raises(RuntimeError, match="same device"):
            torch.arange(6.0)[x > 2]  # a GPU mask into a CPU tensor: not
        assert x.cpu().numpy().tolist() == [0, 1, 2, 3, 4, 5]
        assert gpu.counts["host_to_device"] == 1 and gpu.counts["device_to_host"] == 1
        with pytest.raises(IndexError):
            torch.cuda.set_rng_state_all([torch.cuda.get_rng_state()] * 4)  # states of 4 GPUs, 1 visible
        g = torch.Generator(device="cuda")  # a GPU's generator draws GPU tensors only (issue 80, T4)
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
            torch.rand(3, generator=g)
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
            torch.ones(3).bernoulli_(0.5, generator=g)
        assert torch.rand(3, generator=g, device="cuda").device.type == "cuda"
        assert x.bernoulli(0.5, generator=g).device.type == "cuda"


def test_a_run_on_a_gpu_saves_resumes_and_evaluates(tmp_path, gpu):
    """Resident data (moved to the GPU), a checkpoint each epoch, a resume, an evaluation: every path the first GPU
    run took, and its resume."""
    t = Trainer(gpu_config(tmp_path), **QUIET)
    assert t.data.train.labels.device.type == "cuda"  # resident, as on a GPU
    first = t.fit()
    assert (tmp_path / "run" / "last" / "train_state.pt").is_file()
    state = torch.load(tmp_path / "run" / "last" / "train_state.pt", weights_only=True)
    assert len(state["rng_ranks"]) == 1 and "cuda" in state["rng"]
    r = Trainer(gpu_config(tmp_path, epochs=2, resume=str(tmp_path / "run")), **QUIET).fit()
    assert first.epochs == 1 and r.epochs == 2 and r.steps == 2 * first.steps and 0 <= r.val_top1 <= 100
    cpu = Trainer(gpu_config(tmp_path, device="cpu", output=None), **QUIET).data.train.identity()
    # (the digest the resume compares is the CPU's own)
    assert state["train_images"] == cpu


# the recipes' conv-stem hybrids pre-train through their own masked paths (model/masked_stem.py): MAE's stem on each
# visible cell alone, MPP's stem masked after every layer; a small one of the same shape (conv-BN-ReLU, max-pooling)
HYBRID = {"hybrid": "conv:8,8,M", "patch_size": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}


@pytest.mark.parametrize("objective", ["classify", "mae", "mpp", "mae-hybrid", "mpp-hybrid", "classify-joint"])
def test_a_training_step_waits_for_the_device_once_a_read_not_once_a_step(tmp_path, objective, gpu):
    """No host-device copy in the step (crops, flips and masks drawn on the device; mean and std kept there), and
    the loss read every READ_LOSS_EVERY batches: a GPU's queue is not drained at every step. (On a real GPU: the
    supervised, MAE and MPP steps run, of the plain ViT and of a conv-stem hybrid, and --semi joint's, whose
    unlabelled images are drawn where they live.)"""
    method, _, kind = objective.partition("-")
    extra = {} if method == "classify" else {"objective": method,
                                             "model_args": HYBRID if kind == "hybrid" else {"hybrid": "none"}}
    if kind == "joint":
        extra = {"semi": "joint", "model_args": {"hybrid": "none"}}
    t = Trainer(gpu_config(tmp_path, batch_size=32, crop_padding=1, hflip=True, output=None, **extra), **QUIET)
    if gpu is not None:
        gpu.reset()
    loss, _ = t.train_epoch()
    steps = t.step
    assert steps == 44 and math.isfinite(loss)
    if gpu is not None:
        assert gpu.syncs() <= math.ceil(steps / READ_LOSS_EVERY) + 1, dict(gpu.counts)
        assert gpu.counts["host_to_device"] <= 1, dict(gpu.counts)  # the epoch's order, once


def test_an_evaluation_waits_for_the_device_a_few_times_not_once_a_batch(tmp_path, gpu):
    """Issue 80 P17: the confusion matrix was counted with torch.bincount, which on CUDA reads its input's min and max
    back to the host (two waits a batch); the metrics are read once, at the end, whatever the number of batches."""
    t = Trainer(gpu_config(tmp_path, eval_batch_size=8, output=None), **QUIET)
    batches = math.ceil(len(t.data.val) / 8)
    if gpu is not None:
        gpu.reset()
    m = t.evaluate()
    assert batches >= 40 and m["n"] == len(t.data.val) and sum(map(sum, m["confusion"])) == m["n"]
    if gpu is not None:
        assert gpu.syncs() <= 8, dict(gpu.counts)
    logits = t.model.eval()(t.augment(t.data.val.images.float(), t.data.val.labels, train=False)[0])
    assert m["top1"] == pytest.approx(100 * (logits.argmax(1) == t.data.val.labels).float().mean().item())


def test_the_budgets_clock_is_read_after_the_device_has_run_the_steps(tmp_path, gpu, monkeypatch):
    """Issue 80 N8: a GPU's steps are queued; the host's clock at a step's end is when it was queued. The budget's
    pace is read at its mark and re-plans only, each after the device's queue is drained (a wait every few seconds,
    not every step)."""
    from vitkit.training.budget import TimeBudget

    t = Trainer(gpu_config(tmp_path, time_limit=5.0, output=None), **QUIET)
    synced, read = [], []
    real_after = TimeBudget.after_step
    t.first_step = t.step  # (as fit() sets it)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(t.step))
    monkeypatch.setattr(TimeBudget, "after_step", lambda self, step, elapsed, first=0: (
        read.append(step) if self.measures_at(step, first) else None, real_after(self, step, elapsed, first))[1])
    t.train_epoch()
    assert t.step == t.steps_per_epoch and len(read) >= 2 and t.budget.sec_per_step is not None
    if gpu is not None:
        assert set(read) <= set(synced) and len(synced) <= len(read) + t.step // 8, (read, synced)


def test_a_checkpoint_from_four_gpus_resumes_on_fewer(tmp_path):
    """A state whose CUDA RNG holds every visible GPU's (as vitkit wrote before, from a 4-GPU machine) resumes on a
    machine that sees one: this rank's own state is taken, not set_rng_state_all's IndexError."""
    with played_gpu(gpus=4):
        Trainer(gpu_config(tmp_path), **QUIET).fit()
    path = tmp_path / "run" / "last" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    four = [state["rng"]["cuda"]] * 4
    old = {**state, "rng": {**state["rng"], "cuda": four}}
    del old["rng_ranks"]
    torch.save(old, path)
    with played_gpu(gpus=1):
        r = Trainer(gpu_config(tmp_path, epochs=2, resume=str(tmp_path / "run")), **QUIET).fit()
    assert r.epochs == 2


def test_each_rank_resumes_its_own_random_state_and_another_world_draws_anew(tmp_path):
    """A fake world of 2 ranks: rank 1 takes rank 1's saved state (not rank 0's); resumed with another number of
    processes, the ranks draw from seeds of their own (two ranks never draw the same crops)."""
    t = Trainer(gpu_config(tmp_path, device="cpu", output=None), **QUIET)
    states = []
    for seed in (10, 11):
        g = torch.Generator().manual_seed(seed)
        states.append({"torch": torch.manual_seed(seed).get_state(), "gen": g.get_state()})
    saved = {"rng": states[0], "rng_ranks": states}
    t.rank, t.world = 1, 2
    t._set_rng_state(saved)
    assert torch.equal(t.gen.get_state(), states[1]["gen"])
    draws = []
    for rank in (0, 1):  # three ranks saved, two resume
        t.rank, t.world, t.step = rank, 2, 7
        t._set_rng_state({"rng": states[0], "rng_ranks": states + [states[0]]})
        draws.append(torch.rand(4, generator=t.gen))
    assert not torch.equal(draws[0], draws[1])


def test_an_fp16_resume_of_a_run_saved_without_a_loss_scale_starts_one(tmp_path):
    said = []
    Trainer(gpu_config(tmp_path, device="cpu"), **QUIET).fit()
    t = Trainer(gpu_config(tmp_path, device="cpu", precision="fp16", epochs=2, resume=str(tmp_path / "run")),
                log=said.append, progress=False)
    assert t.scaler.is_enabled() and any("loss scale" in s for s in said)


def test_a_train_fraction_of_data_on_the_gpu(tmp_path):
    with played_gpu():
        t = Trainer(gpu_config(tmp_path, output=None), **QUIET)
        part = t.data.with_train_fraction(0.1)
        assert len(part.train) == pytest.approx(0.1 * len(t.data.train), abs=10)
        assert part.train.identity()


@pytest.mark.parametrize("settings", [{"method": "mae", "mask_ratio": 0.75, "norm_pix_loss": True, "decoder_width": 32,
                                       "decoder_depth": 1, "decoder_heads": 2},
                                      {"method": "mpp", "target": "mean", "mask_ratio": 0.5},
                                      {"method": "mpp", "target": "l2", "mask_ratio": 0.5}],
                         ids=["mae", "mpp-mean", "mpp-l2"])
def test_a_pretraining_objective_compiles_into_one_graph(settings):
    """Its masks are drawn outside the module (a generator cannot be traced) and its loss is weighted by the mask,
    not cut out by it (a boolean index's size is data-dependent): torch.compile sees one graph, no break."""
    import torch._dynamo

    from vitkit.model.ssl import build_ssl, draw_noise

    m = build_ssl(create_model("vit_nano_patch2_8", num_classes=0, img_size=8, in_chans=1), settings)
    x = torch.randn(4, 1, 8, 8)
    noise = draw_noise(m, x, torch.Generator().manual_seed(0))

    def loss(x, noise):
        return (m(x, x.clamp(0, 1), noise=noise) if settings["method"] == "mpp" else m(x, noise=noise)).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(x, noise)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert torch.allclose(torch.compile(loss, backend="eager")(x, noise), loss(x, noise))


def test_the_mpp_loss_weighted_by_the_mask_is_the_mean_over_the_corrupted_patches():
    """Against the cut-out mean written by hand (the paper's loss over the corrupted patches)."""
    import torch.nn.functional as F

    from vitkit.model.ssl import MaskedPatchPrediction, colour_classes, mpp_targets

    for target in ("mean", "l2"):
        m = MaskedPatchPrediction(create_model("vit_nano_patch2_8", num_classes=0, img_size=8, in_chans=3),
                                  target=target)
        x = torch.rand(3, 3, 8, 8)
        out = m(x, x, generator=torch.Generator().manual_seed(1))
        t = mpp_targets(x, 2, target)
        if target == "l2":
            want = (out.pred - t).pow(2).mean(-1)[out.mask].mean()
        else:
            logits = out.pred.reshape(3, 16, -1, colour_classes(3))[out.mask]
            want = F.cross_entropy(logits.flatten(0, 1), t.reshape(3, 16, -1)[out.mask].flatten())
            hits = (logits.argmax(-1) == t.reshape(3, 16, -1)[out.mask])
            assert int(out.correct) == int(hits.sum()) and int(out.count) == hits.numel()
        assert torch.allclose(out.loss, want, atol=1e-6)


def test_inspection_serving_and_the_probe_take_a_model_on_the_gpu(tmp_path, gpu):
    """The analyses return arrays of device tensors; a Predictor gives a GPU model its batches there; faithfulness
    masks images that live on the GPU; the probe and k-NN run on the device they are given."""
    from vitkit.inspect import analysis
    from vitkit.inspect.explanations import faithfulness
    from vitkit.serving.predictor import Predictor
    from vitkit.training.features import knn, linear_probe

    model = create_model("vit_nano_patch2_8", num_classes=3, img_size=8, in_chans=3)
    pre = {"mean": [0.5] * 3, "std": [0.25] * 3, "class_names": ["a", "b", "c"]}
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    model = model.to("cuda")
    images = torch.rand(2, 3, 8, 8).to("cuda")
    assert analysis.pos_embed_similarity(model).shape == (4, 4, 4, 4)
    assert analysis.patch_embed_filters(model, 4)[0].shape == (4, 3, 2, 2)
    assert analysis.feature_pca(model, images)[0].shape == (2, 4, 4, 3)
    assert analysis.mean_attention_distance(model, images).shape == (model.config.depth, model.config.num_heads)
    assert analysis.attention_rollout(model, images).shape == (2, 4, 4)
    assert faithfulness(model, images, "rollout", steps=2, random_orders=1).deletion.shape == (2, 3)
    answer = Predictor(model, pre, threads=1)(buf.getvalue(), topk=2)
    assert len(answer["top"]) == 2
    feats = (torch.randn(40, 8), torch.arange(40) % 2)
    assert 0 <= linear_probe(feats, feats, 2, epochs=2, device="cuda").top1 <= 100
    assert 0 <= knn(feats, feats, 2, k=5, device="cuda").top1 <= 100


def test_torchrun_ranks_each_take_their_own_gpu(monkeypatch):
    from vitkit.runtime.distributed import distributed_device

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with played_gpu(gpus=2):
        assert distributed_device("cuda") == torch.device("cuda", 1)
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
            distributed_device("cuda:1")


def test_a_gpu_without_native_bf16_times_fp16_not_an_emulated_bf16():
    from unittest import mock

    from vitkit.training.probe import step_candidates

    cfg = TrainConfig(precision="auto", attention="sdpa", channels_last=False)
    with played_gpu(), mock.patch.object(torch.cuda, "is_bf16_supported",
                                         lambda including_emulation=True: including_emulation), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (7, 0)):
        assert [c["precision"] for c in step_candidates(cfg, torch.device("cuda"))] == ["fp16", "fp32"]


def test_a_streamed_run_on_a_gpu_keeps_its_workers_from_epoch_to_epoch(tmp_path, monkeypatch, gpu):
    """Images read from their files by DataLoader workers, trained on the played GPU for two epochs with a
    checkpoint and an evaluation each: one pool of training workers for the run (persistent), not one an epoch."""
    from helpers import write_digits_folder
    import vitkit.data.stream as stream

    made = []
    real = stream.StreamedImages.loader

    def loader(self, chunks, device, workers=None):
        out = real(self, chunks, device, workers)
        made.append(id(out))
        return out

    monkeypatch.setattr(stream.StreamedImages, "loader", loader)
    root = write_digits_folder(tmp_path / "d", per_class=12, size=16)
    cfg = gpu_config(tmp_path, dataset="folder", data_dir=str(root), data_mode="stream", workers=1, epochs=2,
                     batch_size=16, cache_dir=str(tmp_path / "c"))
    t = Trainer(cfg, **QUIET)
    made.clear()
    r = t.fit()
    assert r.epochs == 2 and t.data.train.keep_workers
    train_loaders = {i for i in made if i == id(t.data.train._kept[1])}
    assert len(train_loaders) == 1 and made.count(next(iter(train_loaders))) == 2  # the same loader, both epochs


def test_a_naflex_budget_on_a_gpu_is_judged_against_the_gpus_free_memory():
    from vitkit.model.config import ViTConfig
    from vitkit.training.build import check_naflex_budget

    c = ViTConfig(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4, num_classes=2)
    with played_gpu(free_gib=1.0):  # 12,000 tokens: 6.4 GiB of attention an image, more than 1 GiB free
        with pytest.raises(ValueError, match="GiB free of 80.0 GiB on cuda"):
            check_naflex_budget(12_000, 64, c, None, torch.device("cuda", 0))
    with played_gpu(free_gib=70.0):
        check_naflex_budget(12_000, 64, c, None, torch.device("cuda", 0))


@pytest.mark.cuda
def test_a_compiled_step_trains_on_a_real_gpu(tmp_path):
    """torch.compile's CUDA backend (Inductor's Triton kernels): what a played GPU cannot run."""
    r = Trainer(gpu_config(tmp_path, compile=True, precision="bf16", epochs=2), **QUIET).fit()
    assert r.epochs == 2 and r.val_top1 > 20


def test_a_run_saved_on_the_cpu_resumes_on_a_gpu_and_back(tmp_path):
    """The augmentation's generator is the device's (a CPU's state is not a GPU's): the other kind of state is not
    forced into it; the resumed run draws from a new seed, and says so."""
    Trainer(gpu_config(tmp_path, device="cpu"), **QUIET).fit()
    said = []
    with played_gpu():
        t = Trainer(gpu_config(tmp_path, epochs=2, resume=str(tmp_path / "run")), log=said.append, progress=False)
        t.gen.get_state()
    assert t.gen.device.type == "cuda" and any("another kind of device" in s for s in said)


def test_a_run_that_decides_its_settings_on_its_first_steps_does_so_on_a_gpu(tmp_path, gpu):
    """Decided while training (training/tune.py) on a GPU: the candidates' steps train on the device, each timed
    after the device's queue is drained (one wait a tuning step, none after); the thread count is not a GPU's to time."""
    from vitkit.training.plan import make_plan

    cfg = gpu_config(tmp_path, precision="auto", attention="auto", threads=None, compile=False, epochs=2)
    cfg, p = make_plan(cfg, log=lambda s: None, in_run=True)
    assert p.tuning is not None and p.tuning["threads"] is None and "precision" in p.tuning["options"]
    t = Trainer(cfg, plan_=p, **QUIET)
    r = t.fit()
    assert t.tuner is None and p.tuned["steps"] >= 4 and r.steps == 2 * t.steps_per_epoch
    assert {k: getattr(t.cfg, k) for k in ("precision", "attention")} == {
        k: p.chosen[k] for k in ("precision", "attention")}


@pytest.mark.parametrize("step", ["imagenet-augmentation", "fp16", "ema-clip", "muon-fp16", "fixmatch"])
def test_the_recipes_gpu_steps_run_played_with_their_waits_counted(tmp_path, step, gpu):
    """Issue 80: the played GPU could not run what a GPU runs: torchvision's MixUp/CutMix (F.one_hot's scratch
    tensor was the CPU's: "same device" at scatter_), fp16's GradScaler (``copy=`` refused), and it counted copies
    to the host a GPU does not make (torch's foreach grouping: 44 in 44 steps of clip_grad_norm_, 352 of fp16's
    Adam). Now each runs, on the played GPU and a real one, and waits for the device only where the loss is read;
    RandAugment's autocontrast (torchvision) assigns through a boolean mask, a read of the mask's size on a GPU
    each time it is drawn: counted apart, not vitkit's to change."""
    extra = {"imagenet-augmentation": dict(aa="rand", mixup=0.8, cutmix=1.0, smoothing=0.1),
             "fp16": dict(precision="fp16"),
             "ema-clip": dict(model_ema=True, clip_grad=1.0),
             "muon-fp16": dict(opt="muon", precision="fp16"),
             "fixmatch": dict(semi="fixmatch", train_fraction=0.5)}[step]
    t = Trainer(gpu_config(tmp_path, batch_size=32, output=None, **extra), **QUIET)
    if gpu is not None:
        gpu.reset()
    loss, _ = t.train_epoch()
    assert t.step == (22 if step == "fixmatch" else 44) and math.isfinite(loss)  # (fixmatch: half the labels)
    if gpu is not None:
        assert gpu.counts["host_to_device"] <= 1 and gpu.counts["device_to_host"] == 0, dict(gpu.counts)
        reads = gpu.counts["device_reads"]
        if step == "imagenet-augmentation":  # (autocontrast, at most twice a step: RandAugment's two ops)
            assert reads <= math.ceil(t.step / READ_LOSS_EVERY) + 1 + 2 * t.step, dict(gpu.counts)
        elif step == "fixmatch":  # the strong views' RandAugment: two ops for each group of 8 unlabelled images
            groups = math.ceil(32 / t.augment.aa_group)
            assert reads <= math.ceil(t.step / READ_LOSS_EVERY) + 1 + 2 * groups * t.step, dict(gpu.counts)
            assert t.objective.confident_share() is not None  # kept on the device, read at the epoch's end
        else:
            assert reads <= math.ceil(t.step / READ_LOSS_EVERY) + 1, dict(gpu.counts)
