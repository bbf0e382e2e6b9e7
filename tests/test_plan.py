"""The run planner and calibration: every `auto` decided by timing, never by CPU flags. The decision logic is tested
with injected timings (steps that sleep for known times), so the right answer is known on any machine; one test
calibrates this machine for real and only checks that it is quick and self-consistent."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

import vitkit
import vitkit.runtime.calibrate as cal_mod
import vitkit.runtime.cpu as cpu_mod
from vitkit.runtime.calibrate import Calibration, Timing, time_candidates
import vitkit.training.compile_plan as compile_plan
import vitkit.training.plan as plan_mod
from vitkit.training.config import TrainConfig, read_recipe
from vitkit.training.plan import Sources, affordable_epochs, compile_worth_timing, pick_tier, make_plan, step_candidates

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VITKIT_CACHE_DIR", str(tmp_path / "cache"))


def _sleeps(times: dict[str, float], key: str = "precision"):
    """A ``make`` whose step sleeps ``times[settings[key]]`` seconds."""
    return lambda s: (lambda: time.sleep(times[s[key]]))


def test_the_faster_candidate_wins_and_a_clearly_slower_one_is_cut_after_one_call():
    cands = [{"precision": "bf16"}, {"precision": "fp32"}]
    cal = time_candidates("step", cands, _sleeps({"bf16": 0.03, "fp32": 0.01}))
    assert cal.best.settings == {"precision": "fp32"}  # bf16 slower here (as on a Xeon with the flag, no AMX)
    bf16 = cal.timings[0]
    assert bf16.calls == 1 and bf16.note.startswith("cut after 1 call") and cal.timings[1].calls >= 2
    cal = time_candidates("step", cands, _sleeps({"bf16": 0.01, "fp32": 0.02}))
    assert cal.best.settings == {"precision": "bf16"}  # bf16 faster (AMX, an EPYC with AVX512-BF16)
    assert "<- chosen" in cal.table().splitlines()[0] and "bf16" in cal.table().splitlines()[0]


def test_a_fast_step_is_timed_on_enough_calls_and_a_slow_one_within_the_budget():
    """(issue 80, P14) An H200's 9-ms step was timed on 4 calls, 36 ms of samples; on a virtual clock: fast steps get
    calls until half a second of them (at most 16 rounds), slow ones stop at the 2.5-s budget after two rounds."""
    now = [0.0]

    def make(s):
        def step():
            now[0] += s["seconds"]
        return step

    fast = [{"seconds": 0.009}, {"seconds": 0.010}]
    cal = time_candidates("step", fast, make, clock=lambda: now[0])
    assert [t.calls for t in cal.timings] == [16, 16]  # 16 x 19 ms = 0.30 s < 0.5 s: every round
    cal = time_candidates("step", [{"seconds": 0.05}, {"seconds": 0.06}], make, clock=lambda: now[0])
    assert [t.calls for t in cal.timings] == [5, 5]  # 5 x 110 ms = 0.55 s >= 0.5 s
    cal = time_candidates("step", [{"seconds": 1.0}, {"seconds": 1.1}], make, clock=lambda: now[0])
    assert [t.calls for t in cal.timings] == [2, 2]  # 2 rounds, 4.2 s > 2.5 s


def test_a_first_round_another_process_shared_is_not_cut_on_nor_counted(monkeypatch):
    """A 30-minute FixMatch run planned while another process ran and then left: round 1 timed bf16 at 7.6 s and
    fp32, last, at 1.9 s alone, so bf16 was cut after that one call and the run trained at half its pace. Replayed on
    a virtual clock: round 1 is shared (the load says so), and round 2, in the reverse order, decides."""
    import vitkit.runtime.calibrate as cal_mod

    rounds = []

    class Load:  # the first timed round shared with another process, the others not
        cores = 0.93

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            rounds.append(1)

        def contended(self, threads):
            return len(rounds) == 1  # (asked as each round ends: the first one)

    monkeypatch.setattr(cal_mod, "OtherLoad", Load)
    now, calls = [0.0], {"bf16": 0, "fp32": 0}

    def make(s):
        def step():
            p = s["precision"]
            calls[p] += 1
            shared = calls[p] == 2  # (call 1 is the warm-up; call 2 is round 1's)
            now[0] += {"bf16": 7.6 if shared else 0.95, "fp32": 1.9}[p]
        return step

    cal = cal_mod.time_candidates("step", [{"precision": "bf16"}, {"precision": "fp32"}], make, clock=lambda: now[0])
    assert cal.best.settings == {"precision": "bf16"} and cal.timings[0].seconds == pytest.approx(0.95)
    assert cal.timings[1].note.startswith("cut after 1 call")  # round 2's: round 1 not counted
    assert [c.seconds for c in cal.timings] == pytest.approx([0.95, 1.9])


def test_an_emulated_candidate_is_cut_at_its_warm_up_and_one_that_cannot_run_is_noted():
    calls = []

    def make(s):
        if s["precision"] == "fp16":
            raise RuntimeError("fp16 is not supported on this device")
        return lambda: (calls.append(s["precision"]), time.sleep(0.6 if s["precision"] == "bf16" else 0.01))

    cal = time_candidates("step", [{"precision": "fp32"}, {"precision": "bf16"}, {"precision": "fp16"}], make)
    assert calls.count("bf16") == 1  # its warm-up alone: never timed
    assert cal.timings[1].seconds is None and cal.timings[1].note.startswith("cut at warm-up")
    assert cal.timings[2].note.startswith("cannot run here: fp16 is not supported")
    assert cal.best.settings == {"precision": "fp32"}


def test_the_cache_hits_misses_and_a_new_torch_version_is_a_miss(monkeypatch):
    n = []

    def make(s):
        n.append(1)
        return lambda: time.sleep(0.001)

    work = {"kind": "test", "model": {"depth": 2}}
    cands = [{"precision": "fp32"}]
    first = cal_mod.calibrate("x", CPU, work, cands, make)
    assert not first.cached and len(n) == 1
    second = cal_mod.calibrate("x", CPU, work, cands, make)
    assert second.cached and len(n) == 1 and second.best.seconds == first.best.seconds  # a hit: nothing timed
    cal_mod.calibrate("x", CPU, {**work, "model": {"depth": 3}}, cands, make)  # another model: a miss
    assert len(n) == 2
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert not cal_mod.calibrate("x", CPU, work, cands, make).cached and len(n) == 3  # another torch: a miss
    assert cal_mod.calibrate("x", CPU, work, cands, make, refresh=True).cached is False  # `vitkit calibrate`
    cal_mod.cache_file().write_text("{not json")  # a broken cache costs a calibration, nothing else
    assert not cal_mod.calibrate("x", CPU, work, cands, make).cached


def test_tiers_by_the_epochs_the_budget_buys():
    tiers = [{"below": 15, "lr": 2}, {"below": 5, "lr": 3}]
    assert pick_tier(tiers, 2.0)["lr"] == 3 and pick_tier(tiers, 5.0)["lr"] == 2 and pick_tier(tiers, 15.0) is None
    # 100 s at 0.1 s per step of 64 images is 64,000 images, 80% of it delivered: 0.85 epochs of 60,000
    assert affordable_epochs(100, 0.1, 64, 1, 60000) == pytest.approx(100 * 0.8 * 640 / 60000)


def test_compile_is_timed_only_where_the_budget_could_repay_it():
    assert not compile_worth_timing(290.0, 30.0)  # a 5-minute run: a cold compile cannot pay
    assert compile_worth_timing(1790.0, 30.0)  # 30 minutes can
    assert compile_worth_timing(290.0, 3.0)  # a compile measured fast here (Inductor's cache warm)


DIGITS = dict(dataset="digits", epochs=2, batch_size=64, model_args={"depth": 1, "embed_dim": 32, "num_heads": 2})


def _inject(monkeypatch, step_s: dict[str, float]):
    """The planner's step probe sleeps instead of training: ``step_s[precision]`` seconds (exact attention 20%
    faster, channels-last no different)."""
    def make(self, s, compiled=False):
        t = step_s[s["precision"]] * (0.5 if s["attention"] == "exact" else 1.0)  # a gap that load cannot flip
        return lambda: time.sleep(t)

    monkeypatch.setattr(plan_mod.StepProbe, "make", make)


@pytest.mark.usefixtures("bf16_keeps_up")
@pytest.mark.parametrize("bf16_s,want", [(0.004, "bf16"), (0.02, "fp32")])
def test_precision_auto_is_the_faster_one_timed(monkeypatch, bf16_s, want):
    _inject(monkeypatch, {"fp32": 0.01, "bf16": bf16_s})
    cfg, p = make_plan(TrainConfig(**DIGITS, precision="auto", attention="auto", threads=1), log=lambda s: None)
    assert cfg.precision == want and cfg.attention == "exact" and not cfg.needs_plan
    assert p.chosen["precision"] == want and p.calibrations[0].best.settings["precision"] == want


def test_bf16_whose_matmuls_are_emulated_is_not_timed_and_the_plan_says_why(monkeypatch):
    """An AVX2-only EPYC: bf16 matmuls 33x fp32's (256), one bf16 step of the CIFAR-10 hybrid 20.3 s against
    1.57 s; a bf16 step here would take a minute, so its being timed at all fails the test's time."""
    _inject(monkeypatch, {"fp32": 0.01, "bf16": 60.0})
    monkeypatch.setattr(cpu_mod, "bf16_matmul_slowdown", lambda: 33.0)
    cfg, p = make_plan(TrainConfig(**DIGITS, precision="auto", attention="auto", threads=1), log=lambda s: None)
    assert cfg.precision == "fp32" and p.chosen["precision"] == "fp32"
    assert any("bf16 not timed (its matmuls take 33.0x fp32's on this CPU, emulated" in n for n in p.notes)
    assert all(c.settings["precision"] == "fp32" for cal in p.calibrations for c in cal.timings)
    monkeypatch.setattr(cpu_mod, "bf16_matmul_slowdown", lambda: 1.2)  # slower, but not by enough to rule it out
    for unit, order in ((False, ["fp32", "bf16"]), (True, ["bf16", "fp32"])):  # a reported bf16 unit: timed first
        monkeypatch.setattr(cpu_mod, "reports_bf16_unit", lambda: unit)  # (the test ran on AVX2 CPUs alone at first:
        candidates = step_candidates(TrainConfig(precision="auto"), torch.device("cpu"))  # it failed on an AVX512-BF16)
        assert list(dict.fromkeys(c["precision"] for c in candidates)) == order


