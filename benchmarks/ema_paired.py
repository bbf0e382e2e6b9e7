"""Does an EMA of the weights (``--model-ema``) help a run? One ``vitkit train`` run, paired: the run itself trains
and evaluates the live model as usual, and beside it keeps EMAs with several decays (updated after every optimizer
step) and evaluates each of them after every epoch, so every row compares them on the same trajectory.

    python benchmarks/ema_paired.py ema.jsonl train --dataset fashion-mnist --time-limit 5 --output runs/ema

The EMA updates cost training time (three of them: ~2,000 vs ~2,450 img/s for the 5-minute Fashion-MNIST model),
so the run's own accuracy is below a normal run's; compare the columns of one row, not runs.
"""
import json
import sys
import time

from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from vitkit.cli.main import main
from vitkit.training import trainer as trainer_mod

DECAYS = (0.998, 0.999, 0.9995)


class PairedEMA(trainer_mod.Trainer):
    def __init__(self, *a, **k):  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.emas = {d: AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(d)) for d in DECAYS}
        self.optimizer.register_step_post_hook(
            lambda *_: [e.update_parameters(self.model) for e in self.emas.values()])

    def evaluate(self):  # type: ignore[no-untyped-def]
        live = super().evaluate()
        t = time.time()
        live_top1 = live["top1"] if self.ema is None else self.evaluate_model(self.model)["top1"]  # --model-ema
        row = {"epoch": self.epoch, "step": self.step, "live": live_top1}
        for d, e in self.emas.items():
            row[f"ema_{d}"] = self.evaluate_model(e.module)["top1"]
        row["ema_eval_s"] = round(time.time() - t, 2)
        print(json.dumps(row), flush=True)
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps(row) + "\n")
        return live


if __name__ == "__main__":
    trainer_mod.Trainer = PairedEMA
    sys.exit(main(sys.argv[2:]))
