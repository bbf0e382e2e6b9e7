"""Training end to end: run folder, exact resume, atomic checkpoints, divergence, time limit, CLI."""
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

import vitkit

from vitkit.training.checkpoint import recover_checkpoint, save_checkpoint
from vitkit.training.config import TrainConfig
from vitkit.training.budget import TimeBudget
from vitkit.training.runlog import RunLog
from vitkit.training.trainer import Trainer, TrainingDiverged
from vitkit.cli.main import main
from vitkit.runtime.compile import has_cxx_compiler

from helpers import cifar_slice, write_digits_folder

FAST = dict(dataset="digits", epochs=3, batch_size=64, lr=1e-3, warmup_epochs=1)


def _cfg(**kw):
    return TrainConfig(**{**FAST, **kw})


def _quiet(*a):
    pass


def test_train_eval_predict_on_digits_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "3", "--output", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("final: val_top1=") and "epochs=3" in lines[-1]
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) >= {"epoch", "step", "train_loss", "val_loss", "val_top1", "lr", "img_per_s", "elapsed_s"}
    assert rows[-1]["val_top1"] > 50  # three epochs on real digits are far above chance (10%)
    for f in ("config.yaml", "curves.png", "last/config.json", "last/model.safetensors", "last/train_state.pt",
              "best/model.safetensors"):
        assert (out / f).is_file(), f
    assert list((out / "tb").glob("events.out.tfevents*"))
    # eval reads the run's dataset from the run folder
    assert main(["eval", "--checkpoint", str(out / "best"), "--precision", "fp32"]) == 0  # exact, as trained
    ev = json.loads((out / "best" / "eval" / "eval.json").read_text())
    assert ev["n"] == 360 and abs(ev["top1"] - max(r["val_top1"] for r in rows)) < 0.01
    assert (out / "best" / "eval" / "confusion.png").is_file()
    # predict on real digit images written as PNG files
    folder = write_digits_folder(tmp_path / "imgs", per_class=1, size=32, mode="RGB")
    imgs = sorted(str(p) for p in (folder / "val").rglob("*.png"))[:3]
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(out / "best"), *imgs, "--topk", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res) == 3 and len(res[0]["top"]) == 3
    assert abs(sum(t["prob"] for t in res[0]["top"])) <= 1.0 + 1e-6
    assert res[0]["top"][0]["prob"] >= res[0]["top"][1]["prob"]


def test_output_folder_of_another_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--output", str(out)]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--epochs", "1", "--output", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # by default the tutorials train on real folders end to end (tests/test_docs.py) and
# test_data.py checks the recipe choice; this one adds the CIFAR-10 recipe compiled: ~40 s
def test_folder_dataset_end_to_end_chooses_a_recipe(tmp_path, capsys):
    z = cifar_slice(tmp_path, per_class=8)
    root = str(z) if z else str(write_digits_folder(tmp_path / "f", per_class=8, size=32, mode="RGB"))
    out = tmp_path / "run"
    assert main(["train", "--dataset", "folder", "--data-dir", root, "--epochs", "1", "-b", "16",
                 "--cache-dir", str(tmp_path / "c"), "--output", str(out), "--depth", "2", "--embed-dim", "64",
                 "--num-heads", "2"]) == 0
    text = capsys.readouterr().out
    assert "recipe for this folder: configs/cifar10.yaml" in text
    assert main(["eval", "--checkpoint", str(out / "last")]) == 0


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("stop_at", [5, 22])  # mid-epoch, and just after an epoch boundary (22 steps/epoch)
def test_resume_is_exact(tmp_path, stop_at):
    kw = dict(epochs=4, model_ema=True, smoothing=0.1, crop_padding=1, mixup=0.2,
              model_args={"drop_path_rate": 0.1})
    ref = Trainer(_cfg(**kw, output=str(tmp_path / "a")), log=_quiet, progress=False)
    ref.fit()
    t1 = Trainer(_cfg(**kw, output=str(tmp_path / "b")), log=_quiet, progress=False)
    step = t1.optimizer.step
    calls = []

    def counting_step(*a, **k):
        calls.append(1)
        out = step(*a, **k)
        if len(calls) == stop_at:
            t1.request_stop()
        return out

    t1.optimizer.step = counting_step
    r1 = t1.fit()
    assert r1.stopped_early and r1.steps == stop_at
    t2 = Trainer(_cfg(**kw, output=str(tmp_path / "b"), resume=str(tmp_path / "b")), log=_quiet, progress=False)
    t2.fit()
    a, b = _weights(ref), _weights(t2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(ref.ema.state_dict().values(), t2.ema.state_dict().values()))
    # and the log says so: the stopped epoch's train_loss is the mean over all its batches, not those after the stop

    def history(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: r[k] for k in ("epoch", "step", "train_loss", "val_loss", "val_top1")} for r in rows]

    assert history("b") == history("a")


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    t = Trainer(_cfg(epochs=1, output=str(tmp_path)), log=_quiet, progress=False)
    t.fit()
    good = (tmp_path / "last" / "model.safetensors").read_bytes()
    import vitkit.model.serialization as hub

    def crash(*a, **k):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(hub, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, "last", t.model, t.preprocessing, t._train_state())
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == good
    # killed between the two renames: last/ is gone, the previous one is recovered
    (tmp_path / "last").rename(tmp_path / ".last.old")
    assert recover_checkpoint(tmp_path, "last") == tmp_path / "last"
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == good
    monkeypatch.undo()
    Trainer(_cfg(epochs=2, output=str(tmp_path), resume=str(tmp_path)), log=_quiet, progress=False).fit()


def test_nan_loss_stops_keeps_checkpoints_and_writes_diverged_state(tmp_path):
    t = Trainer(_cfg(epochs=2, output=str(tmp_path)), log=_quiet, progress=False)
    t.fit()
    last = (tmp_path / "last" / "model.safetensors").read_bytes()
    best = (tmp_path / "best" / "model.safetensors").read_bytes()
    t2 = Trainer(_cfg(epochs=4, output=str(tmp_path), resume=str(tmp_path)), log=_quiet, progress=False)
    fwd = t2.model.forward
    t2.train_model.forward = lambda x: fwd(x) * float("nan")
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        t2.fit()
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == last
    assert (tmp_path / "best" / "model.safetensors").read_bytes() == best
    assert (tmp_path / "diverged" / "train_state.pt").is_file()