def test_the_bf16_matmul_check_times_real_matmuls():
    """Whatever the CPU: a finite positive ratio, from a check that takes well under a second."""
    cpu_mod.bf16_matmul_slowdown.cache_clear()
    started = time.perf_counter()
    slow = cpu_mod.bf16_matmul_slowdown()
    assert 0 < slow < float("inf") and time.perf_counter() - started < 5


def test_compile_auto_stays_eager_when_the_gain_does_not_repay_the_compile(monkeypatch):
    _inject(monkeypatch, {"fp32": 0.01, "bf16": 0.02})
    gain = {}

    def fake_compile(probe, chosen, device):
        return Calibration("compile", [Timing({"compiled": False}, 0.010), Timing({"compiled": True}, gain["s"])],
                           extra={"compile_s": 40.0})

    monkeypatch.setattr(compile_plan, "_time_compile", fake_compile)
    monkeypatch.setattr(compile_plan, "has_cxx_compiler", lambda: True)
    base = TrainConfig(**{**DIGITS, "epochs": 100000}, precision="auto", compile="auto", threads=1)  # a long run
    gain["s"] = 0.0099  # 1% faster: not worth it
    cfg, p = make_plan(base, log=lambda s: None)
    assert cfg.compile is False and any(n.startswith("compile: off (compiled step 9.9 ms") for n in p.notes)
    short = TrainConfig(**DIGITS, precision="auto", compile="auto", threads=1, time_limit=5)  # 5 min: not timed
    cfg, p = make_plan(short, log=lambda s: None)  # at the gain measured on this device (1.01x), not a constant
    assert cfg.compile is False and any("cannot repay a ~40 s compile at the best gain, 1.01x, measured here" in n
                                        for n in p.notes)  # the measured compile time too
    gain["s"] = 0.006
    cfg, p = make_plan(base, log=lambda s: None, refresh=True)
    assert cfg.compile is True and any(n.startswith("compile: on") for n in p.notes)
    cfg, p = make_plan(short, log=lambda s: None)  # 1.67x measured: 5 minutes save ~116 s for a 40-s compile
    assert cfg.compile is True and any(n.startswith("compile: on") for n in p.notes)
    # a saving within a quarter of the compile is a tie (an H200's 2-minute Fashion-MNIST run: 40 s saved, estimated
    # on the steps alone, for a 36-s compile; it trained fewer steps than eagerly): ~290 s left of 5 minutes, 0.0084
    # s a step saves ~46 s for the 40-s compile, 0.0079 ~61 s
    gain["s"] = 0.0084
    cfg, p = make_plan(short, log=lambda s: None, refresh=True)
    assert cfg.compile is False and any("compile: at least 1.25x it is worth one" in n for n in p.notes), p.notes
    gain["s"] = 0.0079  # (timed only because a larger gain was measured here before: 1.67x at 0.006)
    monkeypatch.setattr(compile_plan, "compile_gain", lambda device: (1 / 0.6, "measured here"))
    cfg, p = make_plan(short, log=lambda s: None, refresh=True)
    assert cfg.compile is True, p.notes


