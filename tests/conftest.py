import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_config(**kw):
    from vitkit import ViTConfig

    base = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **kw})
