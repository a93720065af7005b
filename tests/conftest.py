import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Node memory (checkpoints/node_memory.py): the workers of this test process keep their newest
# save in a tmpfs folder of its own, removed when it exits, so that the many runs that crash and
# are never restarted (drills) leave nothing in /dev/shm.
if "DS3D_NODE_MEMORY_ROOT" not in os.environ and os.path.isdir("/dev/shm"):
    import atexit
    import shutil
    import tempfile

    _node_memory = tempfile.mkdtemp(prefix="ds3d-tests-", dir="/dev/shm")
    os.environ["DS3D_NODE_MEMORY_ROOT"] = _node_memory
    atexit.register(shutil.rmtree, _node_memory, True)

# Under CI=true a skipped rgw/promtool test fails the run (tests/required_tiers.py).
pytest_plugins = ["required_tiers"]


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
