"""ds3d's GPT as a Hugging Face `GPTNeoXForCausalLM`: the same function, other names and layout.

Why GPT-NeoX: it is the one architecture in `transformers` with everything ds3d's block has and
nothing else: pre-LayerNorm with biases, fused QKV with biases, rotary positions, exact-erf GELU
MLP with biases, untied input embedding and output head, final LayerNorm. It matches when
configured as

    use_parallel_residual = false   x + Attn(LN1(x)), then + MLP(LN2(.)): ds3d's sequential block
    rotary_pct = 1.0                every head dimension rotates (ds3d has no partial rotary)
    rotary_emb_base = rope_theta    the same inverse frequencies theta^(-2m/hd)
    hidden_act = "gelu"             torch's exact GELU, as ds3d's F.gelu
    tie_word_embeddings = false     ds3d's head is its own matrix

Two layouts differ and are converted exactly (a permutation of rows, no arithmetic):
  * QKV: ds3d's fused output is [3, heads, head_dim] (all Q heads, then K, then V); NeoX's is
    [heads, 3, head_dim] (Q, K, V of head 0, then of head 1, ...).
  * rotary pairs: ds3d rotates interleaved pairs (x[2m], x[2m+1]); NeoX rotates halves
    (x[m], x[m + head_dim/2]) (`rotate_half`). Both use frequency m for pair m, so Q and K rows
    of each head are reordered [0, 2, 4, ..., 1, 3, 5, ...]; attention scores q.k are unchanged
    because Q and K get the same order. V is not rotated and keeps its order.

The weights are written with the names EleutherAI's GPT-NeoX/Pythia checkpoints use
(`gpt_neox.*`, `embed_out.weight`), which every transformers version loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import ConfigError


def check_expressible(m: ModelConfig) -> None:
    """GPT-NeoX has one MLP width for all layers: a model with per-block widths has no exact
    GPT-NeoX equivalent."""
    if len(set(m.block_ffn_widths())) != 1:
        raise ConfigError(f"model.layer_d_ff={m.layer_d_ff} gives blocks different MLP widths; "
                          "GPT-NeoX (and every transformers GPT) has one intermediate_size, so "
                          "this model cannot be exported as Hugging Face GPT-NeoX exactly; "
                          "export --format ds3d instead")


def rotary_order(head_dim: int) -> torch.Tensor:
    """Row order turning interleaved rotary pairs into NeoX's halves."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _qkv_to_neox(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """ds3d [3, d(, in)] -> NeoX [d * 3(, in)] with rotary pairs de-interleaved in Q and K."""
    rest = t.shape[2:]
    hd = t.shape[1] // n_heads
    x = t.reshape(3, n_heads, hd, *rest)
    order = rotary_order(hd)
    q, k, v = x[0][:, order], x[1][:, order], x[2]
    return torch.stack([q, k, v], dim=1).reshape(3 * n_heads * hd, *rest).contiguous()


def to_gpt_neox(tensors: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Consolidated ds3d weights ("<layer>.<param>", GPTSequential's names) -> GPT-NeoX's."""
    check_expressible(m)
    out = {"gpt_neox.embed_in.weight": tensors["0.embed.weight"]}
    for i in range(m.n_layers):
        src, dst = f"{i + 1}.", f"gpt_neox.layers.{i}."
        d = m.d_model
        out.update({
            dst + "input_layernorm.weight": tensors[src + "ln1.weight"],
            dst + "input_layernorm.bias": tensors[src + "ln1.bias"],
            dst + "attention.query_key_value.weight": _qkv_to_neox(
                tensors[src + "qkv.weight"].reshape(3, d, d), m.n_heads),
            dst + "attention.query_key_value.bias": _qkv_to_neox(
                tensors[src + "qkv.bias"].reshape(3, d), m.n_heads),
            dst + "attention.dense.weight": tensors[src + "proj.weight"],
            dst + "attention.dense.bias": tensors[src + "proj.bias"],
            dst + "post_attention_layernorm.weight": tensors[src + "ln2.weight"],
            dst + "post_attention_layernorm.bias": tensors[src + "ln2.bias"],
            dst + "mlp.dense_h_to_4h.weight": tensors[src + "fc1.weight"].reshape(-1, d),
            dst + "mlp.dense_h_to_4h.bias": tensors[src + "fc1.bias"].reshape(-1),
            dst + "mlp.dense_4h_to_h.weight": tensors[src + "fc2.weight"],
            dst + "mlp.dense_4h_to_h.bias": tensors[src + "fc2.bias"],
        })
    head = f"{m.n_layers + 1}."
    out["gpt_neox.final_layer_norm.weight"] = tensors[head + "ln_f.weight"]
    out["gpt_neox.final_layer_norm.bias"] = tensors[head + "ln_f.bias"]
    out["embed_out.weight"] = tensors[head + "lm_head.weight"].reshape(m.vocab_size, m.d_model)
    return {k: v.contiguous() for k, v in out.items()}


def gpt_neox_config(m: ModelConfig, dtype: str, eod_id: int | None) -> dict[str, Any]:
    check_expressible(m)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "intermediate_size": m.block_ffn_widths()[0],  # one width (check_expressible)
        "hidden_act": "gelu",
        "use_parallel_residual": False,
        "rotary_pct": 1.0,
        "rotary_emb_base": m.rope_theta,
        "max_position_embeddings": m.seq_len,
        "layer_norm_eps": m.norm_eps,
        "initializer_range": m.init_std,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "torch_dtype": dtype,
    }


def write_hf(out: Path, tensors: dict[str, torch.Tensor], m: ModelConfig,
             tokenizer: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """Writes OUT/config.json, OUT/model.safetensors and, when `tokenizer` is given, the
    tokenizer files; returns what it wrote. `extra` (step, source layout, ...) goes into
    config.json under "ds3d" so the export says where it came from."""
    from .text_tokenizer import TextTokenizer

    tok = TextTokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and tok.vocab_size > m.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than the "
                          f"model's vocab_size={m.vocab_size}; it did not make this model's data")
    weights = to_gpt_neox(tensors, m)
    dtype = str(next(iter(weights.values())).dtype).replace("torch.", "")
    config = gpt_neox_config(m, dtype, tok.eod_id if tok is not None else None)
    config["ds3d"] = extra
    out.mkdir(parents=True, exist_ok=True)
    save_weights(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = ["config.json", "model.safetensors"]
    if tok is not None:
        files += tok.save_for_transformers(out, model_max_length=m.seq_len)
    return {"files": files, "config": config}


def save_weights(tensors: dict[str, torch.Tensor], path: Path,
                 metadata: dict[str, str] | None = None) -> None:
    """safetensors' file, readable as the process's umask allows like every other file of the
    export (safetensors creates it 0600: config.json beside it was 0644, the weights unreadable
    to the group that serves the model)."""
    import os

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it: another thread's file
    created meanwhile would get the temporary value)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
