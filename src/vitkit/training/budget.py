"""``--time-limit``: fit the learning-rate schedule into a wall-clock budget, so the cosine ends when time does.

The first plan is made from the speed of steps 5-15 of the run (compiling and warm-up are behind by then), or as
soon as the run's first steps have decided its settings, from the pace they timed the chosen ones at. After
that the run re-plans every few seconds (a fiftieth of the budget, at least a second) from the pace of the steps
since the last re-plan, so a machine that slows down or speeds up mid-epoch moves the end of the schedule with it:
runs re-planned only once an epoch ended 16% over a 3-minute budget when another process started beside them, and
40% short of it when one stopped. The schedule ends mid-epoch when what is left holds only the final evaluation.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

PROBE_STEP = 15  # the first plan is made at this step of the first epoch (from the steps since step 5); the
# re-plans that follow every few seconds correct it, so it need not wait long (it waited for step 30 when it was the
# only plan before the first epoch ended, and a 30-second budget could not hold it)
WARM_STEPS = 5  # the steps a (re)started process takes before its pace is measured: compiling, allocator warm-up
REPLAN_SHARE = 0.02  # re-plan every this share of the budget ...
REPLAN_MIN_S = 1.0  # ... but not more often than every second
# evaluations take at most about this share of the time training takes: the recipes' eval_every is set for their
# whole training sets, and a small labelled share (CIFAR-10's 10%: 5,000 images an epoch, 10,000 evaluated, ~10 s)
# spent a fifth of its budget evaluating every 3rd epoch
EVAL_SHARE = 0.05


def usable_seconds(minutes: float) -> float:
    """The seconds of a ``minutes`` budget the schedule may fill. The margin holds the last steps running slower than
    planned, the final save and curves.png (≈1.5 s): 5-minute Fashion-MNIST runs ended 294.1-297.3 s after the
    process started; with 3 s instead of 2 here, 1- and 2-minute runs of photos ended 5.3% and 5.2% early (56.8 s,
    113.8 s: AMD EPYC, one with a busy process beside)."""
    return minutes * 60 * 0.99 - 2


def budget_left(minutes: float, start_time: float) -> float:
    """Seconds of a ``minutes`` budget the schedule may still fill, for a run that started at ``start_time``."""
    return usable_seconds(minutes) - (time.time() - start_time)


def check_budget(minutes: float, spent_s: float, step_s: float, batch: int, n_train: int, n_val: int) -> None:
    # (``step_s``: seconds an optimizer step takes; ``batch``: the images it trains on, accumulated micro-batches
    # included)
    """Refuse a ``--time-limit`` shorter than the shortest run it could plan: what planning took, the steps the
    budget is fitted from (steps 5 to 15 of the first epoch: the schedule is set there) and one evaluation. A
    budget of 0.05 minutes was once planned as "~-0.4 epochs" and ran a full epoch, 29 times over. ``step_s`` 0:
    no step was timed, and planning alone must fit."""
    first = min(PROBE_STEP, max(1, n_train // batch)) + 1
    eval_s = n_val * step_s / (3 * batch)  # an evaluation image costs about a third of a training one
    need = spent_s + first * step_s + eval_s
    if usable_seconds(minutes) < need:
        at_least = math.ceil((need + 3) / 0.99 / 60 * 100) / 100  # usable_seconds inverted, to 0.01 minute
        raise ValueError(f"--time-limit {minutes:g} minutes is shorter than the shortest run vitkit can plan here: "
                         f"planning took {spent_s:.1f} s, and the first {first} steps (from which the schedule is fitted "
                         f"to the budget, {step_s * 1e3:.0f} ms each) and one evaluation take ~{need - spent_s:.1f} s "
                         f"more: give --time-limit {at_least:g} or more, or --epochs N without a time limit")


@dataclass
class TimeBudget:
    """The plan for ``minutes`` of wall time. Steps are optimizer steps; ``elapsed`` is seconds since the run began.

    The trainer calls ``after_step`` after every step (on every rank: the steps at which a re-plan happens are the
    same everywhere) and ``after_epoch_end`` once an epoch's evaluation and save are done; each returns a new plan
    (total steps, warmup steps, the step of the next re-plan) or None."""

    minutes: float
    steps_per_epoch: int
    eval_every: int
    planned_steps: int  # the recipe's schedule: epochs x steps per epoch
    planned_warmup: float  # warmup epochs x steps per epoch
    images_per_step: int  # global batch
    val_images: int
    mark: tuple[int, float] | None = None  # (step, elapsed) the pace is measured from
    next_check: int = -1  # the step of the next re-plan; -1: the first one is not set yet
    sec_per_step: float | None = None  # the pace of the last window
    eval_s: float | None = None  # seconds the last evaluation took ...
    eval_pace: float | None = None  # ... at this pace of training (an evaluation slows with the machine)
    save_s: float = 0.0  # seconds an epoch end spends writing last/ (the writes spread over the epochs they cover)
    # the most steps a re-plan may grow the schedule to (the recipe's max_epochs): a run faster than planned (a
    # compiled step, a planner's estimate from an eager one) spends its budget rather than ending early; None: the
    # planned schedule is the most
    max_steps: int | None = None

    @property
    def seconds(self) -> float:
        return usable_seconds(self.minutes)

    @property
    def eval_guess(self) -> float:
        """Seconds the next evaluation should take: the last one, scaled to the pace of training now; before any,
        a third of the time per image of a training step."""
        if self.sec_per_step is None:
            return 0.0
        if self.eval_s is None or not self.eval_pace:
            return self.val_images / (3 * self.images_per_step / self.sec_per_step)
        return self.eval_s * self.sec_per_step / self.eval_pace

    def spaced_eval_every(self, asked: int) -> int:
        """Epochs between evaluations: ``asked`` (the recipe's or --eval-every), or more where evaluating that often
        would take more than ``EVAL_SHARE`` of the training time (the last evaluation's seconds, at today's pace)."""
        if self.eval_s is None or self.sec_per_step is None:
            return asked
        epoch_s = self.sec_per_step * self.steps_per_epoch
        return max(asked, math.ceil(self.eval_guess / (EVAL_SHARE * epoch_s) - 1e-9))

    def plan(self, step: int, elapsed: float, sec_per_step: float, eval_s: float) -> tuple[int, int]:
        """(total steps, warmup steps) that end the schedule at the budget, seen from ``step`` at ``elapsed``.

        n more steps cost n * sec_per_step, an evaluation per ``eval_every`` epochs they span and a save of last/ per
        epoch, and the final evaluation: n * (sec_per_step + eval_s / (steps_per_epoch * eval_every) + save_s /
        steps_per_epoch) + eval_s <= remaining. The warmup shrinks with the schedule, keeping the recipe's shape."""
        remaining = self.seconds - elapsed
        per_step = (max(sec_per_step, 1e-6) + eval_s / (self.steps_per_epoch * self.eval_every)
                    + self.save_s / self.steps_per_epoch)
        affordable = math.floor((remaining - eval_s) / per_step)
        total = max(step, min(max(self.planned_steps, self.max_steps or 0), step + affordable))
        return total, int(self.planned_warmup * total / self.planned_steps)

    def measures_at(self, step: int, first_step: int = 0) -> bool:
        """Whether ``after_step`` reads the clock at ``step`` (its mark or a re-plan): a GPU's queue is drained
        first there, so that the pace is the device's and not how fast the host queued steps (issue 80, N8)."""
        if self.mark is None:
            return step in (first_step + WARM_STEPS, first_step + max(1, self.steps_per_epoch - 1))
        return step >= self.next_check

    def after_step(self, step: int, elapsed: float, first_step: int = 0) -> tuple[int, int, int] | None:
        """After optimizer step ``step`` (this process started at ``first_step``): the pace is measured from the
        step ``WARM_STEPS`` after the start, the first plan made ``PROBE_STEP - WARM_STEPS`` steps later (sooner in a
        short epoch), and every re-plan after it about ``REPLAN_SHARE`` of the budget later."""
        if not self.measures_at(step, first_step):
            return None
        if self.mark is None:
            self.mark = (step, elapsed)
            self.next_check = min(first_step + PROBE_STEP, max(step + 1, first_step + self.steps_per_epoch - 1))
            return None
        s0, e0 = self.mark
        return self.paced(step, elapsed, (elapsed - e0) / max(step - s0, 1))

    def paced(self, step: int, elapsed: float, sec_per_step: float) -> tuple[int, int, int]:
        """The plan at ``step`` from a pace of ``sec_per_step``: measured by ``after_step`` on the steps since its
        mark, or handed over by the tuning, whose last steps timed the chosen settings (a 1-minute CIFAR-10 run beside
        two other processes waited 15 steps more for its first plan, 11 s, and found 9 s left for a 17-s final
        evaluation: 68.5 s of 60)."""
        self.sec_per_step = sec_per_step
        total, warmup = self.plan(step, elapsed, self.sec_per_step, self.eval_guess)
        every = max(REPLAN_MIN_S, REPLAN_SHARE * self.minutes * 60)
        self.mark = (step, elapsed)
        self.next_check = step + max(1, round(every / max(self.sec_per_step, 1e-6)))
        if step < warmup:  # the warmup is still under way and follows the plans: re-plan every few steps while it
            self.next_check = min(self.next_check, step + WARM_STEPS)  # lasts, on a pace past the first steps'
        return total, warmup, self.next_check

    def evaluated(self, seconds: float) -> None:
        """An evaluation took ``seconds``, at the current pace of training. The first one of a process compiles and
        warms up too: it counts at most what the guess says, so that one slow start does not shorten the plan."""
        guess = self.eval_guess
        self.eval_s = min(seconds, guess) if self.eval_s is None and guess > 0 else seconds
        self.eval_pace = self.sec_per_step

    def after_epoch_end(self, step: int, elapsed: float, save_s: float) -> tuple[int, int, int] | None:
        """An epoch ended at ``step``, its evaluation and save done by ``elapsed`` (an epoch's share of the writes of
        last/: ``save_s``): the pace is measured again from here (the evaluation is counted on its own), and the plan
        is made again with what the evaluation and the saves really take."""
        self.save_s = save_s
        if self.mark is None or self.sec_per_step is None:  # before the first plan: its steps are still measuring
            return None
        self.mark = (step, elapsed)
        total, warmup = self.plan(step, elapsed, self.sec_per_step, self.eval_guess)
        self.next_check = max(self.next_check, step + WARM_STEPS)  # a window of a few steps, not one
        return total, warmup, self.next_check
