import os

import pytest
import torch

# Two threads everywhere, in this process and the training subprocesses: results do not depend on what the thread
# probe (runtime/threads.py) would pick on a busy or quiet machine; test_speed_choices.py tests the probe itself.
os.environ.setdefault("OMP_NUM_THREADS", "2")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_config(**kw):
    from vitkit import ViTConfig

    base = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **kw})