def test_resume_with_a_different_model_names_the_key_and_shapes(tmp_path):
    Trainer(_cfg(epochs=1, output=str(tmp_path)), log=_quiet, progress=False).fit()
    with pytest.raises(ValueError, match=r"has shape .* the model expects"):
        Trainer(_cfg(epochs=2, resume=str(tmp_path), model_args={"embed_dim": 32, "num_heads": 4}),
                log=_quiet, progress=False)


class _Clock:
    """Virtual time for the trainer: each optimizer step costs ``step_s`` (``slow_s`` once ``slow_after`` seconds have
    passed) and each evaluation ``eval_s``, whatever else the test machine is doing. A CI run under load cut the real
    clock's schedule short; this checks the plan itself."""

    def __init__(self, step_s, eval_s, slow_after=math.inf, slow_s=None):
        self.now, self.step_s, self.eval_s, self.slow_after, self.slow_s = 1000.0, step_s, eval_s, slow_after, slow_s

    def time(self):
        return self.now

    def install(self, monkeypatch, trainer):
        opt_step, evaluate = trainer._optimizer_step, trainer.objective.evaluate

        def step():
            slow = self.now - 1000.0 >= self.slow_after
            self.now += self.slow_s if slow else self.step_s
            opt_step()

        def ev(module, split, *a, **k):  # (the whole validation split: eval_s; a slice of it, its share)
            self.now += self.eval_s * len(split) / len(trainer.data.val)
            return evaluate(module, split, *a, **k)
        monkeypatch.setattr(trainer, "_optimizer_step", step)
        monkeypatch.setattr(trainer.objective, "evaluate", ev)


@pytest.mark.parametrize("slowdown", [False, True])
def test_time_limit_plans_the_schedule_to_end_at_the_budget(tmp_path, monkeypatch, slowdown):
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module
    # 0.25 minutes: 11.85 s usable; digits at batch 64 is 23 steps an epoch, 0.1 s each: ~4 epochs fit, not 10,000.
    # The slowdown doubles the step time a third of the way in: the re-plans must still end the cosine by the budget.
    clock = _Clock(step_s=0.1, eval_s=0.3, slow_after=4.0 if slowdown else math.inf, slow_s=0.2)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)  # the planner counts the budget from the trainer's clock too
    t = Trainer(_cfg(epochs=10_000, time_limit=0.25, output=str(tmp_path), min_lr=1e-6), log=_quiet, progress=False)
    clock.install(monkeypatch, t)
    r = t.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= r.epochs < 10 and not r.stopped_early
    assert rows[-1]["lr"] < 1e-4  # the cosine reached its end instead of being cut near its top
    assert r.elapsed_s <= 0.25 * 60 + 0.2 + 0.3 + 1  # within the budget, give or take the last step and evaluation


@pytest.mark.usefixtures("bf16_keeps_up")
def test_a_short_budget_whose_settings_were_decided_while_training_plans_from_the_tuning_pace(tmp_path, monkeypatch):
    """A 1-minute CIFAR-10 run beside two other processes (AVX512-BF16 EPYC, d1b7467): 19 s to load and plan, 17
    tuning steps of ~0.75 s, then 15 more before the budget's first plan, which found 9 s left for a 17-s evaluation
    of the 10,000 validation images: 68.5 s of 60. Replayed here: the first plan is made when the tuning ends, from the
    pace it timed the chosen settings at, and the run ends within the budget."""
    import vitkit.training.budget as budget_module
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module
    from vitkit.training import tune as tune_mod

    monkeypatch.setenv("VITKIT_CACHE_DIR", str(tmp_path / "cache"))  # (an empty cache: the settings are tuned)
    clock = _Clock(step_s=0.75, eval_s=17.0)
    clock.perf_counter = clock.time
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)
    monkeypatch.setattr(budget_module, "time", clock)
    monkeypatch.setattr(tune_mod.StepTuner, "record", lambda self, s, real=tune_mod.StepTuner.record: real(
        self, 0.75 if self._next and self._next["precision"] == "bf16" else 1.5))
    said: list[str] = []
    t = Trainer(_cfg(epochs=10_000, time_limit=1.0, output=str(tmp_path / "run"), precision="auto",
                     attention="auto", channels_last="auto", compile=False), log=said.append, progress=False)
    assert t.tuner is not None, (t.plan.notes, said)  # (decided while training)
    clock.install(monkeypatch, t)
    clock.now += 19.0  # the data's decode and the planning, spent before the first step
    r = t.fit()
    tuned = json.loads((tmp_path / "run" / "plan.json").read_text())["tuned"]["steps"]
    assert tuned >= 8, said
    assert r.elapsed_s <= 60 * 1.03, said  # (68.5 s before: the first plan came 15 steps after the tuning)
    assert r.steps > tuned  # the steps the budget holds after the tuning and before the final evaluation


@pytest.mark.parametrize("eval_every", [1, 4])
def test_time_limit_plan_counts_one_evaluation_per_planned_evaluated_epoch(eval_every):
    spe = 7
    budget = TimeBudget(1.0, spe, eval_every, planned_steps=10_000 * spe, planned_warmup=5 * spe,
                        images_per_step=64, val_images=360)
    n, warmup = budget.plan(step=0, elapsed=0.0, sec_per_step=0.01, eval_s=1.0)  # budget 60 * 0.99 - 2 = 57.4 s
    # training + an evaluation per eval_every epochs + the final one
    cost = n * 0.01 + math.ceil(n / (eval_every * spe)) * 1.0 + 1.0
    assert 54.0 < cost <= 57.4 + 1.0  # fills the budget (within one evaluation: the plan counts epochs fractionally)
    assert n > 10 * spe  # a short budget is not swallowed by evaluations of the 10,000 recipe epochs
    assert warmup == int(5 * spe * n / (10_000 * spe))  # the warmup shrinks with the schedule
    assert budget.plan(step=50, elapsed=100.0, sec_per_step=0.01, eval_s=1.0)[0] == 50  # over budget: stop here


