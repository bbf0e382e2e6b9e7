"""--shard: FSDP2 under torchrun on CPU (gloo, loopback), 2 and 3 processes, against DDP's run of the same
settings; its checkpoints read on one process, at another world size, and from a DDP run's state."""
import copy
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from test_ddp import COMMON, FIXED, torchrun
from vitkit.model import VisionTransformer, ViTConfig
from vitkit.training.config import TrainConfig
from vitkit.training.evaluate import rank_batches
from vitkit.training.shard import (REPLICA_SHARE, decide_shard, load_shards, load_whole, replica_bytes,
                                   save_shards, shard_module, whole_copy)

TINY = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=3, num_heads=2)


# ------------------------------------------------------------------------------------------ one process
def test_every_rank_runs_as_many_evaluation_forwards_and_counts_each_image_once():
    """A sharded model's forward is a collective: a rank with a batch fewer than another would leave the others
    waiting in the all-gather. Each image is counted on one rank only."""
    from vitkit.data.datasets import ImageTensors

    for n, world, batch in [(361, 2, 180), (257, 2, 128), (10, 3, 4), (2, 3, 1), (1, 2, 8), (360, 3, 256)]:
        split = ImageTensors(torch.zeros(n, 1, 2, 2, dtype=torch.uint8), torch.arange(n) % 3)
        runs = [list(rank_batches(split, r, world, batch, torch.device("cpu"))) for r in range(world)]
        assert len({len(r) for r in runs}) == 1, (n, world, batch, [len(r) for r in runs])
        assert sum(len(y) for r in runs for _, y, counted in r if counted) == n


def test_rank_batches_pads_the_short_rank_with_an_uncounted_image():
    from vitkit.data.datasets import ImageTensors

    split = ImageTensors(torch.zeros(5, 1, 8, 8, dtype=torch.uint8), torch.arange(5))
    runs = [list(rank_batches(split, r, 2, 2, torch.device("cpu"))) for r in range(2)]
    assert [len(r) for r in runs] == [2, 2]  # rank 0: images 0,2 | 4; rank 1: images 1,3 | one uncounted
    assert [c for _, _, c in runs[0]] == [True, True] and [c for _, _, c in runs[1]] == [True, False]
    assert len(runs[1][1][1]) == 1


def test_shard_is_decided_from_the_replica_and_refused_with_what_cannot_shard(monkeypatch):
    cfg = TrainConfig(dataset="digits")
    cpu = torch.device("cpu")
    # one process: nothing to shard across (a sharded run resumed on one process trains whole)
    assert decide_shard(replace(cfg, shard=True), 10**6, cpu, 1)[0].shard is False
    params = 86_000_000  # ViT-B/16: 86M x 4 B x (weights, gradients, AdamW's 2 moments) = 1.28 GiB
    assert replica_bytes(params, cfg) == params * 16
    import vitkit.training.shard as shard_mod

    for room, want in ((10 * 2**30, False), (2 * 2**30, True)):  # a replica over half of what a process may use
        monkeypatch.setattr(shard_mod, "room_per_process", lambda d, r=room: (r, f"{r / 2**30:.0f} GiB"))
        out, note = decide_shard(cfg, params, cpu, 2)
        assert out.shard is want and (("shard: on" in note and "1.28 GiB" in note) if want else note == "")
        assert replica_bytes(params, cfg) > REPLICA_SHARE * room if want else True
    # what cannot shard: refused when asked, said when auto would have
    monkeypatch.setattr(shard_mod, "room_per_process", lambda d: (2**30, "1 GiB"))
    for change, words in (({"model_ema": True}, "--model-ema"), ({"opt": "muon"}, "Muon"),
                          ({"compile": True}, "compile"), ({"precision": "fp16"}, "fp16")):
        with pytest.raises(ValueError, match=words):
            decide_shard(replace(cfg, shard=True, **change), params, cpu, 2)
        out, note = decide_shard(replace(cfg, **change), params, cpu, 2)
        assert out.shard is False and "shard: off, though" in note and words in note
    # a compile the planner chose (asked auto) gives way to a shard asked for
    out, _ = decide_shard(replace(cfg, shard=True, compile=True), params, cpu, 2, compile_asked="auto")
    assert out.shard is True and out.compile is False
    with pytest.raises(ValueError, match="shard must be"):
        TrainConfig(dataset="digits", shard="sometimes")


