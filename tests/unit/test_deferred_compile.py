"""DeepSpeed's engine imports its Muon optimizer module, whose functions are decorated with
torch.compile at import; the trainer defers that decoration to a function's first call, so a
worker's start does not import inductor for functions it never calls."""

from __future__ import annotations

import subprocess
import sys


def test_muon_import_does_not_import_inductor():
    code = ("import sys, deepspeed\n"
            "from ds3d.trainer.engine import defer_deepspeed_compile\n"
            "defer_deepspeed_compile()\n"
            "import deepspeed.runtime.zero.muon.original_muon\n"
            "print('torch._inductor.compile_fx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_deferred_compile_is_torch_compile_at_the_first_call(monkeypatch):
    import torch
    from deepspeed.runtime import compiler

    from ds3d.trainer.engine import defer_deepspeed_compile

    monkeypatch.setattr(compiler, "compile", compiler.compile)  # restored after the test
    compiled: list[object] = []

    def fake_compile(fn, *args, **kwargs):
        compiled.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    defer_deepspeed_compile()
    defer_deepspeed_compile()  # idempotent: one layer of deferral

    @compiler.compile()
    def double(x):
        return 2 * x

    assert compiled == []  # decorating compiles nothing
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert len(compiled) == 1 and compiled[0].__name__ == "double"  # once, at the first call
    assert double.__name__ == "double"
