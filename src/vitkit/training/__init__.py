"""Training: the config (``TrainConfig``), the planner that decides what a run trains and how (``make_plan``,
``plan_run``), the parts it builds (``build``), the loop (``Trainer``), the time budget, checkpoints, evaluation and
the run log."""
from .config import TrainConfig
from .plan import Plan, Sources, make_plan, plan_run
from .trainer import RunResult, Trainer, TrainingDiverged

__all__ = ["Plan", "RunResult", "Sources", "TrainConfig", "Trainer", "TrainingDiverged", "make_plan", "plan_run"]
