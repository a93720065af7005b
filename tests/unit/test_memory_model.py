"""The memory model (trainer/memory_model.py) against the peaks measured on an H200
(bench/results/gpu-train.json, `memory_*` sections) and its layout rules."""

import argparse
import json
import subprocess
import sys

import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.memory_model import (
    GiB,
    Layout,
    NodeResources,
    estimate,
    problems,
    smallest_fitting,
)

from support import REPO

sys.path.insert(0, str(REPO / "bench"))


def _measured():
    import gpu_bench

    report = json.loads((REPO / "bench" / "results" / "gpu-train.json").read_text())
    args = argparse.Namespace(device="cuda", quick=False)
    for name, r in report["sections"].items():
        if name.startswith("memory_") and "max_allocated_GiB" in r:
            yield name, build_job_config("gpt1b", gpu_bench.job_sets(args) + r["sets"],
                                         name="m"), r


def test_predictions_are_within_10_percent_of_the_h200_peaks():
    rows = list(_measured())
    assert len(rows) >= 5
    for name, cfg, r in rows:
        predicted = estimate(cfg).peak.gpu_total / GiB
        assert predicted == pytest.approx(r["max_allocated_GiB"], rel=0.10), name


def _job(*sets):
    return build_job_config("gpt1b", ['launch.device="cuda"', "train.micro_batch_size=4",
                                      "train.global_batch_size=64", *sets], name="m")


def test_zero1_divides_master_weights_and_moments_by_dp_not_the_weights():
    one, four = estimate(_job()).ranks[0], estimate(_job("parallel.dp=4")).ranks[0]
    assert four.gpu_parts["Adam moments (fp32)"] == pytest.approx(
        one.gpu_parts["Adam moments (fp32)"] / 4, rel=1e-6)
    assert four.gpu_parts["weights (bf16)"] == one.gpu_parts["weights (bf16)"]


def test_tp_shards_weights_and_pp_keeps_more_micro_batches_in_flight_on_early_stages():
    tp2 = estimate(_job("parallel.tp=2")).ranks[0]
    assert tp2.parameters == pytest.approx(estimate(_job()).ranks[0].parameters / 2, rel=1e-3)
    pp4 = estimate(_job("parallel.pp=4", "parallel.activation_checkpoint_interval=0")).ranks
    acts = [next(v for k, v in r.gpu_parts.items() if k.startswith("activations")) for r in pp4]
    assert "4 micro-batch(es) in flight" in " ".join(pp4[0].gpu_parts)
    assert "1 micro-batch(es) in flight" in " ".join(pp4[3].gpu_parts)
    assert acts[0] > acts[3]


def test_activation_checkpointing_shrinks_activations():
    plain = estimate(_job("train.micro_batch_size=8", "train.global_batch_size=64",
                          "parallel.activation_checkpoint_interval=0"))
    ckpt = estimate(_job("train.micro_batch_size=8", "train.global_batch_size=64",
                         "parallel.activation_checkpoint_interval=1"))
    assert ckpt.peak.gpu_total < plain.peak.gpu_total * 0.7


def test_gpt10b_does_not_fit_one_h200_and_the_smallest_layout_that_fits_does():
    cfg = build_job_config("gpt10b", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                                      "launch.nnodes=1", "launch.nproc_per_node=1"], name="big")
    node = NodeResources(gpus=8, gpu_bytes=141 * 10**9, host_bytes=2048 * GiB)
    assert problems(estimate(cfg), node, 1)
    layout, est = smallest_fitting(cfg, node)
    assert layout.gpus == 2 and not problems(est, node, 2)
    smaller = [lo for lo in (Layout(1, 1, 1, z, c) for z in (0, 1, 2, 3) for c in (0, 1))]
    assert all(problems(estimate(cfg, lo), node, 1) for lo in smaller)


def test_the_module_does_not_import_torch():
    code = ("import sys, ds3d.trainer.memory_model, ds3d.daemon.fit_check; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_a_cuda_job_on_a_node_without_gpus_is_refused_before_launch():
    """Was: accepted (the GPU checks ran only where a GPU size was known), so the workers
    crashed at CUDA init until the restart budget was spent and the job ended FAILED."""
    from ds3d.daemon.fit_check import check_fit
    from ds3d.trainer.errors import ConfigError
    from ds3d.trainer.memory_model import NodeResources

    cpu_node = NodeResources(0, None, 64 << 30, "no GPU")
    with pytest.raises(ConfigError, match='launch.device="cuda" but this node has no GPU'):
        check_fit(build_job_config("tiny", ['launch.device="cuda"']), cpu_node)
    for device in ("cpu", "auto"):
        check_fit(build_job_config("tiny", [f'launch.device="{device}"']), cpu_node)
    check_fit(build_job_config("tiny", ['launch.device="cuda"']),
              NodeResources(1, 80 << 30, 64 << 30, "measured"))


def test_fp16_on_a_cpu_without_fp16_is_refused_at_start():
    """Was: launched, and every worker died in DeepSpeed's "Type fp16 is not supported on your
    device" (an AMD EPYC has no AVX512-FP16/AMX-FP16 for oneDNN's fp16 kernels)."""
    from ds3d.daemon.fit_check import check_fit, cpu_has_fp16
    from ds3d.trainer.errors import ConfigError
    from ds3d.trainer.memory_model import NodeResources

    epyc = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"
    assert cpu_has_fp16(epyc) is False and cpu_has_fp16(sapphire) is True
    assert cpu_has_fp16("Features\t: fp asimd fphp\n") is None  # not x86: the workers tell
    fp16 = build_job_config("tiny", ['train.precision="fp16"'])
    with pytest.raises(ConfigError, match='"fp16" cannot run on this node\'s CPU'):
        check_fit(fp16, NodeResources(0, None, 64 << 30, "no GPU", cpu_fp16=False))
    check_fit(fp16, NodeResources(0, None, 64 << 30, "no GPU", cpu_fp16=True))
    check_fit(fp16, NodeResources(0, None, 64 << 30, "no GPU", cpu_fp16=None))
    check_fit(build_job_config("tiny", ['train.precision="bf16"']),
              NodeResources(0, None, 64 << 30, "no GPU", cpu_fp16=False))
    check_fit(build_job_config("tiny", ['train.precision="fp16"', 'launch.device="cuda"']),
              NodeResources(1, 80 << 30, 64 << 30, "measured", cpu_fp16=False))  # on GPUs
