"""Entry point for the torchrun tests: `vitkit train` (or `pretrain`) with faults injected on one rank (test-only
code).

    torchrun ... tests/ddp_entry.py [--nan-at STEP:RANK] [--die-at STEP:RANK] [--dump DIR] -- train|pretrain ...
"""
import faulthandler
import gc
import json
import os
import signal
import sys

from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from vitkit.cli.main import main
from vitkit.runtime.distributed import restart_count
from vitkit.training import trainer as trainer_mod


def parse(argv):
    opts = {}
    while argv and argv[0] != "--":
        opts[argv[0]] = argv[1]
        argv = argv[2:]
    return opts, argv[1:]


faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/test_ddp.py's launch(): where a hung rank waits
opts, rest = parse(sys.argv[1:])
rank = int(os.environ.get("RANK", "0"))


class Faulty(trainer_mod.Trainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        loss_of = self.objective.loss  # the objective's loss (classify, mae, mpp): the faults reach every kind

        def faulty(*args, **kwargs):
            loss = loss_of(*args, **kwargs)
            for key in ("--nan-at", "--die-at"):
                if key in opts:
                    step, r = (int(v) for v in opts[key].split(":"))
                    if rank == r and self.step >= step:
                        if key == "--die-at" and restart_count() == 0:  # (the group's round: ranks may change nodes)
                            os._exit(17)  # a crash: no clean-up, no checkpoint
                        if key == "--nan-at":
                            loss = loss * float("nan")
            return loss

        self.objective.loss = faulty

    def fit(self):
        result = super().fit()
        if "--dump" in opts and getattr(self, "twin", None) is None:  # (a sharded run's: last/model.safetensors)
            save_file({k: v.contiguous() for k, v in self.module.state_dict().items()},  # with an objective's parts
                      os.path.join(opts["--dump"], f"rank{rank}.safetensors"))
        if "--dump" in opts:
            with open(os.path.join(opts["--dump"], f"rank{rank}.json"), "w") as f:  # the settings this rank trained
                json.dump({"cfg": self.cfg.to_dict(), "chosen": self.plan.chosen,
                           "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps}, f, default=str)
        return result


trainer_mod.Trainer = Faulty
code = main(rest)
# the process group must be torn down with nothing holding it: a DDP wrapper still alive at interpreter shutdown
# frees the gloo group there, which aborts the process now and then (see cli/train.py: _destroy_process_group)
gc.collect()
alive = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
if alive:
    print(f"ddp_entry: {len(alive)} DistributedDataParallel object(s) outlived `vitkit train`", file=sys.stderr)
    sys.exit(99)
sys.exit(code)
