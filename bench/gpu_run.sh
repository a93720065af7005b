#!/usr/bin/env bash
# What one device call runs on the lent GPU machine (its python3 has torch; DeepSpeed and the
# small pure-Python dependencies travel as wheels in .wheels, built by ../shared/gpu/wheels.sh,
# plus tensorboard's for the event files and their test:
#   pip download -q --no-deps -d .wheels --python-version 3.12 --platform manylinux2014_x86_64 \
#     --only-binary=:all: tensorboard==2.21.0 absl-py markdown werkzeug tensorboard-data-server
#   bash bench/gpu_run.sh smoke   # GPU tests + a small-model pass over every bench section
#   bash bench/gpu_run.sh full    # the ~1.4B benchmark, results to $OUT/gpu.json
set -uo pipefail
python3 -m pip install -q --no-index --no-deps .wheels/*.whl 2>&1 | grep -v "^WARNING: Running pip" | tail -3
mkdir -p /tmp/ns/ds3d
ln -sfn "$PWD/trainer" /tmp/ns/ds3d/trainer
ln -sfn "$PWD/checkpoints" /tmp/ns/ds3d/checkpoints
export PYTHONPATH=/tmp/ns:$PWD/tests DS_ACCELERATOR=cuda NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
OUT=${OUT:-/tmp/out}
case "${1:-smoke}" in
  smoke)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -15
    python3 bench/gpu_bench.py --quick --steps 4 --warmup 2 --out "$OUT/gpu-quick.json" 2>&1 | tail -14
    ;;
  full)
    python3 bench/gpu_bench.py --out "$OUT/gpu.json" 2>&1 | grep -v "^\[20" | tail -30
    ;;
esac
