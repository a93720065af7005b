"""The GPT as a DeepSpeed PipelineModule: a flat list of layer specs
[Embedding, Block x n_layers, Head] that DeepSpeed cuts into pipeline stages.

Each block is pre-LayerNorm: x + Attn(LN(x)), then x + MLP(LN(x)); attention is causal
`scaled_dot_product_attention` (flash / memory-efficient kernels on GPU) with rotary positions
(applied with the QKV split in one fused kernel on GPU, see kernels.py); the MLP is GELU. QKV
and FC1 are column-parallel, the attention output projection and FC2 row-parallel, the
embedding and the head vocabulary-parallel (see tensor_parallel.py).
The embedding and head are untied (see ModelConfig).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

from .config import JobConfig, ModelConfig
from .kernels import rotary_qkv
from .partition import layer_param_counts, stage_boundaries  # noqa: F401 (re-exported)
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def param_seed(base: int, layer: int, slot: int) -> int:
    """A stable seed per (job seed, layer, parameter slot), independent of the layout."""
    return (base * 1_000_003 + layer * 1_009 + slot) % (2**63)


class EmbeddingLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp,
                                            param_seed(seed, 0, 0), cfg.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)  # [b, s] -> [b, s, d]


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, d_ff: int, tp: TPGroup, seed: int) -> None:
        super().__init__()
        d, layer = cfg.d_model, index + 1
        self.n_local_heads = cfg.n_heads // tp.size
        self.head_dim = d // cfg.n_heads
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2 residual scaling
        self.ln1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.qkv = ColumnParallelLinear(d, 3 * d, tp, param_seed(seed, layer, 1), cfg.init_std,
                                        groups=3)
        self.proj = RowParallelLinear(d, d, tp, param_seed(seed, layer, 2), out_std)
        self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.fc1 = ColumnParallelLinear(d, d_ff, tp, param_seed(seed, layer, 3), cfg.init_std)
        self.fc2 = RowParallelLinear(d_ff, d, tp, param_seed(seed, layer, 4), out_std)
        self.rope_theta = cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.n_local_heads, self.head_dim)
        q, k, v = rotary_qkv(qkv, self.rope_theta)  # each [b, h_local, s, hd], q and k rotated
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, self.n_local_heads * self.head_dim)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class HeadLayer(nn.Module):
    """Final LayerNorm and the vocabulary-parallel output projection: [b, s, d] -> [b, s, V/tp]."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp,
                                            param_seed(seed, cfg.n_layers + 1, 0), cfg.init_std,
                                            bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class VocabParallelLoss:
    """`loss_fn(logits, labels)` for the last pipeline stage."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.tp)


def layer_specs(cfg: ModelConfig, tp: TPGroup, seed: int) -> list[LayerSpec]:
    specs = [LayerSpec(EmbeddingLayer, cfg, tp, seed)]
    for i, d_ff in enumerate(cfg.block_ffn_widths()):
        specs.append(LayerSpec(TransformerBlock, cfg, i, d_ff, tp, seed))
    specs.append(LayerSpec(HeadLayer, cfg, tp, seed))
    return specs


class GPTPipeline(PipelineModule):
    """PipelineModule whose stage boundaries are computed by ds3d (see `stage_boundaries`)."""

    def __init__(self, specs: list[LayerSpec], parts: list[int], **kwargs) -> None:
        object.__setattr__(self, "_ds3d_parts", parts)
        super().__init__(specs, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        self.parts = list(self._ds3d_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline(cfg: JobConfig, topology, tp: TPGroup, device: torch.device,
                   parts: list[int] | None = None) -> GPTPipeline:
    """Builds only this rank's stage, with parameters created directly on `device`; `parts`
    are the stage boundaries (default: from the job's partition method, see partition.py)."""
    with torch.device(device):
        return GPTPipeline(
            layer_specs(cfg.model, tp, cfg.train.seed),
            parts=list(parts) if parts is not None else stage_boundaries(cfg),
            topology=topology,
            loss_fn=VocabParallelLoss(tp),
            activation_checkpoint_interval=cfg.parallel.activation_checkpoint_interval,
            # only blocks recompute: the embedding's input is integer tokens (no grad), and a
            # checkpointed region without a grad-requiring input would cut the backward pass
            checkpointable_layers=["TransformerBlock"],
            partition_method="ds3d",
        )


class GPTSequential(nn.Module):
    """The same layers without pipelining (PP = 1), for DeepSpeed's plain engine, which unlike
    the pipeline engine accepts ZeRO-2/3. Parameter names match GPTPipeline's ("1.qkv.weight")."""

    def __init__(self, cfg: JobConfig, tp: TPGroup) -> None:
        super().__init__()
        for i, spec in enumerate(layer_specs(cfg.model, tp, cfg.train.seed)):
            self.add_module(str(i), spec.build())
        self.loss_fn = VocabParallelLoss(tp)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.children():
            x = layer(x)
        return self.loss_fn(x, labels)
