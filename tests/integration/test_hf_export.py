"""Hugging Face out: a TP2 x PP2 job's checkpoint, exported by `ds3dctl export --format hf`, is a
folder that `transformers` loads with AutoModelForCausalLM / AutoTokenizer, and its logits are
ds3d's own forward's (the single-process model loaded from the ds3d-format export of the same
step) to 1e-5 in fp32. The job's checkpoint carries DeepSpeed's `latest`, so DeepSpeed's
`DeepSpeedCheckpoint` opens it without being told the tag."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ds3d.trainer.export import export, load_exported

from support import REPO, byte_level_bpe, torchrun, worker_env

transformers = pytest.importorskip("transformers")

SETS = ["train.steps=6", "parallel.tp=2", "parallel.pp=2", "model.vocab_size=512",
        "checkpoint.interval=3", "model.rope_theta=20000.0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_export_of_a_tp2_pp2_job_loads_in_transformers_with_ds3d_logits(tmp_path):
    tokenizer = byte_level_bpe(tmp_path / "tokenizer.json")
    run = tmp_path / "run"
    torchrun(run, 4, sets=[*SETS, f'data.tokenizer="{tokenizer}"'])
    store = f"file://{run}/store/tiny"

    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "ds3d.daemon.cli", "export", "tiny", "--store", store,
         "--step", "6", "--format", "hf", "--tokenizer", str(tokenizer), "--out", str(out)],
        env=worker_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "AutoModelForCausalLM" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    assert config["use_parallel_residual"] is False and config["rotary_pct"] == 1.0
    assert config["rotary_emb_base"] == 20000.0 and config["tie_word_embeddings"] is False
    assert config["ds3d"]["step"] == 6 and config["ds3d"]["source_layout"]["tp"] == 2

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    export(store, tmp_path / "ds3d", step=6)
    ours = load_exported(tmp_path / "ds3d")
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = tokens
        for layer in ours.children():
            x = layer(x)
        got = hf(tokens).logits
    assert x.shape == got.shape == (2, 64, 512)
    assert (x - got).abs().max().item() <= 1e-5

    from tokenizers import Tokenizer

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = (REPO / "trainer" / "assets" / "public_domain.txt").read_text()[:500]
    assert hf_tok(text)["input_ids"] == Tokenizer.from_file(str(tokenizer)).encode(text).ids
    assert hf_tok.eos_token == "<|endoftext|>" and config["eos_token_id"] == hf_tok.eos_token_id

    # DeepSpeed's tools without a tag: the store's step folder and the local tier have `latest`
    from deepspeed.checkpoint import DeepSpeedCheckpoint

    files = run / "store" / "tiny" / "ckpt" / "step-00000006" / "files"
    tag = (files / "latest").read_text()
    assert tag == "global_step6"
    ds = DeepSpeedCheckpoint(os.fspath(files / tag))
    assert (ds.tp_degree, ds.pp_degree, ds.dp_degree) == (2, 2, 1)
    assert (run / "ckpt" / "latest").read_text() == "global_step6"
