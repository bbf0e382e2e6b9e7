"""Training: the config (``TrainConfig``), the parts it builds (``build``), the loop (``Trainer``), the time
budget, checkpoints, evaluation and the run log."""
from .config import TrainConfig
from .trainer import RunResult, Trainer, TrainingDiverged

__all__ = ["RunResult", "TrainConfig", "Trainer", "TrainingDiverged"]
