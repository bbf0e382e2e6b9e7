"""``--time-limit``: fit the learning-rate schedule into a wall-clock budget, so the cosine ends when time does.

The plan is made three times over: from the speed of steps 5-30 of the first epoch (compiling and warm-up are
behind by then), and again after every epoch from what that epoch really took, evaluations and saves included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_STEP = 30  # the first plan is made at this step of the first epoch (from the steps since step 5)


def usable_seconds(minutes: float) -> float:
    """The seconds of a ``minutes`` budget the schedule may fill. The margin holds the last epoch running slower than
    planned, the final save and curves.png (≈1.5 s): 5-minute Fashion-MNIST runs ended 294.1-297.3 s after the
    process started."""
    return minutes * 60 * 0.99 - 3


def check_budget(minutes: float, spent_s: float, step_s: float, batch: int, n_train: int, n_val: int) -> None:
    """Refuse a ``--time-limit`` shorter than the shortest run it could plan: what planning took, the steps the
    budget is fitted from (steps 5 to 30 of the first epoch: the schedule is set there) and one evaluation. A
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
    """The plan for ``minutes`` of wall time. Steps are optimizer steps; times are seconds since the run started."""

    minutes: float
    steps_per_epoch: int
    eval_every: int
    planned_steps: int  # the recipe's schedule: epochs x steps per epoch
    planned_warmup: float  # warmup epochs x steps per epoch
    images_per_step: int  # global batch
    val_images: int
    probe: list[tuple[int, float]] = field(default_factory=list)  # (step, time) at steps 5 and 30 of the first epoch
    eval_guess: float = math.inf  # seconds an evaluation should take, from the probed training speed
    eval_s: float | None = None  # seconds the last evaluation took

    @property
    def seconds(self) -> float:
        return usable_seconds(self.minutes)

    def plan(self, step: int, elapsed: float, sec_per_step: float, eval_s: float) -> tuple[int, int]:
        """(total steps, warmup steps) that end the schedule at the budget, seen from ``step`` at ``elapsed``.

        n more steps cost n * sec_per_step plus one evaluation per ``eval_every`` epochs they span, and the final
        one: n * (sec_per_step + eval_s / (steps_per_epoch * eval_every)) + eval_s <= remaining. The warmup shrinks
        with the schedule, keeping the recipe's shape."""
        remaining = self.seconds - elapsed
        per_eval = self.steps_per_epoch * self.eval_every
        affordable = int((remaining - eval_s) / (max(sec_per_step, 1e-6) + eval_s / per_eval))
        total = max(step, min(self.planned_steps, step + affordable))
        return total, int(self.planned_warmup * total / self.planned_steps)

    def probe_step(self, step: int, now: float, elapsed: float) -> tuple[int, int] | None:
        """Called after each step of the first epoch: at step 30 (or the epoch's last but one), the first plan, with an
        evaluation guessed at a third of the time per image of training."""
        if len(self.probe) == 2 or step not in (5, min(PROBE_STEP, self.steps_per_epoch - 1)):
            return None
        self.probe.append((step, now))
        if len(self.probe) < 2:
            return None
        (s0, t0), (s1, t1) = self.probe
        sps = (t1 - t0) / (s1 - s0)
        self.eval_guess = self.val_images / (3 * self.images_per_step / sps)
        return self.plan(step, elapsed, sps, self.eval_guess)

    def after_epoch(self, step0: int, t0: float, train_s: float, step: int, elapsed: float) -> tuple[int, int]:
        """The plan from the epoch that just ended (steps step0..step, started at t0, trained for train_s). The first
        epoch also compiled the model and ran the first, warming-up evaluation: its plan uses the steps after the
        probe's mark (step 5) and an evaluation at most as long as the probe's guess. (Planning with the compiling in
        it shrank the schedule, and the LR rose again at the next re-plan.)"""
        first = bool(self.probe) and self.probe[0][0] > step0
        mark_step, mark_t = self.probe[0] if first else (step0, t0)
        if self.eval_s is None:  # no evaluation yet (--eval-every skipped it): the probe's guess
            eval_s = self.eval_guess if math.isfinite(self.eval_guess) else 0.0
        else:
            eval_s = min(self.eval_s, self.eval_guess) if first else self.eval_s
        return self.plan(step, elapsed, (t0 + train_s - mark_t) / max(step - mark_step, 1), eval_s)