@pytest.mark.parametrize("busy,timed", [(0.8, 2), (None, 1)])
def test_a_compile_timed_while_others_held_the_cores_is_not_cached_for_the_next_run(monkeypatch, tmp_path, busy,
                                                                                    timed):
    """The compile timing was stored whatever the load, and the next run read a beside-a-test-suite step as its
    own ("cached"); the other timings were already kept to their run."""
    _inject(monkeypatch, {"fp32": 0.01, "bf16": 0.02})
    monkeypatch.delenv("VITKIT_CACHE_UNDER_LOAD", raising=False)
    monkeypatch.setenv("VITKIT_CACHE_DIR", str(tmp_path))  # no other test's timings
    calls = []

    def fake_compile(probe, chosen, device):
        calls.append(1)
        extra = {"compile_s": 40.0, **({"other_load_cores": busy} if busy else {})}
        return Calibration("compile", [Timing({"compiled": False}, 0.010), Timing({"compiled": True}, 0.006)],
                           extra=extra)

    monkeypatch.setattr(compile_plan, "_time_compile", fake_compile)
    monkeypatch.setattr(compile_plan, "has_cxx_compiler", lambda: True)
    base = TrainConfig(**{**DIGITS, "epochs": 100000}, precision="auto", compile="auto", threads=1)
    make_plan(base, log=lambda s: None, refresh=True)
    cfg, _ = make_plan(base, log=lambda s: None)
    assert len(calls) == timed and cfg.compile is True


