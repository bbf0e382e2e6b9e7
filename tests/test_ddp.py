"""DDP with torchrun on CPU (gloo, loopback): 2 processes."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitkit.training.config import TrainConfig
from vitkit.training.trainer import Trainer

ENTRY = str(Path(__file__).with_name("ddp_entry.py"))
COMMON = ["--epochs", "3", "--crop-padding", "0", "--smoothing", "0", "--lr", "0.001", "--warmup-epochs", "1"]


# torchrun's agent started so that SIGUSR1 prints every thread's stack (as ddp_entry.py's workers do): a launch that
# hangs says where each process waits instead of only "timed out" (CI saw two such hangs it could not show)
AGENT = ["-c", "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
         "from torch.distributed.run import main; main()"]


def _tree(pid):
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own: no process group has all)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def launch(cmds, timeout, cwds=None):
    """Run the torchrun commands together; a list of (exit code, stdout, stderr). One that outlives ``timeout`` is
    failed with every process's stacks (SIGUSR1) and the end of what each printed, and nothing it started is left
    running."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
             for cmd, cwd in zip(cmds, cwds or [None] * len(cmds))]
    end, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, end - time.monotonic())))
        return [(p.returncode, *out) for p, out in zip(procs, outs)]
    except subprocess.TimeoutExpired:
        pids = [q for p in procs for q in _tree(p.pid)]
        for sig in (signal.SIGUSR1, signal.SIGKILL):
            for q in pids:
                try:
                    os.kill(q, sig)
                except ProcessLookupError:
                    pass
            time.sleep(3)
        outs = ["".join(p.communicate()) for p in procs]
        pytest.fail(f"torchrun still running after {timeout} s; each launch's output with its processes' stacks:\n"
                    + "\n=====\n".join(o[-12000:] for o in outs), pytrace=False)


