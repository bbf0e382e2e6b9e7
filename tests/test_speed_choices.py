"""The speed decisions made for the user: threads, request batching (precision, compile and the rest:
test_plan.py). Behaviour only, never timings
of the real machine (those are benchmarks): the workloads here are built so the right answer is known."""
from __future__ import annotations

import asyncio
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from vitkit.runtime import threads as th
from vitkit.runtime.cpu import cpu_kind, cpu_kind_short
from vitkit.serving.batcher import Batcher, Busy
from vitkit.training.config import TrainConfig

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(th, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_fewest_threads_within_ten_percent_of_the_fastest_win():
    assert th.pick({1: 0.0100, 2: 0.0095}) == 1  # a near tie shares the machine better with one
    assert th.pick({1: 0.0200, 2: 0.0100}) == 2
    assert th.pick({1: 0.0200, 2: 0.0300}) == 1  # a busy core makes two threads slower than one
    assert th.candidates(1) == [1] and th.candidates(2) == [1, 2] and th.candidates(8) == [1, 4, 8]


def _sleep_step(per_thread: bool):  # a step whose time is known: halves with two threads, or does not change
    return lambda: time.sleep(0.02 / (torch.get_num_threads() if per_thread else 1))


def test_threads_are_measured_on_the_step_and_set():
    n, note = th.choose_threads(_sleep_step(per_thread=True))
    assert n == 2 and torch.get_num_threads() == 2 and "measured" in note and "2 threads" in note
    n, note = th.choose_threads(_sleep_step(per_thread=False))
    assert n == 1 and torch.get_num_threads() == 1


def test_threads_asked_for_are_taken_as_given(monkeypatch):
    n, note = th.choose_threads(pytest.fail, requested=1)  # no probe is run
    assert n == 1 and torch.get_num_threads() == 1 and "--threads" in note
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    n, note = th.choose_threads(pytest.fail)
    assert "OMP_NUM_THREADS" in note


def test_a_long_step_that_splits_uses_every_core_after_one_step_on_one_thread(monkeypatch):
    monkeypatch.setattr(th, "BIG_STEP_S", 0.01)
    calls = []
    n, note = th.choose_threads(lambda: (calls.append(torch.get_num_threads()),
                                         time.sleep(0.04 / torch.get_num_threads())))
    assert n == 2 and calls == [2, 2, 1] and "all 2 cores" in note and torch.get_num_threads() == 2
    monkeypatch.setattr(th, "HUGE_STEP_S", 0.015)  # too long to try one thread at all
    calls.clear()
    n, note = th.choose_threads(lambda: (calls.append(torch.get_num_threads()), time.sleep(0.02)))
    assert n == 2 and calls == [2, 2]


def test_a_step_slowed_by_another_process_threads_is_timed_and_gets_one_thread(monkeypatch):
    # two OpenMP teams on the same cores: all threads crawl (seen: a digits step at 1 s on 2 threads beside another
    # 2-thread training, 30 ms on one), so the long step is not taken to split well
    monkeypatch.setattr(th, "BIG_STEP_S", 0.01)
    n, note = th.choose_threads(lambda: time.sleep(0.03 if torch.get_num_threads() == 2 else 0.002))
    assert n == 1 and "measured" in note and torch.get_num_threads() == 1


def test_one_slow_round_does_not_decide_the_thread_count():
    """A ~1 s step gets two timed rounds in the budget: one round that a passing hiccup slowed (150 ms, where the step
    takes 10 ms on two threads and 40 ms on one: margins a loaded machine's late wake-ups do not cross) must not make
    one thread look faster. A contended count is slow in every round, and still loses (the test above)."""
    calls = {1: 0, 2: 0}

    def step():
        n = torch.get_num_threads()
        calls[n] += 1
        time.sleep(0.15 if (n, calls[n]) == (2, 2) else 0.01 if n == 2 else 0.04)  # call 1 of each: the warm-up

    times = th.time_threads(step, [1, 2], rounds=2)
    assert calls == {1: 3, 2: 3} and times[2] < 0.04 <= times[1] and th.pick(times) == 2


def test_compile_auto_is_checked_in_the_config():
    assert TrainConfig(compile="auto").compile == "auto"
    with pytest.raises(ValueError, match="compile must be true, false, auto or reduce-overhead"):
        TrainConfig(compile="sometimes")
    with pytest.raises(ValueError, match="threads must be at least 1"):
        TrainConfig(threads=0)


def test_cli_takes_compile_auto_and_threads():
    from vitkit.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["train", "--compile", "auto"]).compile == "auto"
    assert p.parse_args(["train", "--compile"]).compile is True
    assert p.parse_args(["train", "--no-compile"]).compile is False
    assert p.parse_args(["train", "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--compile", "maybe"])