def test_a_slow_machine_gets_the_few_epochs_tier_and_a_fast_one_the_recipe(monkeypatch):
    tiers = [{"below": 3, "model_args": {"depth": 2}, "lr": 0.003}, {"below": 30, "lr": 0.002}]
    base = TrainConfig(**DIGITS, precision="auto", threads=1, time_limit=0.25, tiers=tiers)
    # digits: 1,437 training images; a 15-second budget leaves ~11 s after the margin and the calibration
    _inject(monkeypatch, {"fp32": 0.05, "bf16": 0.1})  # 0.05 s a step at best: ~8 epochs
    cfg, p = make_plan(base, log=lambda s: None)
    assert cfg.model_args["depth"] == 1 and cfg.lr == 0.002 and cfg.tiers is None and p.tier["below"] == 30
    assert 3 < p.epochs_affordable < 30
    _inject(monkeypatch, {"fp32": 0.25, "bf16": 0.5})  # a machine 5x slower
    cfg, p = make_plan(base, log=lambda s: None, refresh=True)
    assert cfg.model_args["depth"] == 2 and cfg.lr == 0.003 and p.tier["below"] == 3
    assert "depth 1 -> 2" in " ".join(p.notes)
    _inject(monkeypatch, {"fp32": 0.001, "bf16": 0.002})  # fast: the recipe as it is
    cfg, p = make_plan(base, log=lambda s: None, refresh=True)
    assert (cfg.model_args["depth"], cfg.lr, p.tier) == (1, 1e-3, None)


def test_the_users_flags_win_over_the_tiers(tmp_path):
    cfg, _, name = plan_mod.resolve(Sources({"dataset": "fashion-mnist", "lr": 0.05}, {"depth": 5}), lambda s: None)
    assert name == "fashion-mnist" and cfg.lr == 0.05 and cfg.model_args["depth"] == 5
    assert all("lr" not in t and "depth" not in t.get("model_args", {}) for t in cfg.tiers)
    cfg, _, _ = plan_mod.resolve(Sources({"dataset": "fashion-mnist", "tiers": None}), lambda s: None)
    assert cfg.tiers is None  # --no-tiers


def test_the_recipes_leave_speed_to_the_planner_and_carry_no_machine_keyed_sections():
    for name in ("fashion-mnist", "cifar10"):
        r = read_recipe(name)
        assert {r[k] for k in ("precision", "compile", "attention", "channels_last")} == {"auto"}, name
        assert not {"cpu_fp32", "budgets", "few_epochs"} & set(r), name
        TrainConfig.from_dict(r)  # every tier is valid


