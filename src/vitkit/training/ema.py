"""``--model-ema``: an exponential moving average of the weights, and of the buffers, evaluated and saved as best/.

torch's ``AveragedModel`` with its EMA function, with two things changed (its state dict is the same, so runs saved
before resume with it):

- the buffers are averaged too (timm's ModelEma does so): with ``use_buffers`` off, AveragedModel left the EMA copy
  of a hybrid's BatchNorm statistics as they were at step 0 (mean 0, variance 1), and the run evaluated and kept the
  EMA weights with them;
- its step count ``n_averaged`` stays on the host: AveragedModel copied it to the device at every update (one
  host-to-device copy a step on a GPU), for an EMA that never reads it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel


class ModelEma(AveragedModel):
    """The EMA of ``module``: ``ema = decay * ema + (1 - decay) * current`` after every optimizer step, the first
    update a copy; integer buffers (BatchNorm's ``num_batches_tracked``) are copied."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        super().__init__(module, use_buffers=True)
        self.decay = decay

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        ema = [*self.module.parameters(), *self.module.buffers()]
        now = [t.detach() for t in (*model.parameters(), *model.buffers())]
        first = int(self.n_averaged) == 0  # (a host tensor: no wait for the device)
        floats = [(e, c) for e, c in zip(ema, now, strict=True) if e.is_floating_point() and not first]
        if floats:
            torch._foreach_lerp_([e for e, _ in floats], [c for _, c in floats], 1 - self.decay)
        for e, c in zip(ema, now):
            if first or not e.is_floating_point():
                e.copy_(c)
        self.n_averaged += 1
