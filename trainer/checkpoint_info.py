"""What DeepSpeed's universal-checkpoint converter must know about ds3d's parameters.

`ds_to_universal` joins tensor-parallel shards and drops replicas by these name patterns (saved in
the client state as `universal_checkpoint_info`). In ds3d every sharded weight except the
embedding is stored so that its shards join along dimension 1 (the column-parallel weights are
kept 3-D, [groups, out/groups, in], for exactly this reason), which DeepSpeed calls "row
parallelism"; the embedding joins along dimension 0, the default.
"""

from __future__ import annotations

from typing import Any

from .config import JobConfig

# Parameter names as the converter sees them: "<layer index>.<name>", e.g. "3.qkv.weight".
# DeepSpeed asserts that every pattern matches something, so none is speculative.
TP_REPLICATED = [r".*\.ln1\.", r".*\.ln2\.", r".*\.ln_f\.", r".*\.proj\.bias$", r".*\.fc2\.bias$"]
JOIN_ON_DIM_1 = [r".*\.qkv\.(weight|bias)$", r".*\.fc1\.(weight|bias)$", r".*\.proj\.weight$",
                 r".*\.fc2\.weight$", r".*\.lm_head\.weight$"]


def universal_checkpoint_info(cfg: JobConfig) -> dict[str, Any]:
    return {
        "universal_checkpoint_version": 0.2,
        "tp_replicated_parameter_patterns": TP_REPLICATED,
        "parameter_with_row_parallelism_patterns": JOIN_ON_DIM_1,
        "vocabulary_parameter_patterns": [],
        "pipeline_replicated_parameter_patterns": [],
        "parameter_to_average_patterns": [],
        "original_vocab_size": cfg.model.vocab_size,
        "padded_vocab_size": cfg.model.vocab_size,
    }