@pytest.mark.parametrize("tier,error", [
    ({"lr": 0.1}, "needs one of below: N or above: N"),
    ({"below": 3, "dataset": "cifar10"}, "cannot set ['dataset']"),
    ({"below": 3, "lr": -1}, "tiers[0]: train config: lr must be > 0"),
    ({"below": 3, "model_args": {"widht": 3}}, "unknown model override key(s) ['widht']")])
def test_a_wrong_tier_is_refused_before_the_run_starts(tier, error):
    with pytest.raises(ValueError) as e:
        TrainConfig(tiers=[tier])
    assert error in str(e.value)


def test_a_real_calibration_here_is_quick_and_its_plan_is_saved_as_logged(tmp_path, capsys):
    """`vitkit train` times one step before its first, and the rest on its own first steps (training/tune.py): the
    run folder's plan.json and config.yaml say what they chose, and the cache holds it for the next run."""
    from vitkit.cli.main import main

    t = time.time()
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--precision", "auto", "--attention", "auto", "--channels-last", "auto",
                 "--depth", "1", "--output", str(out)]) == 0
    assert time.time() - t < 60
    said = capsys.readouterr().out
    saved = json.loads((out / "plan.json").read_text())
    first, tuned = saved["calibrations"][0], saved["calibrations"][-1]
    assert "one step" in first["what"] and len(first["timings"]) == 1 and first["seconds_spent"] < 15
    assert saved["seconds"] <= saved["ended_s"] < 60  # the plan's end, from the run's start (loading before it)
    assert "timed on the run's first steps" in tuned["what"] and "decided while training:" in said
    chosen = saved["chosen"]
    assert f"chosen: precision {chosen['precision']}, compile False, attention {chosen['attention']}" in said
    timings = tuned["timings"]
    # bf16 where its matmuls keep up with fp32's on this CPU; no stem: no layout to time
    assert {t["settings"]["precision"] for t in timings} == set(cpu_mod.cpu_precisions()[0])
    assert {t["settings"]["channels_last"] for t in timings} == {False}
    # the fastest, or the value held into its timing where none was clearly faster (tune._clearly_faster)
    picked = {k: chosen[k] for k in ("precision", "attention", "channels_last")}
    best = min(t["seconds"] for t in timings if t["seconds"])
    assert tuned["chosen"] == picked and next(t["seconds"] for t in timings if t["settings"] == picked) < 1.5 * best
    import yaml

    cfg = yaml.safe_load((out / "config.yaml").read_text())  # the run folder says what ran
    assert {k: cfg[k] for k in ("precision", "attention", "channels_last", "compile")} == {
        k: chosen[k] for k in ("precision", "attention", "channels_last", "compile")}
    # the second run of the same shape pays nothing
    capsys.readouterr()
    assert main(["calibrate", "--epochs", "1", "--precision", "auto", "--attention", "auto", "--channels-last",
                 "auto", "--depth", "1", "--keep-cache", "--inference-batch", "0"]) == 0
    assert "(cached)" in capsys.readouterr().out


def test_inference_dtype_is_timed_and_cached(monkeypatch):
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=4).eval()
    fast = vitkit.optimize_for_inference(model)
    cal = fast.calibration
    assert {t.settings["dtype"] for t in cal.timings} == set(cpu_mod.cpu_precisions()[0]) and not cal.cached
    assert fast.precision == cal.best.settings["dtype"]
    assert {p.dtype for p in fast.parameters()} == {torch.bfloat16 if fast.precision == "bf16" else torch.float32}
    assert fast(torch.randn(2, 3, 32, 32)).dtype == torch.float32
    assert vitkit.optimize_for_inference(model).calibration.cached
    assert vitkit.optimize_for_inference(model, dtype=None).precision == "fp32"  # asked for: no timing
    assert vitkit.optimize_for_inference(model, dtype=torch.bfloat16).calibration is None