def torchrun(args, nproc=2, max_restarts=0, timeout=240):
    cmd = [sys.executable, *AGENT, "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           ENTRY, *args]
    return subprocess.CompletedProcess(cmd, *launch([cmd], timeout)[0])


@pytest.mark.long
def test_two_ranks_end_identical_and_match_one_process_with_the_global_batch(tmp_path):
    # SGD: its update is linear in the gradient, so float summation order stays at float noise (AdamW's
    # normalised step turns the sign of a near-zero gradient into a full lr-sized difference)
    r = torchrun(["--dump", str(tmp_path), "--", "train", *COMMON, "-b", "32", "--opt", "sgd", "--lr", "0.05",
                  "--output", str(tmp_path / "run")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finals = [line for line in r.stdout.splitlines() if line.startswith("final:")]
    assert len(finals) == 1  # only rank 0 prints and writes
    # a new user read ten of PyTorch's DDP warnings per process as trouble (the test's own entry point, not vitkit,
    # makes a library touch torch.distributed.reduce_op: that FutureWarning is not the run's)
    assert "UserWarning" not in r.stderr and "Grad strides" not in r.stderr, r.stderr[-3000:]
    a, b = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # every rank trained with rank 0's settings: what the planner decided (precision, attention, threads, ...), the
    # batch per process, the LR, the schedule
    import json

    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert s0 == s1 and s0["cfg"]["batch_size"] == 32 and s0["chosen"]["precision"] in ("fp32", "bf16")
    # one process, batch 2 x 32, the same images per step: the same weights up to float summation order
    torch.set_num_threads(1)
    cfg = TrainConfig(dataset="digits", epochs=3, batch_size=64, lr=0.05, opt="sgd", warmup_epochs=1, crop_padding=0,
                      smoothing=0.0, model_args={"img_size": 8, "patch_size": 2, "embed_dim": 64, "depth": 4,
                                                 "num_heads": 4})
    single = Trainer(cfg, log=lambda s: None, progress=False)
    single.fit()
    s = single.model.state_dict()
    worst = max(float((s[k] - a[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst
    assert (tmp_path / "run" / "last" / "train_state.pt").is_file()


@pytest.mark.long
def test_pretraining_runs_under_torchrun_with_the_ranks_in_step(tmp_path):
    r = torchrun(["--dump", str(tmp_path), "--", "pretrain", "--method", "mae", "--epochs", "2", "-b", "32",
                  "--output", str(tmp_path / "run")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finals = [line for line in r.stdout.splitlines() if line.startswith("final:")]
    assert len(finals) == 1 and "val_loss=" in finals[0]  # only rank 0 prints; the objective's own score
    a, b = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert any("decoder" in k for k in a) and any(k.startswith("encoder.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the encoder and the decoder, the same on both ranks
    assert (tmp_path / "run" / "last" / "ssl.safetensors").is_file()


@pytest.mark.long
def test_a_killed_rank_is_restarted_and_training_resumes_from_last(tmp_path):
    out = tmp_path / "run"
    r = torchrun(["--die-at", "30:1", "--", "train", *COMMON, "-b", "32", "--output", str(out)], max_restarts=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("final: val_top1=")
    import vitkit

    model = vitkit.from_pretrained(out / "last")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.long
def test_nan_on_one_rank_stops_both_without_hanging(tmp_path):
    r = torchrun(["--nan-at", "5:1", "--", "train", *COMMON, "-b", "32", "--output", str(tmp_path / "run")],
                 timeout=180)
    assert r.returncode != 0
    assert "loss is nan" in r.stderr + r.stdout


def _one_gpu(monkeypatch, ranks_here=2, rank=0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"WORLD_SIZE": ranks_here, "LOCAL_WORLD_SIZE": ranks_here, "RANK": rank, "LOCAL_RANK": rank,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(k, str(v))


def test_more_ranks_than_gpus_is_one_line_before_any_process_group(monkeypatch, capsys):
    """`torchrun --nproc-per-node 2` on a one-GPU machine (the GPU count faked): both ranks took cuda:0 and NCCL
    failed with a traceback from each."""
    import torch.distributed as dist

    from vitkit.cli.main import main
    from vitkit.runtime.distributed import distributed_device

    _one_gpu(monkeypatch)
    assert main(["train", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 processes on this machine but it has 1 GPU" in err[0]
    assert "--nproc-per-node 1" in err[0] and "--device cpu" in err[0] and not dist.is_initialized()
    _one_gpu(monkeypatch, rank=1)
    assert main(["train", "--epochs", "1"]) == 2 and capsys.readouterr().err == ""  # rank 0 said it
    assert distributed_device("cpu") == torch.device("cpu")  # gloo on CPU processes: allowed
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed_device("auto") == torch.device("cuda", 1)  # its own GPU, by local rank


def test_nodes_whose_agents_count_restarts_apart_start_one_group(tmp_path):
    """Found by CI (the loopback two-node test hung 300 s): torchrun's agents count restarts each for itself, and a
    node whose worker was still running when the other node rejoined restarts it without counting. Two ranks on the
    agents' shared store, as torchrun starts them: a first group, then a second whose ranks have restart counts 1
    and 0. Both join one group, and both know it is a restart (they resume from last/)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # (the agents' store)
    code = ("import torch, torch.distributed as dist; from vitkit.runtime.distributed import init_distributed, "
            "restart_count; init_distributed('cpu'); t = torch.ones(1); dist.all_reduce(t); "
            "print(int(t.item()), restart_count()); dist.destroy_process_group()")
    for counts in ((0, 0), (1, 0)):
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                  "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                                                  "TORCHELASTIC_RESTART_COUNT": str(c), "OMP_NUM_THREADS": "1"})
                 for r, c in enumerate(counts)]
        try:
            outs = [p.communicate(timeout=90)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"ranks with restart counts {counts} did not form one group in 90 s")
        assert [p.returncode for p in procs] == [0, 0], outs
        assert [o.split()[-2:] for o in outs] == [["2", str(max(counts))]] * 2, outs
    del agents


@pytest.mark.filterwarnings("ignore:Grad strides")  # (the test's own model: its conv's gradient layout)
def test_micro_batches_of_a_grad_accum_step_are_all_reduced_once(one_process_group, monkeypatch):
    """DDP all-reduced every micro-batch's gradients (grad_accum times the traffic for the same sum): now only the
    last of a step's, with the same gradients as the micro-batches' sum (counted with DDP's communication hook)."""
    from torch.nn.parallel import DistributedDataParallel

    from vitkit.model import VisionTransformer, ViTConfig
    from vitkit.runtime.distributed import gradients_reduced

    cfg = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    torch.manual_seed(0)
    plain = VisionTransformer(cfg)
    ddp = DistributedDataParallel(copy.deepcopy(plain))
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())  # (one process: the sum over ranks is this rank's own)
        return fut

    ddp.register_comm_hook(None, counting)
    g = torch.Generator().manual_seed(1)
    for i in range(4):  # 2 steps of 2 micro-batches
        x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        with gradients_reduced(ddp, now=i % 2 == 1):
            torch.nn.functional.cross_entropy(ddp(x), y).div(2).backward()
        torch.nn.functional.cross_entropy(plain(x), y).div(2).backward()
    assert len(set(calls)) >= 1 and len(calls) == 2 * len(set(calls))  # every bucket once a step, not a micro-batch
    assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(ddp.module.parameters(), plain.parameters()))
    # the trainer asks for the reduction on each step's last micro-batch only
    import vitkit.training.trainer as trainer_mod

    seen = []
    real = trainer_mod.gradients_reduced
    monkeypatch.setattr(trainer_mod, "gradients_reduced", lambda m, now: seen.append(now) or real(m, now))
    run = Trainer(TrainConfig(dataset="digits", epochs=1, batch_size=32, grad_accum=3, compile=False,
                              precision="fp32", model_args={"img_size": 8, "patch_size": 4, "embed_dim": 16,
                                                            "depth": 1, "num_heads": 2}),
                  log=lambda s: None, progress=False)
    run.fit()
    assert len(seen) == 3 * run.steps_per_epoch and seen[:6] == [False, False, True] * 2


@pytest.mark.long
def test_two_ranks_streaming_a_folder_each_read_their_part_and_train_what_one_process_trains(tmp_path):
    """Issue 50: under torchrun each rank streams its own part of every epoch (no image twice, none missed): the
    averaged gradient is then one process's at the global batch, and the weights match it."""
    from helpers import write_digits_folder
    from vitkit.training.plan import Sources, resolve

    root = write_digits_folder(tmp_path / "d", per_class=12, size=8)  # 120 real digits, the digits recipe
    flags = {"dataset": "folder", "data_dir": str(root), "cache_dir": str(tmp_path / "c"), "epochs": 3,
             "crop_padding": 0, "smoothing": 0.0, "lr": 0.05, "warmup_epochs": 1, "opt": "sgd"}
    r = torchrun(["--dump", str(tmp_path), "--", "train", "--dataset", "folder", "--data-dir", str(root),
                  "--cache-dir", str(tmp_path / "c"), *COMMON, "--opt", "sgd", "--lr", "0.05", "-b", "16",
                  "--data-mode", "stream", "--workers", "1", "--output", str(tmp_path / "run")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "streamed from the files" in r.stdout
    a, b = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.set_num_threads(1)
    cfg, data, _ = resolve(Sources({**flags, "batch_size": 32, "data_mode": "memory"}), lambda s: None)
    single = Trainer(cfg, data, log=lambda s: None, progress=False)
    assert not single.data.streamed
    single.fit()
    s = single.model.state_dict()
    worst = max(float((s[k] - a[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst


# fixed settings: the runs compared below decide nothing by timing (threads or precision chosen differently would
# change the float summation order between them)
FIXED = ["--compile", "false", "--precision", "fp32", "--attention", "sdpa", "--channels-last", "false",
         "--threads", "1", "--opt", "sgd", "--lr", "0.05", "-b", "32"]


def two_nodes(args, cwds, max_restarts=0, timeout=300):
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice, as two machines would run it: a c10d rendezvous on
    127.0.0.1, each "node" in its own working folder. Returns (exit codes, outputs)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, *AGENT, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=vitkit-test", f"--max-restarts={max_restarts}",
           "--monitor-interval=1", ENTRY, *args]
    runs = launch([cmd, cmd], timeout, cwds)
    return [r[0] for r in runs], [r[1] + r[2] for r in runs]


@pytest.mark.long
def test_two_nodes_on_loopback_and_a_killed_rank_end_as_an_uninterrupted_run(tmp_path):
    """Two "machines" (2 nodes x 1 process, c10d rendezvous on 127.0.0.1) sharing the run folder: uninterrupted,
    and with rank 1 killed mid-epoch under --max-restarts 1. The restarted group resumes from last/ and ends with the
    uninterrupted run's weights: nothing lost, nothing trained twice from another state."""
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    for d in (ref, hit):
        d.mkdir()
    codes, outs = two_nodes(["--dump", str(ref), "--", "train", *COMMON, *FIXED, "--output", str(ref / "run")],
                            [tmp_path, tmp_path])
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    codes, outs = two_nodes(["--die-at", "30:1", "--dump", str(hit), "--", "train", *COMMON, *FIXED,
                             "--output", str(hit / "run")], [tmp_path, tmp_path], max_restarts=1)
    log = "".join(outs)
    assert codes == [0, 0], log[-6000:]
    assert "resumed from" in log and log.count("final: val_top1=") == 1
    a, b = load_file(str(ref / "rank0.safetensors")), load_file(str(hit / "rank0.safetensors"))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst  # the same weights (SGD; one thread each: the same summation order)
    c = load_file(str(hit / "rank1.safetensors"))
    assert all(torch.equal(b[k], c[k]) for k in b)  # both nodes end with one model


@pytest.mark.long
def test_nodes_that_do_not_share_the_run_folder_are_one_clear_error(tmp_path):
    """Each "node" in its own folder with a relative --output: after the restart one finds last/, the other nothing.
    Resuming on one and starting afresh on the other would train one model from two states; it stops, saying why."""
    cwds = [tmp_path / "node-a", tmp_path / "node-b"]
    for d in cwds:
        d.mkdir()
    codes, outs = two_nodes(["--die-at", "30:1", "--", "train", *COMMON, *FIXED, "--output", "run"], cwds,
                            max_restarts=1)
    log = "".join(outs)
    assert any(codes), log[-4000:]
    assert "do not agree where the run stands" in log and "shared filesystem" in log
    assert "final: val_top1=" not in log
