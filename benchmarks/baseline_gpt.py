"""The baseline the throughput benchmarks hold kiln against: a minimal nanoGPT-style model (fused
qkv Linear, LayerNorm without bias, GeLU MLP, learned positions, tied head, SDPA), and the `Size`
of a benchmark model. benchmarks/throughput.py (CPU) and benchmarks/gpu_throughput.py (one GPU)
both use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Size:
    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int


class BaselineBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class BaselineGPT(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.seq = s.seq
        self.wte, self.wpe = nn.Embedding(s.vocab, s.dim), nn.Embedding(s.seq, s.dim)
        self.blocks = nn.ModuleList(BaselineBlock(s.dim, s.heads) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.dim, bias=False)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def flops_per_token(self) -> float:  # same accounting as kiln.model.transformer.flops_per_token
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6.0 * matmul + 12.0 * len(self.blocks) * self.seq * self.wte.embedding_dim