def test_time_budget_measures_from_step_5_plans_at_15_and_guesses_the_evaluation():
    budget = TimeBudget(10.0, 100, 1, planned_steps=10_000, planned_warmup=10, images_per_step=64, val_images=640)
    assert budget.after_step(4, 10.0) is None and budget.after_step(5, 30.0) is None  # compiling until step 5
    assert budget.after_step(6, 30.05) is None
    total, _, next_check = budget.after_step(15, 30.5)  # 0.05 s a step = 1280 img/s; evaluation at 3x: 640/3840 s
    assert budget.sec_per_step == pytest.approx(0.05)
    assert budget.eval_guess == pytest.approx(640 / (3 * 64 / 0.05))
    assert total == budget.plan(15, 30.5, 0.05, budget.eval_guess)[0]
    assert next_check == 15 + round(10 * 60 * 0.02 / 0.05)  # the next re-plan a fiftieth of the budget later
    assert budget.after_step(16, 30.55) is None
    budget.evaluated(9.0)  # the first evaluation compiled too: it counts as the guess, not 9 s
    assert budget.eval_s == pytest.approx(640 / (3 * 64 / 0.05))
    budget.evaluated(0.5)
    total, _, _ = budget.after_step(next_check, 30.5 + (next_check - 15) * 0.1)  # twice as slow since
    assert budget.sec_per_step == pytest.approx(0.1) and budget.eval_guess == pytest.approx(1.0)  # and so is eval
    warming = TimeBudget(10.0, 100, 1, planned_steps=10_000, planned_warmup=500, images_per_step=64,
                         val_images=640)
    warming.after_step(5, 30.0)
    total, warmup, next_check = warming.after_step(15, 30.5)
    assert warmup == int(500 * total / 10_000) > 15 and next_check == 20  # a warmup under way: re-planned every 5


def test_time_limit_spaces_evaluations_that_would_take_more_than_a_twentieth_of_the_training():
    """By hand: 39 steps of 0.44 s an epoch (17.16 s), an evaluation of 10 s: every 3rd epoch would add 19% to the
    training time; 5% of it allows one per ceil(10 / (0.05 x 17.16)) = 12 epochs. A cheap evaluation keeps the
    recipe's gap."""
    budget = TimeBudget(30.0, 39, 3, planned_steps=100 * 39, planned_warmup=39, images_per_step=128,
                        val_images=10_000)
    assert budget.spaced_eval_every(3) == 3  # nothing measured yet
    budget.sec_per_step, budget.eval_s, budget.eval_pace = 0.44, 10.0, 0.44
    assert budget.spaced_eval_every(3) == 12
    budget.eval_s = 0.5  # 0.5 / (0.05 x 17.16) = 0.58: the recipe's every 3rd stays
    assert budget.spaced_eval_every(3) == 3


def test_a_time_limited_run_evaluates_less_often_when_evaluating_is_dear_and_says_so(tmp_path, monkeypatch):
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module
    # digits at batch 64: 22 steps of 0.1 s an epoch (2.2 s); an evaluation of 1 s is 45% of an epoch, so 5% of the
    # training allows one per ceil(1 / (0.05 x 2.2)) = 10 epochs
    clock = _Clock(step_s=0.1, eval_s=1.0)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)
    said: list[str] = []
    t = Trainer(_cfg(epochs=10_000, time_limit=1.0, eval_every=1, output=str(tmp_path)), log=said.append,
                progress=False)
    clock.install(monkeypatch, t)
    r = t.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row["epoch"] for row in rows if "val_top1" in row]
    assert evaluated[0] == 1 and evaluated[-1] == r.epochs  # the first (it measures) and the last
    gaps = [b - a for a, b in zip(evaluated, evaluated[1:-1])]
    # (the budget's first plan timed a slice of the evaluation, so the spacing is right from the first one: it had
    # guessed 360 images at 3x the training pace, 0.19 s, and evaluated again 2 epochs later to learn its cost)
    assert t.steps_per_epoch == 22 and len(gaps) >= 2 and all(g == 10 for g in gaps), evaluated
    assert any("evaluating every 10 epochs from here" in line and "the last epoch is always evaluated" in line
               for line in said)
    assert r.epochs >= 22  # 57.4 usable seconds: ~24 epochs of 2.2 s; evaluated every epoch, 3.2 s each: ~18


def test_eval_every_skips_evaluations_but_always_evaluates_the_last_epoch(tmp_path):
    r = Trainer(_cfg(epochs=5, eval_every=2, output=str(tmp_path)), log=_quiet, progress=False).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4, 5]
    assert ["val_top1" in row for row in rows] == [False, True, False, True, True]
    assert all("train_loss" in row and "lr" in row for row in rows)
    assert r.val_top1 == pytest.approx(rows[-1]["val_top1"], abs=1e-3) and r.val_top1 > 50
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "best" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="eval_every must be at least 1"):
        _cfg(eval_every=0)


def test_a_schedule_that_has_ended_is_not_replanned(tmp_path):
    t = Trainer(_cfg(epochs=2, time_limit=1.0), log=_quiet, progress=False)
    calls = []
    replan = t.budget.after_epoch_end
    t.budget.after_epoch_end = lambda *a: (calls.append(t.step), replan(*a))[1]
    r = t.fit()
    assert calls == [t.steps_per_epoch]  # after epoch 1 only: epoch 2 ended the cosine, so the run ends there
    assert r.epochs == 2 and t.step == 2 * t.steps_per_epoch