def test_the_bias_after_the_matmul_gives_the_same_logits_and_is_chosen_only_when_timed_faster(monkeypatch):
    from vitkit.runtime import inference

    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=4).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    split = inference.optimize_for_inference(model, dtype=None)
    assert inference.split_bias(split.model) == 2 * 4 + 1  # qkv, proj, fc1, fc2 per block, and the head
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x), rtol=1e-5, atol=1e-6)  # the same sums, bias added last
    assert list(split.state_dict()) == list(inference.optimize_for_inference(model, dtype=None).state_dict())
    # the staged timing: dtype and path first, then the bias on the winner; the later stage decides
    # (split timed 1% faster than addmm: within the noise, PyTorch's own addmm is kept)
    for faster, split_s, batch in (("split", 0.01, 3), ("addmm", 0.02, 2), ("addmm", 0.0149, 4)):
        def fake_time(what, candidates, make, **kw):
            secs = {"split": split_s, "addmm": 0.015}
            return Calibration(what, [Timing(c, secs[c["bias"]] if "bias" in c else
                                             (0.012 if c == {"dtype": "fp32", "attention": "exact"} else 0.05), 3)
                                      for c in candidates])
        monkeypatch.setattr(cal_mod, "time_candidates", fake_time)
        fast = inference.optimize_for_inference(model, batch_size=batch)
        assert fast.calibration.best.settings == {"dtype": "fp32", "attention": "exact", "bias": faster}
        assert fast.precision == "fp32" and fast.model.blocks[0].attn.impl == "exact"
        assert isinstance(fast.model.blocks[0].mlp.fc1, inference.SplitBiasLinear) == (faster == "split")
        assert "<- chosen" in fast.calibration.table().splitlines()[-1 if faster == "split" else -2]


@pytest.mark.usefixtures("bf16_keeps_up")
def test_bf16_split_bias_compiled_and_registered_attention_as_an_amx_cpu_would_choose(monkeypatch):
    """What an AMX CPU's timing picks (bf16 weights, the bias after the matmul) forced on any CPU: compiling it, and
    a registered attention kernel on it, crashed with "'SplitBiasLinear' object has no attribute 'in_features'"
    (issue 48, items 1 and 7). Checked against the fp32 model, as close as bf16 SDPA is."""
    from vitkit.model import vit as vit_mod
    from vitkit.runtime import inference

    model = vitkit.create_model("vit_small_patch16_224", img_size=32, depth=1, num_classes=10).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
        ref = model(x := torch.randn(3, 3, 32, 32))

    def fake_time(what, candidates, make, **kw):  # bf16 + sdpa fastest, then split faster than addmm
        return Calibration(what, [Timing(c, 0.01 if c.get("bias") == "split" or
                                         (c["dtype"], c["attention"]) == ("bf16", "sdpa") and "bias" not in c
                                         else 0.02, 3) for c in candidates])
    monkeypatch.setattr(cal_mod, "time_candidates", fake_time)
    fast = inference.optimize_for_inference(model, compile=True, batch_size=3)
    assert fast.calibration.best.settings == {"dtype": "bf16", "attention": "sdpa", "bias": "split"}
    qkv = fast.model.blocks[0].attn.qkv
    assert isinstance(qkv, inference.SplitBiasLinear) and (qkv.in_features, qkv.out_features) == (384, 1152)
    eager = inference.optimize_for_inference(model, dtype=torch.bfloat16)
    out = fast(x)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 2 * (eager(x) - ref).abs().max() + 1e-3

    def exact_kernel(qkv, scale):  # (B, T, 3, h, d) -> (B, T, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return (torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v).transpose(1, 2)
    monkeypatch.setitem(vit_mod.ATTENTION_KERNELS, "test_exact", exact_kernel)
    monkeypatch.setitem(vit_mod._TAKES_HEAD_SIZE, "test_exact", lambda d: d % 16 == 0)
    assert vit_mod.set_attention(fast.model, "test_exact") == 1  # head size 64, read with the bias split
    torch.testing.assert_close(fast.model(x.bfloat16()).float(), eager(x), atol=0.05, rtol=0.05)


def _measure(speeds, peaks_gib):
    """An injected GPU: images per second and peak memory by batch; a batch not listed runs out of memory."""
    def measure(batch):
        if batch not in speeds:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return speeds[batch], int(peaks_gib[batch] * 2**30)
    return measure


