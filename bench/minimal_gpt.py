"""The reference the GPU bench measures ds3d against: the GPT a user writes in an afternoon.

Written independently of ds3d's model (nanoGPT's shape): pre-LayerNorm blocks, causal
`scaled_dot_product_attention`, GELU MLP, learned position embeddings, untied head (so that it
has ds3d's parameter count), fp32 weights under bf16 autocast, fused AdamW. Nothing here is
tuned: the comparison is with what the obvious code gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MinimalConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int


class SelfAttention(nn.Module):
    def __init__(self, c: MinimalConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.c_attn = nn.Linear(c.d_model, 3 * c.d_model)
        self.c_proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        # [b, s, d] -> [b, h, s, hd]
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class Block(nn.Module):
    def __init__(self, c: MinimalConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.d_model)
        self.attn = SelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.d_model)
        self.c_fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.c_proj = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class MinimalGPT(nn.Module):
    def __init__(self, c: MinimalConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * c.n_layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)  # [b, s, d]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model: nn.Module, lr: float, fused: bool = True) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}], lr=lr, fused=fused,
                             foreach=None if fused else False)