@pytest.mark.parametrize("change", [2.0, 0.4])
def test_the_budget_holds_when_the_machine_slows_down_or_speeds_up_mid_epoch(tmp_path, monkeypatch, change):
    """A 3-minute budget with epochs of ~66 s (digits at 3 s a step): a minute in, another process starts beside
    the run (each step takes twice as long) or stops (0.4 times as long). Re-planned once an epoch, runs ended 16%
    over the budget or far short of it; re-planned every few seconds, they end within 5% of it and use 90% of it."""
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module

    clock = _Clock(step_s=3.0, eval_s=2.0, slow_after=60.0, slow_s=3.0 * change)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)
    t = Trainer(_cfg(epochs=10_000, time_limit=3.0, output=str(tmp_path), min_lr=1e-6), log=_quiet, progress=False)
    clock.install(monkeypatch, t)
    r = t.fit()
    assert 0.90 * 180 <= r.elapsed_s <= 1.05 * 180, r.elapsed_s
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["lr"] < 1e-4 and "val_top1" in rows[-1]  # the cosine ended, and the last row was evaluated


class _SlowStartClock(_Clock):
    """A compiled GPU run's start: its first steps (to ``slow_until``) take ``slow_s``, then ``step_s`` each."""

    def __init__(self, step_s, eval_s, slow_s, slow_until):
        super().__init__(step_s, eval_s)
        self.first_s, self.slow_until, self.steps = slow_s, slow_until, 0

    def install(self, monkeypatch, trainer):
        super().install(monkeypatch, trainer)
        steady = trainer._optimizer_step

        def step():
            self.steps += 1
            if self.steps <= self.slow_until:
                self.now += self.first_s - self.step_s
            steady()
        monkeypatch.setattr(trainer, "_optimizer_step", step)


def test_a_slow_start_does_not_cut_the_warmup_for_good(tmp_path, monkeypatch):
    """An H200's compiled Fashion-MNIST run took its steps 5-13 at 2.3x its steady pace; the first plan, made from
    them, cut the warmup from 52 steps to 24 for good. By hand here: digits at batch 64, 22 steps an epoch of 0.5 s
    (1.25 s to step 14), 57.4 usable seconds: the first plan (step 15, 18.75 s in) affords ~32 more steps of its
    1.2 s, ~47 of the recipe's 110 (5 epochs) and 9 of its 22 of warmup; the steady pace affords ~90, and 18."""
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module
    clock = _SlowStartClock(step_s=0.5, eval_s=0.1, slow_s=1.25, slow_until=14)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)
    t = Trainer(_cfg(epochs=5, warmup_epochs=1, time_limit=1.0, output=str(tmp_path), min_lr=1e-6), log=_quiet,
                progress=False)
    clock.install(monkeypatch, t)
    assert t.steps_per_epoch == 22 and t.warmup_steps == 22
    r = t.fit()
    assert 16 <= t.warmup_steps <= 22, t.warmup_steps  # the steady pace's plan, not the slow steps' 9
    assert 80 <= r.steps <= 95, r.steps
    # resumed, the run keeps its plan's warmup: back at the recipe's 22, a run resumed at step 20 of a warmup of 18
    # would have warmed up again from 21/22 of its learning rate down
    shortened = t.warmup_steps
    state = torch.load(tmp_path / "last" / "train_state.pt", weights_only=True)
    state["warmup_steps"] = shortened - 2
    torch.save(state, tmp_path / "last" / "train_state.pt")
    again = Trainer(_cfg(epochs=5, warmup_epochs=1, time_limit=1.0, output=str(tmp_path), resume=str(tmp_path),
                         min_lr=1e-6), log=_quiet, progress=False)
    assert again.warmup_steps == shortened - 2 and again.planned_warmup == 22


@pytest.mark.parametrize("save_s, written", [(0.01, "every epoch"), (1.0, "first, after 50 s, and last")])
def test_last_is_written_as_often_as_a_fiftieth_of_the_training_allows(tmp_path, monkeypatch, save_s, written):
    """last/ at an epoch's end once the training since the last write took 50 times that write (an H200's 0.27-s
    Fashion-MNIST epochs spent 40% of their time writing it every epoch), and always at the run's end. By hand: 11
    steps of 1 s (11 s) an epoch at batch 128. A write of 0.01 s: every epoch (3). A write of 1 s, 8 epochs: the
    first epoch's (ended at 11 + 1 = 12 s), then once 50 s passed since (epoch 6's end: 6 x 11 + 1 = 67 >= 62), then
    epoch 8's."""
    import vitkit.training.plan as plan_module
    import vitkit.training.trainer as trainer_module
    clock = _Clock(step_s=1.0, eval_s=0.0)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(plan_module, "time", clock)
    written_at, epochs = [], 3 if save_s < 0.1 else 8

    def slow_save(out, name, *a, **k):
        if name == "last":
            clock.now += save_s
            written_at.append(t.epoch)
        return save_checkpoint(out, name, *a, **k)
    monkeypatch.setattr(trainer_module, "save_checkpoint", slow_save)
    t = Trainer(_cfg(epochs=epochs, batch_size=128, output=str(tmp_path), eval_every=100), log=_quiet,
                progress=False)
    clock.install(monkeypatch, t)
    r = t.fit()
    assert r.epochs == epochs and t.steps_per_epoch == 11
    assert written_at == ([1, 2, 3] if save_s < 0.1 else [1, 6, 8]), written_at
    state = torch.load(tmp_path / "last" / "train_state.pt", weights_only=True)
    assert state["step"] == epochs * t.steps_per_epoch  # the run's end, whatever the gap


def test_a_run_that_ends_after_a_skipped_write_writes_last_and_does_not_say_it_stopped(tmp_path, monkeypatch):
    """An epoch end that skipped last/ (a time-limit re-plan can end the schedule there): the run's end writes it,
    and says nothing of a stop (the stop's line was said at every such end)."""
    said: list[str] = []
    t = Trainer(_cfg(epochs=3, output=str(tmp_path)), log=said.append, progress=False)
    monkeypatch.setattr(t, "_last_due", lambda: t.saved[0] == 0)  # the first epoch's write only
    r = t.fit()
    state = torch.load(tmp_path / "last" / "train_state.pt", weights_only=True)
    assert r.epochs == 3 and state["step"] == 3 * t.steps_per_epoch
    assert not any("stopped" in line for line in said), said


