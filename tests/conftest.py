import os
import tempfile

import pytest
import torch

# A fixed thread count everywhere, in this process and the training subprocesses: results do not depend on what the
# thread probe (runtime/threads.py) would pick on a busy or quiet machine; test_speed_choices.py tests the probe
# itself. Under pytest-xdist (two workers, one per core) one thread each, else two.
os.environ.setdefault("OMP_NUM_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# vitkit's cache (decoded datasets, calibration timings) in a folder of this test session, not the user's
if "VITKIT_CACHE_DIR" not in os.environ:
    os.environ["VITKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitkit-test-cache-")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_config(**kw):
    from vitkit import ViTConfig

    base = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **kw})


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