def test_gpu_batch_is_the_largest_that_fits_and_gains_over_its_half_searched_from_the_top():
    from vitkit.training.plan import choose_batch

    speeds = {64: 4800, 128: 9000, 256: 17000, 512: 30000, 1024: 31000, 2048: 31500}
    peaks = {64: 0.5, 128: 1, 256: 2, 512: 4, 1024: 8, 2048: 16}
    batch, trials = choose_batch(_measure(speeds, peaks), 64, 60_000, 40 * 2**30)
    assert batch == 512  # 1024: +3% over 512, not the 5% a doubling must give; 512: 1.76x 256
    assert [(t.batch, t.fits) for t in trials] == [(4096, False), (2048, True), (1024, True), (512, True), (256, True)]
    # 80% of 4 GiB: 4096 runs out of memory, 2048 peaks at 16 GiB (so 1024 at 8 GiB or more, 512 at 4 or more:
    # neither run), 256 fits and gains over 128
    batch, trials = choose_batch(_measure(speeds, peaks), 64, 60_000, 4 * 2**30)
    assert batch == 256 and [t.batch for t in trials] == [4096, 2048, 256, 128]
    batch, trials = choose_batch(_measure({64: 4800, 128: 9000}, peaks), 64, 60_000, 40 * 2**30)
    assert batch == 128 and [t.fits for t in trials] == [False] * 5 + [True, True]  # 256 and up ran out of memory
    batch, trials = choose_batch(_measure(speeds, peaks), 64, 1437, 40 * 2**30)  # digits: 1437 // 128 = 11 steps
    assert batch == 64 and trials == []  # nothing to choose: nothing run
    # the H200's CIFAR-10 step (results/gpu/h200-2026-12-04b): every doubling gained; two sizes run, not six
    h200 = {128: 7052, 256: 14545, 512: 29244, 1024: 55773, 2048: 77909, 4096: 88403}
    gib = {128: 0.4, 256: 0.7, 512: 1.3, 1024: 2.4, 2048: 4.8, 4096: 9.3}
    batch, trials = choose_batch(_measure(h200, gib), 128, 50_000, 139 * 2**30)
    assert batch == 4096 and [t.batch for t in trials] == [4096, 2048]
    # a flat stretch, then a gain (a launch-bound step): the gain is taken
    batch, _ = choose_batch(_measure({64: 1000, 128: 1010, 256: 3000}, peaks), 64, 60_000, 3 * 2**30)
    assert batch == 256