def test_run_log_writes_config_metrics_tensorboard_and_curves(tmp_path):
    log = RunLog(tmp_path / "run")
    log.open({"epochs": 2})
    log.epoch({"epoch": 1, "step": 10, "train_loss": 1.5, "lr": 1e-3})
    log.epoch({"epoch": 2, "step": 20, "train_loss": 1.0, "lr": 1e-4, "val_loss": 0.9, "val_top1": 70.0})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["val_top1"] == 70.0
    assert (tmp_path / "run" / "config.yaml").read_text() == "epochs: 2\n"
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000 and any((tmp_path / "run" / "tb").iterdir())
    quiet = RunLog(tmp_path / "other", enabled=False)  # a rank other than 0 writes nothing
    quiet.open({}), quiet.epoch({"epoch": 1, "step": 1, "train_loss": 1.0}), quiet.close()
    assert not (tmp_path / "other").exists()


def test_yaml_config_and_flags_layer_over_the_recipe(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 1\nlr: 0.0005\nmodel_args: {depth: 2}\n")
    assert main(["train", "--config", str(cfg), "--lr", "0.0007", "--output", str(tmp_path / "r")]) == 0
    import yaml

    resolved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert resolved["lr"] == 0.0007 and resolved["epochs"] == 1 and resolved["model_args"]["depth"] == 2
    assert resolved["model_args"]["embed_dim"] == 64  # from the digits recipe
    bad = tmp_path / "bad.yaml"
    bad.write_text("epoch: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown key(s) ['epoch']" in capsys.readouterr().err


def test_a_muon_stem_or_embed_that_cannot_apply_is_said_in_the_log():
    lines: list[str] = []  # fp32 recipe (muon_stem) + the user's --opt adamw: the stem cannot be under Muon
    Trainer(_cfg(epochs=1, opt="adamw", muon_stem=True, muon_embed=True), log=lines.append, progress=False).fit()
    assert "muon_stem has no effect with --opt adamw: it puts the stem's filters under Muon" in lines
    assert "muon_embed has no effect with --opt adamw: it puts the patch embedding under Muon" in lines


def test_a_tier_replaces_the_model_when_the_budget_buys_few_epochs_and_resume_keeps_it(tmp_path):
    tier = {"model_args": {"depth": 1}, "lr": 0.002, "hflip": True}
    lines: list[str] = []
    t = Trainer(_cfg(time_limit=1.0, tiers=[{"below": 1e9, **tier}], output=str(tmp_path / "few")),
                log=lines.append, progress=False)
    assert t.model.config.depth == 1 and t.cfg.lr == 0.002 and t.augment.hflip and t.cfg.tiers is None
    params = {id(p) for p in t.model.parameters()}
    assert params == {id(p) for g in t.optimizer.param_groups for p in g["params"]}  # the tier's model, all of it
    t.fit()
    note = next(line for line in lines if "tier below" in line)
    assert "a 1-minute budget buys ~" in note and "tier below 1e+09: lr 0.001 -> 0.002, hflip False -> True, " \
        "depth 4 -> 1" in note
    saved = (tmp_path / "few" / "config.yaml").read_text()  # a resume trains what was decided, not decides again
    assert "tiers: null" in saved and "depth: 1" in saved
    plan = json.loads((tmp_path / "few" / "plan.json").read_text())
    assert plan["tier"]["below"] == 1e9 and plan["epochs_affordable"] > 0
    t = Trainer(_cfg(time_limit=1.0, tiers=[{"below": 1e-9, **tier}]), log=_quiet, progress=False)
    assert t.model.config.depth == 4 and t.cfg.lr == 1e-3  # vit_nano_patch2_8 as it is
    assert any("the recipe as it is" in n for n in t.plan.notes)
    # no budget, no tier
    assert Trainer(_cfg(tiers=[{"below": 1e9, **tier}]), log=_quiet, progress=False).model.config.depth != 1


def test_a_tier_model_that_cannot_be_built_is_named_as_the_tiers():
    with pytest.raises(ValueError, match=r"ViTConfig.depth must be positive, got -2"):
        Trainer(_cfg(time_limit=1.0, tiers=[{"below": 1e9, "model_args": {"depth": -2}}]), log=_quiet,
                progress=False)


def test_the_trainer_trains_and_evaluates_in_the_planned_precision(tmp_path, monkeypatch):
    from vitkit.training import trainer as trainer_mod

    used = []
    real_autocast = trainer_mod.autocast_for
    monkeypatch.setattr(trainer_mod, "autocast_for", lambda d, p: (used.append(p), real_autocast(d, p))[1])
    t = Trainer(_cfg(epochs=1, batch_size=256, precision="bf16", output=str(tmp_path / "run")), log=_quiet,
                progress=False)
    t.fit()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["precision"] == "bf16"
    assert t.precision == "bf16" and set(used) == {"bf16"}  # every training step


@pytest.mark.slow  # by default the training tutorial stops a run by signal and resumes it (tests/test_docs.py)
def test_sigterm_saves_last_and_resume_auto_continues(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vitkit", "train", "--epochs", "30", "--output", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 120
    while not (out / "last").exists() and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signal.SIGTERM, text
    assert "saving last/" in text
    state = torch.load(out / "last" / "train_state.pt", weights_only=True)
    r = subprocess.run(cmd + ["--resume", "auto"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {out / 'last'}: epoch {state['epoch']}" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("final: val_top1=")


def test_finetune_from_weights_at_a_new_resolution_with_sgd_and_a_lower_body_lr(tmp_path):
    import vitkit

    src = vitkit.create_model("vit_nano_patch2_8", img_size=8, patch_size=2, in_chans=1, num_classes=5)
    src.save_pretrained(tmp_path / "pre")
    out = tmp_path / "ft"
    assert main(["train", "--init", str(tmp_path / "pre"), "--img-size", "16", "--epochs", "1", "--opt", "sgd",
                 "--lr", "0.01", "--body-lr-scale", "0.1", "--output", str(out)]) == 0
    ft = vitkit.from_pretrained(out / "last")
    assert ft.config.img_size == 16 and ft.config.num_classes == 10  # digits' classes: a new head
    assert ft.pos_embed.shape == (1, 1 + 64, 64)
    state = torch.load(out / "last" / "train_state.pt", weights_only=True)
    scales = sorted({g["lr_scale"] for g in state["optimizer"]["param_groups"]})
    assert scales == [0.1, 1.0]


@pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor needs a C++ compiler on CPU")
def test_compiled_training_step_gives_the_eager_loss_and_gradients():
    # the trainer's torch.compile must compute the same step as plain PyTorch
    import copy

    from vitkit import ViTConfig, VisionTransformer
    from vitkit.runtime.compile import compile_for_training

    torch.manual_seed(0)
    eager = VisionTransformer(ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=1,
                                        num_heads=2, hybrid="conv:4"))
    model = copy.deepcopy(eager)
    compiled = compile_for_training(model, torch.device("cpu"))
    assert compiled is not model
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 1])
    losses = []
    for m in (eager, compiled):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_the_time_limit_clock_starts_with_the_vitkit_process():
    # `vitkit train --time-limit` counts the seconds Python and torch take to start; this process's own start is
    # the reference: the time read first thing in a fresh interpreter
    code = ("import time; t0 = time.time(); from vitkit.cli.main import process_start_time; "
            "print(t0 - process_start_time())")
    lag = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.0 <= lag < 1.0  # the interpreter's own start-up (site, encodings) before the first line, not torch's


def test_the_time_limit_clock_starts_with_python_when_a_shell_execs_into_vitkit():
    # /proc's start time is the fork: `bash -c '...; exec vitkit ...'` keeps the shell's, 3 s before Python started
    code = ("import time; t0 = time.time(); from vitkit.cli.main import process_start_time; "
            "print(t0 - process_start_time())")
    shell = f"sleep 3; exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    lag = float(subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True).stdout)
    assert -1.0 < lag < 1.0, lag  # the old clock: lag ≈ 3 s


def test_time_limit_with_grad_accum_probes_each_step_once():
    # with --grad-accum 2 the step count stays at 5 for two micro-batches; probing both divided by zero
    r = Trainer(_cfg(epochs=10_000, time_limit=0.1, grad_accum=2, batch_size=16), log=_quiet, progress=False).fit()
    assert 1 <= r.epochs < 10_000 and not r.stopped_early


def test_small_grayscale_folders_are_not_flipped_unless_asked(tmp_path, capsys):
    import yaml

    root = str(write_digits_folder(tmp_path / "f", per_class=8, size=28))  # fashion-mnist recipe: hflip true
    for extra, flips in (([], False), (["--hflip"], True)):
        out = tmp_path / f"run{len(extra)}"
        assert main(["train", "--dataset", "folder", "--data-dir", root, "--epochs", "1", "-b", "16", "--depth", "1",
                     "--no-compile", "--output", str(out), "--cache-dir", str(tmp_path / "c"), *extra]) == 0
        text = capsys.readouterr().out
        assert "configs/fashion-mnist.yaml" in text
        assert yaml.safe_load((out / "config.yaml").read_text())["hflip"] is flips
        assert ("no horizontal flips" in text) is not flips


def test_muon_updates_the_blocks_matrices_as_torch_muon_and_the_rest_as_adamw():
    import copy

    import vitkit
    from vitkit.training.optim import build_optimizer

    torch.manual_seed(0)
    model = vitkit.create_model("vit_micro_patch4_32", img_size=28, patch_size=7, in_chans=1, num_classes=10,
                                depth=2, hybrid="conv:8")
    ref = copy.deepcopy(model)
    cfg = TrainConfig(opt="muon", lr=0.01, weight_decay=0.05)
    opt = build_optimizer(model, cfg)
    opt.muon.ns_dtype = torch.bfloat16  # torch.optim.Muon's; a CPU without native bf16 iterates in fp32 (next test)
    hidden = [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    assert sorted(hidden) == sorted(f"blocks.{i}.{w}.weight" for i in range(2)
                                    for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    # the references: torch's own Muon on the block matrices, torch's AdamW on the rest, with the same groups
    named = dict(ref.named_parameters())
    ref_muon = torch.optim.Muon([named[n] for n in hidden], lr=0.01, weight_decay=0.05,
                                adjust_lr_fn="match_rms_adamw")
    no_decay = {n for n, p in named.items() if p.ndim <= 1} | {"pos_embed", "cls_token"}
    ref_adamw = torch.optim.AdamW(
        [{"params": [p for n, p in named.items() if n not in hidden and n not in no_decay], "weight_decay": 0.05},
         {"params": [named[n] for n in named if n in no_decay], "weight_decay": 0.0}], lr=0.01, fused=True)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    for m, step in ((model, opt.step), (ref, lambda: (ref_muon.step(), ref_adamw.step()))):
        for _ in range(2):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            step()
            for p in m.parameters():
                p.grad = None
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=lambda s: f"{name}: {s}")
    state = opt.state_dict()  # resumable: the state of both goes into train_state.pt
    again = build_optimizer(model, cfg)
    again.load_state_dict(state)
    assert again.muon.state_dict()["state"].keys() == state["muon"]["state"].keys()
    with pytest.raises(ValueError, match="trained with another --opt"):
        again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    with pytest.raises(ValueError, match=r"Muon trained 8 weight matrices in the saved run, 9 here .*--muon-stem"):
        build_optimizer(model, TrainConfig(opt="muon", muon_stem=True)).load_state_dict(state)


@pytest.mark.parametrize("key", ["muon_stem", "muon_embed"])
def test_muon_stem_and_embed_update_each_filter_bank_as_torch_muon_updates_its_out_by_in_k_k_matrix(key):
    import vitkit
    from vitkit.training.optim import build_optimizer

    torch.manual_seed(0)
    model = vitkit.create_model("vit_micro_patch4_32", img_size=28, patch_size=7, in_chans=1, num_classes=10,
                                depth=1, hybrid="conv:8,8")
    opt = build_optimizer(model, TrainConfig(opt="muon", lr=0.01, weight_decay=0.05, **{key: True}))
    opt.muon.ns_dtype = torch.bfloat16  # torch.optim.Muon's
    under_muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    conv = model.patch_embed.backbone[3].weight  # the second conv: (8, 8, 3, 3)
    embed = model.patch_embed.proj.weight  # E of Eq. 1 over 7x7 patches of the stem's 8 channels: (128, 8, 7, 7)
    filters, other = (conv, embed) if key == "muon_stem" else (embed, conv)
    assert id(filters) in under_muon and id(other) not in under_muon
    shape = (len(filters), filters[0].numel())
    matrix = torch.nn.Parameter(filters.detach().reshape(shape).clone())
    ref = torch.optim.Muon([matrix], lr=0.01, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
        matrix.grad = filters.grad.reshape(shape).clone()
        opt.step()
        ref.step()
        opt.zero_grad()
    torch.testing.assert_close(filters.detach().reshape(shape), matrix.detach())


@pytest.mark.parametrize("shape", [(3, 64, 160), (2, 160, 64), (1, 32, 32)])
def test_newton_schulz_gives_the_svd_directions_with_singular_values_in_muons_band(shape):
    from vitkit.training.optim import newton_schulz

    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)  # the reference: LAPACK's SVD, G = U S Vᵀ
    core = U.mT @ newton_schulz(G, dtype=torch.float32).double() @ Vh.mT  # ≈ diag(S'), S' near 1 (Jordan et al.)
    s = core.diagonal(dim1=-2, dim2=-1)
    assert s.min() > 0.6 and s.max() < 1.3
    torch.testing.assert_close(core, torch.diag_embed(s), atol=1e-5, rtol=0)


def test_muon_iterates_in_the_runs_own_precision():
    """torch.optim.Muon always casts to bf16, which a CPU without a bf16 unit emulates (20x slower than fp32 with
    AVX2 only): vitkit's iterates in fp32 unless the run itself trains in bf16 (the planner timed it faster)."""
    from vitkit.training import optim

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(48, 16)) for _ in range(3)]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    start = [w.detach().clone() for w in weights]
    for w, c in zip(weights, copies):
        w.grad = c.grad = torch.randn(48, 16)
    optim.Muon(weights, lr=0.01).step()
    optim.Muon(copies, lr=0.01, ns_dtype=torch.float32).step()
    for w, c, w0 in zip(weights, copies, start):
        torch.testing.assert_close(w, c, rtol=0, atol=0)
        assert (w - w0).abs().max() > 1e-3  # it did step
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1, num_classes=3)
    for precision, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        opt = optim.build_optimizer(model, TrainConfig(opt="muon", precision=precision))
        assert opt.muon.ns_dtype == want


