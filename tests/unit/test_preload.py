"""trainer/preload.py, the forkserver's last preload: warm caches, then gc.freeze."""

from __future__ import annotations

import json
import subprocess
import sys


def test_preload_freezes_what_was_imported_and_imports_tensorboard_without_cuda():
    probe = ("import gc, json, sys; import ds3d.trainer.preload; import torch; "
             "print(json.dumps({'frozen': gc.get_freeze_count(), "
             "'tensorboard': 'torch.utils.tensorboard' in sys.modules, "
             "'cuda_initialised': torch.cuda.is_initialized()}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 10_000  # torch's and TensorBoard's objects, out of the collector's way
    assert got["tensorboard"] is True
    assert got["cuda_initialised"] is False  # a forked worker could not use CUDA otherwise
