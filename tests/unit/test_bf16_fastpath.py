"""ds3d's replacements in DeepSpeed's BF16_Optimizer (trainer/bf16_fastpath.py) train exactly
like DeepSpeed's own: a real BF16_Optimizer (one gloo rank; SGD, which unlike Adam sees the
clip's scale) stepped with the stock code and with the replacements, from the same weights and
data, clipping every step and never, ends with identical weights and gradient norms."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, socket, torch, deepspeed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    from ds3d.trainer import bf16_fastpath

    def train(clip):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4)).to(torch.bfloat16)
        cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
               "gradient_clipping": clip, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
               "data_types": {"grad_accum_dtype": "fp32"}}
        eng, *_ = deepspeed.initialize(model=model, config=cfg,
                                       optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
        assert type(eng.optimizer).__name__ == "BF16_Optimizer"
        norms = []
        for step in range(4):
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
            eng.backward(eng(x).float().pow(2).mean())
            eng.step()
            norms.append(float(eng.get_global_grad_norm()))
        return [p.detach().clone() for p in model.parameters()], norms

    if sys.argv[1] == "fast":
        bf16_fastpath.install()
    from deepspeed.runtime import bf16_optimizer
    assert hasattr(bf16_optimizer.BF16_Optimizer.update_hp_grads, "ds3d_fast") == (
        sys.argv[1] == "fast")
    out = {}
    for clip in (1e-3, 1e6):  # clipping every step / never
        weights, norms = train(clip)
        out[clip] = (norms, [w.view(torch.int16).flatten().tolist() for w in weights])
    print("RESULT", repr(out))
""")


@pytest.mark.timeout(240)
def test_fast_bf16_optimizer_paths_match_deepspeeds_bit_for_bit():
    results = {}
    for mode in ("stock", "fast"):
        r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                           timeout=110)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
        results[mode] = lines[-1]
    assert results["fast"] == results["stock"]