def _train(model, opt, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_sharded_state_goes_to_a_whole_model_and_a_whole_state_into_a_sharded_one(tmp_path, one_process_group):
    """The round trips a resume makes, against a model trained whole alongside: the shards read by a model that is
    not sharded; a whole optimizer state (Optimizer.state_dict's numbering) read by a sharded one; both then take
    the same next steps as the model trained whole throughout."""
    torch.manual_seed(0)
    whole = VisionTransformer(TINY)
    sharded = VisionTransformer(TINY)
    sharded.load_state_dict(whole.state_dict())
    twin = shard_module(sharded, torch.device("cpu"))
    assert all(p.device.type == "meta" for p in twin.parameters())
    opt_w = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    _train(whole, opt_w)
    _train(sharded, opt_s)
    gathered = whole_copy(sharded, twin)  # the weights gathered whole, as last/model.safetensors holds them
    ref = copy.deepcopy(whole.state_dict())
    assert max(float((gathered.state_dict()[k] - ref[k]).abs().max()) for k in ref) < 1e-6
    save_shards(sharded, opt_s, tmp_path / "shards")
    # 1. the shards into a model and optimizer that are not sharded (a resume on one process)
    torch.manual_seed(5)
    fresh = VisionTransformer(TINY)
    opt_f = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_shards(fresh, opt_f, tmp_path / "shards")
    assert all(torch.allclose(fresh.state_dict()[k], ref[k], atol=1e-6) for k in ref)
    state_w, state_f = opt_w.state_dict()["state"], opt_f.state_dict()["state"]
    assert all(torch.allclose(state_f[i]["exp_avg_sq"], state_w[i]["exp_avg_sq"], atol=1e-9) for i in state_w)
    # 2. a whole state (a DDP run's train_state.pt) into a sharded model
    torch.manual_seed(7)
    other = VisionTransformer(TINY)
    shard_module(other, torch.device("cpu"))
    opt_o = torch.optim.AdamW(other.parameters(), lr=1e-2)
    # (copies, as torch.load gives them: the optimizer's state dict holds its own `step` tensors, which a load
    # that keeps them would then step twice)
    load_whole(other, opt_o, copy.deepcopy(whole.state_dict()), copy.deepcopy(opt_w.state_dict()))
    for m, o in ((whole, opt_w), (other, opt_o), (fresh, opt_f)):  # the next steps, from the loaded states
        _train(m, o, steps=2, seed=9)
    got = whole_copy(other, VisionTransformer(TINY).to("meta")).state_dict()
    after = whole.state_dict()
    assert max(float((got[k] - after[k]).abs().max()) for k in after) < 1e-5
    assert max(float((fresh.state_dict()[k] - after[k]).abs().max()) for k in after) < 1e-5
    # a truncated shard file (a full disk, a copy cut short): one line naming the folder and the whole weights
    shard = next((tmp_path / "shards").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"shards: could not read the sharded training state \(rank 0: EOFError"):
        load_shards(fresh, opt_f, tmp_path / "shards")
    # a state of another model is refused, naming the counts
    small = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="not the same model"):
        load_whole(other, opt_o, whole.state_dict(), small.state_dict())


# ------------------------------------------------------------------------------------------ torchrun
def _weights(run):
    return load_file(str(run / "last" / "model.safetensors"))


def _worst(a, b):
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """The same run (SGD, fixed settings) on 2 processes with DDP and sharded."""
    base = tmp_path_factory.mktemp("shard-ref")
    runs = {}
    for name, flag in (("ddp", "--no-shard"), ("sharded", "--shard")):
        r = torchrun(["--dump", str(base), "--", "train", *COMMON, *FIXED, flag, "--output", str(base / name)])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[name] = (base / name, r)
    return runs


