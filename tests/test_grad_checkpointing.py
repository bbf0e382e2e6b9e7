"""Activation checkpointing (issue 84): ``--grad-checkpointing`` / timm's ``set_grad_checkpointing()`` keeps each
block's input alone for the backward pass and recomputes the rest there: the same gradients (against the model
without it, drop path's random draws replayed), less memory held by the step (measured by PyTorch's CPU allocator)."""
from __future__ import annotations

import copy

import pytest
import torch

from vitkit.model.config import ViTConfig
from vitkit.model.vit import VisionTransformer
from vitkit.runtime.memory import peak_bytes

SMALL = dict(img_size=32, patch_size=4, embed_dim=96, depth=6, num_heads=3, num_classes=10, drop_path_rate=0.2)


def _grads(model, x, y, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # (drop path's draws)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_the_same_gradients_and_hold_less_memory():
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(**SMALL)).double().train()
    ckpt = copy.deepcopy(model)
    ckpt.set_grad_checkpointing()
    x, y = torch.randn(16, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (16,))
    for a, b in zip(_grads(model, x, y, 1), _grads(ckpt, x, y, 1)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # (no backward to come: nothing is checkpointed, the same logits)
        torch.testing.assert_close(model.eval()(x), ckpt.eval()(x))
    model.train(), ckpt.train()
    step = lambda m: torch.nn.functional.cross_entropy(m(x.float()), y).backward()  # noqa: E731
    model.float(), ckpt.float()
    plain, checkpointed = peak_bytes(lambda: step(model), "cpu"), peak_bytes(lambda: step(ckpt), "cpu")
    assert checkpointed < 0.7 * plain, (plain, checkpointed)


def test_the_flag_reaches_the_model_and_a_run_trains_with_it(tmp_path):
    from vitkit.cli.main import main
    from vitkit.training.config import TrainConfig
    from vitkit.training.trainer import Trainer

    t = Trainer(TrainConfig(dataset="digits", epochs=1, grad_checkpointing=True, compile=False, precision="fp32",
                            attention="sdpa", channels_last=False, threads=1), log=lambda s: None, progress=False)
    assert t.model.blocks.checkpointing
    assert main(["train", "--grad-checkpointing", "--epochs", "1", "--output", str(tmp_path / "run")]) == 0
    assert '"grad_checkpointing": true' not in (tmp_path / "run" / "best" / "config.json").read_text()  # (not the
    # model's architecture: a checkpoint reads the same with or without it)