def test_gpu_batch_scales_the_learning_rate_and_says_so(monkeypatch):
    from vitkit.training.plan import Plan, _decide_batch, scale_lr

    sgd, adamw = TrainConfig(opt="sgd", lr=0.1, batch_size=64), TrainConfig(lr=1e-3, min_lr=1e-5, batch_size=64)
    assert scale_lr(sgd, 256)["lr"] == pytest.approx(0.4)
    assert scale_lr(adamw, 256) == pytest.approx({"batch_size": 256, "lr": 2e-3, "min_lr": 2e-5})
    from vitkit.training.plan import BatchTrial

    monkeypatch.setattr(plan_mod, "choose_batch", lambda measure, base, n, free: (
        512, [BatchTrial(64, 4800.0, 2**29, True), BatchTrial(512, 30000.0, 2**32, True)]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    data = vitkit.training.build.build_data(adamw)
    p = Plan("digits", "cuda:0", "an injected GPU", {})
    cfg = _decide_batch(adamw, data, torch.device("cuda", 0), p)
    assert (cfg.batch_size, cfg.gpu_batch, cfg.epochs, cfg.warmup_epochs) == (512, False, 30, 1.0)
    assert cfg.lr == pytest.approx(1e-3 * 8 ** 0.5)
    assert "64 4,800 img/s 0.5 GiB, 512 30,000 img/s 4.0 GiB -> 512" in " ".join(p.notes)
    assert "square-root scaling" in " ".join(p.notes)
    assert _decide_batch(adamw, data, torch.device("cpu"), p) is adamw  # a CPU keeps the recipe's batch


def test_a_batch_that_does_not_fit_on_the_gpu_takes_activation_checkpointing_and_says_so(monkeypatch):
    """Issue 84: a ViT-L/16 fine-tuned at 384 px on a 24 GB card at its recipe's batch: no batch the search runs fits
    (the recipe's own peaks at 30 GiB), so the same step is measured with activation checkpointing, which fits
    (11 GiB); the run takes it, with the recipe's batch and learning rate, and the plan says why. Where it would not
    fit either, or where the batch fits, nothing changes."""
    from vitkit.training.gpu_batch import checkpointing_fits
    from vitkit.training.plan import BatchTrial, Plan, _decide_batch

    gib = 2 ** 30
    over = [BatchTrial(512, 300.0, 30 * gib, False)]
    asked = []

    def checkpointed(peak_gib):
        def measure(batch):
            asked.append(batch)
            return 210.0, int(peak_gib * gib)
        return measure

    assert checkpointing_fits(over, 512, checkpointed(11), 24 * gib) == BatchTrial(512, 210.0, 11 * gib, True)
    assert checkpointing_fits(over, 512, checkpointed(20), 24 * gib) is None  # over 80% of 24 GiB still
    assert checkpointing_fits([BatchTrial(512, 300.0, 8 * gib, True)], 512, checkpointed(4), 24 * gib) is None
    assert checkpointing_fits([], 512, checkpointed(4), 24 * gib) is None  # nothing measured: nothing known
    assert asked == [512, 512]  # measured only where the batch was measured not to fit

    cfg = TrainConfig(lr=1e-3, batch_size=512)
    measured = []

    def batch_measure(c, data, device, setting):
        measured.append(c.grad_checkpointing)
        return checkpointed(11 if c.grad_checkpointing else 30)

    monkeypatch.setattr(plan_mod, "choose_batch", lambda measure, base, n, free: (512, over))
    monkeypatch.setattr(plan_mod, "_batch_measure", batch_measure)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    data = vitkit.training.build.build_data(cfg)
    p = Plan("digits", "cuda:0", "an injected GPU", {})
    new = _decide_batch(cfg, data, torch.device("cuda", 0), p)
    assert (new.batch_size, new.lr, new.grad_checkpointing, new.gpu_batch) == (512, 1e-3, True, False)
    assert measured == [False, True]
    said = " ".join(p.notes)
    assert "batch 512 does not fit in 80% of the GPU's free memory" in said and "--grad-checkpointing" in said
    assert "11.0 GiB at 210 img/s" in said
    # asked for already: not measured again
    measured.clear()
    again = _decide_batch(TrainConfig(lr=1e-3, batch_size=512, grad_checkpointing=True), data,
                          torch.device("cuda", 0), Plan("digits", "cuda:0", "an injected GPU", {}))
    assert again.grad_checkpointing and measured == [True]


def test_a_batch_the_user_gave_is_kept_on_a_gpu():
    cfg, _, _ = plan_mod.resolve(Sources({"dataset": "digits"}), lambda s: None)
    assert cfg.gpu_batch
    cfg, _, _ = plan_mod.resolve(Sources({"dataset": "digits", "batch_size": 32}), lambda s: None)
    assert not cfg.gpu_batch and cfg.batch_size == 32
    cfg, _, _ = plan_mod.resolve(Sources({"dataset": "digits", "batch_size": 32, "gpu_batch": True}), lambda s: None)
    assert cfg.gpu_batch


@pytest.mark.cuda
def test_gpu_batch_on_a_real_gpu_is_measured_and_fits():
    data_dir = os.environ.get("VITKIT_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")  # a GPU machine's copy
    if not Path(data_dir, "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"Fashion-MNIST is not in {data_dir} (apt-get install dataset-fashion-mnist, or set "
                    "VITKIT_FASHION_MNIST)")
    cfg, p = make_plan(TrainConfig(dataset="fashion-mnist", data_dir=data_dir, batch_size=64, epochs=1),
                       log=lambda s: None)
    assert cfg.batch_size >= 64 and not cfg.gpu_batch and any("batch on this GPU" in n for n in p.notes)


def test_in_bf16_on_a_cpu_the_run_starts_on_exact_attention_and_still_times_sdpa(monkeypatch):
    """The order is where the run starts, not what it keeps: bf16 on a CPU starts on the explicit attention (it won
    19 of 20 first runs on the bf16 CPU kinds); fp32 and a GPU start on SDPA; both are candidates everywhere."""
    monkeypatch.setattr(cpu_mod, "bf16_matmul_slowdown", lambda: 0.45)
    monkeypatch.setattr(cpu_mod, "reports_bf16_unit", lambda: True)
    cands = step_candidates(TrainConfig(precision="auto", attention="auto", channels_last="auto"), torch.device("cpu"))
    assert [(c["precision"], c["attention"]) for c in cands[::2]] == [
        ("bf16", "exact"), ("bf16", "sdpa"), ("fp32", "sdpa"), ("fp32", "exact")]
    fixed = step_candidates(TrainConfig(precision="bf16", attention="sdpa"), torch.device("cpu"))
    assert {c["attention"] for c in fixed} == {"sdpa"}  # a flag is kept