def test_cpu_kind_names_vendor_and_vector_units():
    kind, short = cpu_kind(), cpu_kind_short()
    if Path("/proc/cpuinfo").is_file() and platform.machine() == "x86_64":
        flags = Path("/proc/cpuinfo").read_text()
        unit = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
            "AVX-512" if "avx512f" in flags else "AVX2"
        assert unit in kind and "fp32" not in kind  # what it reports, not what is fast on it
    assert "-" in short and short == short.lower()


# ------------------------------------------------------------------------------------------ request batching
def test_requests_waiting_together_are_answered_in_one_batch():
    gate, sizes = threading.Event(), []

    def fn(items):
        gate.wait(5)  # the first batch holds the worker while the others queue up behind it
        sizes.append(len(items))
        return [x * 10 if x >= 0 else ValueError(f"bad {x}") for x in items]

    async def main():
        b = Batcher(fn, workers=1, max_batch=4, max_queue=8)
        tasks = [asyncio.create_task(b.submit(i)) for i in range(7)]
        await asyncio.sleep(0.1)
        gate.set()
        out = await asyncio.gather(*tasks)
        with pytest.raises(ValueError, match="bad -1"):  # an item's error reaches that item's caller alone
            await b.submit(-1)
        return out

    assert asyncio.run(main()) == [i * 10 for i in range(7)]
    assert sizes == [4, 3, 1]  # the seven queued together went in batches of at most 4; the last alone


def test_past_the_queue_limit_requests_are_told_busy_at_once():
    gate = threading.Event()

    async def main():
        b = Batcher(lambda items: (gate.wait(5), items)[1], workers=1, max_batch=1, max_queue=2)
        held = [asyncio.create_task(b.submit(i)) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Busy):
            await b.submit(99)
        gate.set()
        return await asyncio.gather(*held)

    assert asyncio.run(main()) == [0, 1]


def test_the_thread_probe_leaves_no_trace_on_the_run():
    from vitkit.training.trainer import Trainer

    cfg = dict(dataset="digits", epochs=1, model_args={"hybrid": "conv:8", "depth": 1, "embed_dim": 32, "num_heads": 2})
    states = []
    for threads in (None, 1):  # measured (the probe runs forward+backward) or given (no probe)
        torch.manual_seed(0)
        t = Trainer(TrainConfig(**cfg, threads=threads), log=lambda s: None, progress=False)
        states.append(({k: v.clone() for k, v in t.model.state_dict().items()}, torch.get_rng_state()))
        assert all(p.grad is None for p in t.model.parameters())
    (a, rng_a), (b, rng_b) = states
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # BatchNorm's statistics included
    assert torch.equal(rng_a, rng_b)


def test_as_cpu_kind_makes_pytorch_dispatch_as_the_smaller_cpu(tmp_path):
    """benchmarks/as_cpu_kind.sh (the stand-in for the AVX2-only and AVX-512-only kinds) clears cpuid bits: PyTorch's
    own CPU detection (the cpuinfo library) must then pick the smaller kind's kernels, and cpu_kind() say so."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "cpuid_fault" not in info.split():
        pytest.skip("this CPU or kernel cannot make cpuid fault (no cpuid_fault in /proc/cpuinfo)")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build benchmarks/cpuid_mask.c")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "as_cpu_kind.sh"
    probe = ("import torch; from vitkit.runtime.cpu import cpu_kind; "
             "print(torch.backends.cpu.get_cpu_capability(), torch.cpu._is_amx_tile_supported(), cpu_kind())")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGSEGV handler of the program's own: the mask must keep answering cpuid
    has_avx512 = "avx512f" in info.split()
    unmasked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                              timeout=120).stdout.strip().split(" ", 2)[2]
    for kind, want in (("avx2", "AVX2"), ("avx512", "AVX512" if has_avx512 else "AVX2")):
        r = subprocess.run(["bash", str(script), kind, sys.executable, "-c", probe], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        capability, amx, kind_text = r.stdout.strip().split(" ", 2)
        assert capability == want and amx == "False"
        if kind_text != unmasked:  # the mask hid units this CPU has: never another kind's column
            assert "(emulated: a cpuid mask on a " in kind_text, kind_text
        else:  # nothing to hide (an AVX2-only EPYC run as avx2): its own kind, not "emulated"
            assert "emulated" not in kind_text and not (kind == "avx2" and has_avx512), kind_text
        if has_avx512 and kind == "avx2":
            assert ", AVX2 (emulated" in kind_text, kind_text
    r = subprocess.run(["bash", str(script), "sse", "true"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: as_cpu_kind.sh {avx2|avx512|avx512vnni}" in r.stderr
