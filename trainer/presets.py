"""Named starting points for a job; a TOML file or `--set` overrides any field.

Sizes follow the GPT-3 paper's table (Brown et al. 2020, Table 2.1) where it has a row; `gpt10b`
sits between its 6.7B and 13B rows with 48 layers of d=4096 and 32 heads of 128 (9.7B in the
blocks plus 0.4B of untied embeddings ~= 10.1B), so that its layers split into 2, 4 or 8 pipeline
stages and its heads over 2, 4 or 8 tensor-parallel ranks. The vocabulary is GPT-2's padded to
50304 (= 2^7 x 393), divisible by any TP degree up to 128.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ConfigError

_GPT2_VOCAB = 50304

PRESETS: dict[str, dict[str, Any]] = {
    # Runs on 2 CPU cores in seconds: byte-level vocabulary, 4 blocks (splits into 1, 2 or 4
    # stages), 4 heads (TP 1, 2 or 4).
    "tiny": {
        "model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64},
        "train": {"steps": 50, "micro_batch_size": 2, "global_batch_size": 8, "lr": 3e-3,
                  "warmup_steps": 5, "precision": "fp32"},
        "launch": {"device": "cpu"},
    },
    # GPT-3 Small.
    "gpt125m": {
        "model": {"vocab_size": _GPT2_VOCAB, "d_model": 768, "n_layers": 12, "n_heads": 12,
                  "seq_len": 2048},
        "train": {"steps": 600_000, "micro_batch_size": 8, "global_batch_size": 256, "lr": 6e-4,
                  "warmup_steps": 2000, "precision": "bf16"},
        "checkpoint": {"interval": 1000},
    },
    # GPT-3 XL geometry with 128-wide heads (1.41B with untied embeddings).
    "gpt1b": {
        "model": {"vocab_size": _GPT2_VOCAB, "d_model": 2048, "n_layers": 24, "n_heads": 16,
                  "seq_len": 2048},
        "train": {"steps": 300_000, "micro_batch_size": 8, "global_batch_size": 512, "lr": 2e-4,
                  "warmup_steps": 2000, "precision": "bf16"},
        "parallel": {"activation_checkpoint_interval": 1},
        "checkpoint": {"interval": 500},
    },
    # The seed article's target: ~10B on 2 nodes x 8 GPUs as TP 4 x PP 2 x DP 2, ZeRO-1.
    "gpt10b": {
        "model": {"vocab_size": _GPT2_VOCAB, "d_model": 4096, "n_layers": 48, "n_heads": 32,
                  "seq_len": 2048},
        "parallel": {"tp": 4, "pp": 2, "dp": 2, "zero_stage": 1,
                     "activation_checkpoint_interval": 1},
        "train": {"steps": 250_000, "micro_batch_size": 2, "global_batch_size": 512, "lr": 1.2e-4,
                  "warmup_steps": 2000, "precision": "bf16"},
        "launch": {"nnodes": 2, "nproc_per_node": 8, "device": "cuda"},
        "checkpoint": {"interval": 250},
    },
}


def preset_dict(name: Any) -> dict[str, Any]:
    """A preset's settings; `name` comes from a TOML file or --set, so it may be any value."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give "
                          "the path of a TOML job file")
    return copy.deepcopy(PRESETS[name])
