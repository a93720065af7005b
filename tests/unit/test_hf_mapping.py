"""The GPT-NeoX mapping alone (trainer/hf_export.py): ds3d's single-process model and
transformers' GPTNeoXForCausalLM built from the mapped weights compute the same logits."""

import pytest
import torch

from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.hf_export import gpt_neox_config, to_gpt_neox, write_hf
from ds3d.trainer.model import GPTSequential
from ds3d.trainer.tensor_parallel import TPGroup

transformers = pytest.importorskip("transformers")


def _ds3d_model(*sets):
    job = build_job_config("tiny", list(sets))
    model = GPTSequential(job, TPGroup(None, 0, 1)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large, non-zero weights and biases: attention far from uniform
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return job, model


def _ds3d_logits(model, tokens):
    x = tokens
    for layer in model.children():
        x = layer(x)
    return x


def _hf_from(weights, m):
    cfg = transformers.GPTNeoXConfig(**{k: v for k, v in gpt_neox_config(m, "float32", None)
                                         .items() if k not in ("architectures", "model_type")})
    hf = transformers.GPTNeoXForCausalLM(cfg).eval()
    renamed = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in weights.items()}
    missing, unexpected = hf.load_state_dict(renamed, strict=False)
    assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing), missing
    return hf


def test_mapped_weights_give_ds3d_logits_exactly():
    job, model = _ds3d_model("model.rope_theta=500.0")  # a non-default base must be carried over
    tokens = torch.randint(0, job.model.vocab_size, (2, job.model.seq_len),
                           generator=torch.Generator().manual_seed(1))
    hf = _hf_from(to_gpt_neox(model.state_dict(), job.model), job.model)
    with torch.no_grad():
        ref, got = _ds3d_logits(model, tokens), hf(tokens).logits
    assert ref.abs().max() > 1.0
    assert (ref - got).abs().max().item() <= 1e-5


def test_without_the_rotary_reordering_the_logits_differ():
    """The check above can fail: the interleaved-to-halves permutation is what makes it pass."""
    job, model = _ds3d_model()
    weights = to_gpt_neox(model.state_dict(), job.model)
    d, h = job.model.d_model, job.model.n_heads
    hd = d // h
    # undo the permutation of Q and K rows: halves -> interleaved, as a naive export would write
    inverse = torch.argsort(torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)]))
    for i in range(job.model.n_layers):
        key = f"gpt_neox.layers.{i}.attention.query_key_value.weight"
        w = weights[key].reshape(h, 3, hd, d).clone()
        w[:, 0], w[:, 1] = w[:, 0][:, inverse], w[:, 1][:, inverse]
        weights[key] = w.reshape(3 * d, d)
    hf = _hf_from(weights, job.model)
    tokens = torch.randint(0, job.model.vocab_size, (1, job.model.seq_len))
    with torch.no_grad():
        assert (_ds3d_logits(model, tokens) - hf(tokens).logits).abs().max() > 1e-2


def test_equal_per_block_widths_are_one_intermediate_size():
    job, model = _ds3d_model("model.layer_d_ff=[96, 96, 96, 96]")
    hf = _hf_from(to_gpt_neox(model.state_dict(), job.model), job.model)
    assert hf.config.intermediate_size == 96
    tokens = torch.randint(0, job.model.vocab_size, (1, job.model.seq_len))
    with torch.no_grad():
        assert (_ds3d_logits(model, tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_uneven_mlp_widths_have_no_gpt_neox_equivalent(tmp_path):
    job = build_job_config("tiny", ["model.layer_d_ff=[128, 256, 256, 128]"])
    with pytest.raises(ConfigError, match="one intermediate_size"):
        write_hf(tmp_path, {}, job.model, None, {})