def test_muon_trains_digits_from_the_cli(tmp_path, capsys):
    assert main(["train", "--opt", "muon", "--epochs", "3", "--output", str(tmp_path / "run")]) == 0
    top1 = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["val_top1"]
    assert top1 > 30  # 10 classes: chance is 10%


def test_the_benchmarks_loops_run_the_steps_asked_for_across_epoch_ends():
    from vitkit.bench.training import plain_loop_steps, vitkit_train_steps
    from vitkit.data.datasets import load_dataset
    from vitkit.training.build import build_model

    data = load_dataset("digits")
    run = vitkit_train_steps(_cfg(compile=False), data, steps=15, warmup=2)
    t = run.trainer
    assert t.steps_per_epoch < 30  # so three calls of 15 steps cross an epoch's end
    for _ in range(3):
        run()
    assert (t.step, t.epoch) == (2 + 45, 2)
    model = build_model(_cfg(), data)
    before = [p.detach().clone() for p in model.parameters()]
    loop = plain_loop_steps(model, data, 64, steps=30, pil=True)  # the PIL DataLoader's epoch ends inside
    loop()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.requires_grad)


def test_the_streamed_estimate_is_clocked_after_the_passs_first_batch_and_counts_the_waits_after_it(monkeypatch):
    """Each timed call of ``--estimate`` is a new pass over the loader, whose first batch waits for a worker to
    decode a whole batch; a run reads one pass an epoch. On the H200 that wait (2.2 s a call) was the whole gap
    between ViT-B/16's streamed rate and its workers'. Here a pass's first batch waits 0.6 s and every batch 0.03 s:
    the window holds the steps' waits (4 x 0.03 s) and not the first."""
    import vitkit.training.trainer as trainer_mod
    from vitkit.bench.training import vitkit_train_steps
    from vitkit.data.datasets import load_dataset

    real = trainer_mod.batches

    def slow(*a, **kw):
        for i, b in enumerate(real(*a, **kw)):
            time.sleep(0.6 if i == 0 else 0.03)
            yield b
    monkeypatch.setattr(trainer_mod, "batches", slow)
    run = vitkit_train_steps(_cfg(compile=False), load_dataset("digits"), steps=4, warmup=1, skip=2)
    for _ in range(2):
        start = time.perf_counter()
        run()
        whole = time.perf_counter() - start
        assert whole >= 0.6 + 6 * 0.03  # the call: the first wait, skip + steps + 1 batches
        assert 4 * 0.03 <= run.window < 0.6  # the window: four steps and their waits, not the pass's first