@pytest.mark.long
def test_a_sharded_run_takes_ddps_steps_and_one_process_reads_its_checkpoint(reference_runs, capsys):
    (ddp, _), (sharded, r) = reference_runs["ddp"], reference_runs["sharded"]
    assert "UserWarning" not in r.stderr, r.stderr[-3000:]
    assert (sharded / "last" / "shards").is_dir() and not (ddp / "last" / "shards").exists()
    assert '"shard: on' in (sharded / "plan.json").read_text()
    assert _worst(_weights(sharded), _weights(ddp)) < 1e-4  # the same steps, to float summation order
    final = [x for x in r.stdout.splitlines() if x.startswith("final:")]
    assert len(final) == 1
    # `vitkit eval` on one process reads the whole weights and gets the run's own score
    from vitkit.cli.main import main

    # (in the run's precision, FIXED's fp32: eval's auto picks by timing, and its bf16 read 63.89% for the run's 63.61)
    assert main(["eval", "--checkpoint", str(sharded / "best"), "--dataset", "digits", "--precision", "fp32"]) == 0
    top1 = float(final[0].split("val_top1=")[1].split()[0])
    assert f"{top1:.2f}" in capsys.readouterr().out


@pytest.mark.long
def test_a_killed_sharded_rank_restarts_and_ends_as_the_uninterrupted_run(reference_runs, tmp_path):
    r = torchrun(["--die-at", "30:1", "--", "train", *COMMON, *FIXED, "--shard", "--output", str(tmp_path / "run")],
                 max_restarts=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert _worst(_weights(tmp_path / "run"), _weights(reference_runs["sharded"][0])) < 1e-5


@pytest.mark.long
def test_a_ddp_run_resumed_sharded_keeps_its_optimizer_state(reference_runs, tmp_path):
    """DDP's train_state.pt (SGD's momentum numbered by Optimizer.state_dict) into a sharded run: it ends where the
    uninterrupted DDP run ends; a lost momentum would not."""
    run = tmp_path / "run"
    r = torchrun(["--die-at", "30:1", "--", "train", *COMMON, *FIXED, "--no-shard", "--output", str(run)])
    assert r.returncode != 0 and (run / "last" / "train_state.pt").is_file()
    r = torchrun(["--dump", str(tmp_path), "--", "train", *COMMON, *FIXED, "--shard", "--resume", str(run)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and (run / "last" / "shards").is_dir()  # (saved sharded from there on)
    assert _worst(_weights(run), _weights(reference_runs["ddp"][0])) < 1e-4


@pytest.mark.long
def test_three_sharded_processes_are_read_on_one_and_resumed_on_two(tmp_path):
    import vitkit

    run = tmp_path / "run"
    r = torchrun(["--die-at", "30:1", "--", "train", *COMMON, *FIXED, "--shard", "--output", str(run)], nproc=3)
    assert r.returncode != 0
    assert sorted(p.name for p in (run / "last" / "shards").iterdir()) == [".metadata", "__0_0.distcp",
                                                                         "__1_0.distcp", "__2_0.distcp"]
    # the shards of 3 processes read whole on this one (no process group): the weights last/ holds whole
    whole = _weights(run)
    model = vitkit.from_pretrained(run / "last")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    load_shards(model, opt, run / "last" / "shards")
    assert all(torch.equal(model.state_dict()[k], whole[k]) for k in whole)
    assert all("momentum_buffer" in s for s in opt.state_dict()["state"].values())
    # resumed by torchrun on 2 processes, sharded: each draws from a new seed, and the run ends
    r = torchrun(["--dump", str(tmp_path), "--", "train", *COMMON, *FIXED, "--shard", "--resume", str(run)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "3 saved their random states" in r.stdout
    final = r.stdout.strip().splitlines()[-1]
    # its 28 steps of 3 x 32 images (2 epochs) counted again as 2 epochs of 2 x 32: it ends at 3 x 22, not later
    assert final.startswith("final: val_top1=") and final.endswith(" steps=66"), final


@pytest.mark.long
def test_mae_pretraining_shards_its_encoder_and_decoder(tmp_path):
    run = tmp_path / "run"
    r = torchrun(["--dump", str(tmp_path), "--", "pretrain", "--method", "mae", "--epochs", "2", "-b", "32", "--shard", "--output", str(run)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "UserWarning" not in r.stderr, r.stderr[-3000:]  # (FSDP's view warning: see shard_module)
    for name in ("model.safetensors", "ssl.safetensors", "shards/.metadata"):
        assert (run / "last" / name).is_file(), name
    assert (run / "recon" / "epoch-002.png").is_file()  # drawn by rank 0, every rank ran the forward
    assert any(k.startswith("decoder_blocks.") for k in load_file(str(run / "last" / "ssl.safetensors")))