def test_fewer_images_than_one_optimiser_step_is_refused_not_a_loop_for_ever(tmp_path, capsys):
    """--init on 5% of a small folder: the fine-tune recipe's accumulation (5 x 32, fitted to the whole folder) never
    made one optimiser step on the 67 images trained, and the run looped through thousands of empty epochs."""
    assert main(["train", "--train-fraction", "0.01", "--epochs", "2", "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "fewer than one global batch" in err
    assert main(["train", "--train-fraction", "0.2", "--batch-size", "32", "--grad-accum", "16", "--epochs", "1",
                 "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "fewer than the 16 one optimiser step accumulates" in err and "--batch-size (at most 17)" in err
    # --init fits its accumulation to the images it trains on, the fraction applied
    assert main(["train", "--epochs", "1", "--depth", "1", "--output", str(tmp_path / "init")]) == 0
    root = tmp_path / "digits"
    write_digits_folder(root, per_class=60, size=8)  # 600 images: 2 x 32 accumulated; half of them: 1
    assert main(["train", "--dataset", "folder", "--data-dir", str(root), "--init", str(tmp_path / "init" / "best"),
                 "--train-fraction", "0.5", "--epochs", "1", "--output", str(tmp_path / "ft")]) == 0
    out = capsys.readouterr().out
    assert "batch 32 x 1 accumulated = 32 (not 512): 300 training images" in out, out[-3000:]


def test_a_small_dataset_lives_on_the_gpu_and_a_large_one_stays_in_host_memory(monkeypatch):
    """The decision, with the GPU's free memory faked (the move itself is the cuda test below)."""
    from vitkit.data.datasets import load_dataset
    from vitkit.training.build import resident

    data = load_dataset("digits")  # 1,797 8x8 images: 115 KB
    moved, said = [], []
    monkeypatch.setattr(type(data), "to", lambda self, device: moved.append(device) or self)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 2 * 10**9))
    resident(data, torch.device("cuda", 0), said.append)
    assert moved == [torch.device("cuda", 0)] and "as uint8" in said[0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200_000, 10**6))  # a quarter: 50 KB
    resident(data, torch.device("cuda", 0), said.append)
    assert len(moved) == 1 and resident(data, torch.device("cpu")) is data


@pytest.mark.cuda
def test_training_on_a_gpu_keeps_the_dataset_there(tmp_path):
    t = Trainer(_cfg(epochs=2, output=str(tmp_path), device="cuda"), log=_quiet, progress=False)
    assert t.data.train.images.is_cuda and t.data.val.images.is_cuda
    assert t.fit().val_top1 > 20


def test_a_classifier_that_is_not_learning_is_said_at_a_tenth_of_its_schedule():
    """An H200's CIFAR-10 run (batch 4096, lr 0.0113) stayed at a uniform guess's loss and ended at 36% without a
    word. ln 10 = 2.303 is what a guess of 1/10 for every class scores, by hand, whatever the labels' smoothing."""
    said = []
    Trainer(_cfg(epochs=10, lr=1e-9), log=said.append, progress=False).fit()
    warned = [s for s in said if s.startswith("warning: after")]
    assert len(warned) == 1 and "over 10 classes (ln 10 = 2.30)" in warned[0] and "lr 1e-09 at batch 64" in warned[0]
    said.clear()  # the same run that learns (digits' 3 epochs: 2.29, 2.15, 1.84): nothing said
    Trainer(_cfg(), log=said.append, progress=False).fit()
    assert not [s for s in said if "not learning" in s]


def test_muon_under_fp16_takes_the_scale_and_the_overflow_flag_on_the_device():
    """Issue 80 N12: GradScaler read the inf flag on the host before every Muon step (a wait for a GPU each step).
    MuonAdamW now takes the scale and the flag as tensors, as fused AdamW does: the update of gradients scaled by S
    with grad_scale S is the update of the gradients themselves, and an overflow changes nothing, state included."""
    import copy

    import vitkit
    from vitkit.training.optim import build_optimizer

    torch.manual_seed(0)
    model = vitkit.create_model("vit_micro_patch4_32", img_size=28, patch_size=7, in_chans=1, num_classes=10,
                                depth=2)
    cfg = TrainConfig(opt="muon", lr=0.01, weight_decay=0.05)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    runs = []
    for scale, inf in ((None, None), (1024.0, 0.0), (1024.0, 1.0)):
        m = copy.deepcopy(model)
        opt = build_optimizer(m, cfg)
        for _ in range(2):  # the second step reads the momentum the first left
            for n, p in m.named_parameters():
                p.grad = grads[n] * (scale or 1.0)
                if inf:
                    p.grad[0] = float("inf")
            if scale is not None:
                opt.grad_scale, opt.found_inf = torch.tensor(scale), torch.tensor(inf)
            opt.step()
        runs.append((m, opt))
    (plain, _), (scaled, _), (overflow, opt) = runs
    for (n, a), b, c in zip(plain.named_parameters(), scaled.parameters(), overflow.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(c, dict(model.named_parameters())[n]), n  # skipped: as it was
    assert all(torch.equal(s["momentum_buffer"], torch.zeros_like(s["momentum_buffer"]))
               for s in opt.muon.state.values())
    assert type(opt)._step_supports_amp_scaling


def test_the_ema_averages_weights_and_batchnorm_statistics_by_the_formula(tmp_path):
    """--model-ema on a hybrid (BatchNorm in its CNN): each step's EMA is decay * ema + (1 - decay) * weights, the
    first a copy, worked out here from the weights after every step; its BatchNorm statistics too (they stayed at
    step 0's mean 0 / variance 1, and the EMA weights were evaluated and kept with them)."""
    decay = 0.9
    t = Trainer(_cfg(epochs=1, model_ema=True, model_ema_decay=decay, output=None,
                     model_args={"hybrid": "conv:8,M", "patch_size": 2}), log=_quiet, progress=False)
    seen = []
    update = t.ema.update_parameters

    def record(module):
        update(module)
        seen.append({k: v.detach().clone() for k, v in module.state_dict().items()})

    t.ema.update_parameters = record
    t.train_epoch()
    assert len(seen) == t.step >= 3
    want = dict(seen[0])
    for now in seen[1:]:
        want = {k: (decay * want[k] + (1 - decay) * now[k]) if now[k].is_floating_point() else now[k] for k in now}
    got = t.ema.module.state_dict()
    mean = next(k for k in want if k.endswith("running_mean"))
    assert got[mean].abs().sum() > 0  # (not step 0's zeros)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert int(t.ema.n_averaged) == t.step and t.ema.n_averaged.device.type == "cpu"
