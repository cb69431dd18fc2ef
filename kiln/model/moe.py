"""Mixture-of-experts feed-forward layer: a router, top-k gating, capacity (or dropless), the
load-balancing and router z-losses, and grouped experts that expert parallelism can shard.

- Top-1 routing with a capacity factor and the load-balancing loss `E * sum_e f_e * P_e` follow
  Switch Transformer (Fedus, Zoph & Shazeer 2021, sec. 2.1-2.2); top-2 with renormalized gates
  follows GShard (Lepikhin et al. 2020); the router z-loss `mean(logsumexp(logits)^2)` follows
  ST-MoE (Zoph et al. 2022, sec. 3.1). `f_e` counts all k assignments (GShard's top-2 form).
- The router runs in fp32 (ST-MoE: the softmax is where bf16 routing goes unstable).
- Capacity and the load-balancing loss are computed per sequence (GShard's "groups" of tokens).
  That makes routing independent of how the batch is split over data-parallel or expert-parallel
  ranks, so N ranks reproduce one process on the same global batch. Each expert takes at most
  `ceil(capacity_factor * k * seq_len / E)` assignments of a sequence, first choices before
  second ones, in token order; the rest are dropped (the token passes through the residual).
  `capacity_factor = 0` is dropless: every assignment is computed.
- Experts are stored as stacked tensors (expert dimension first), so kiln/parallel/
  expert_parallel.py shards them by slicing dim 0. The grouped matmul is a loop over experts on
  tokens sorted by expert (plain torch; `torch._grouped_mm` would be the GPU fast path).
- The auxiliary losses of the last forward stay on the device (`last_aux_loss`,
  `last_z_loss`); the transformer adds them to its loss and exposes them for logging.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config import ModelConfig


class GroupedExperts(nn.Module):
    """`n_local` expert MLPs (the gated unit of the dense FeedForward), weights (n_local, in, out).

    `n_experts` is the global count; under expert parallelism this rank holds experts
    `[first, first + n_local)`. Biases are not supported (model.bias applies to dense layers)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, activation: str):
        super().__init__()
        self.n_experts, self.first, self.n_local = n_experts, 0, n_experts
        self.gated = activation in ("swiglu", "geglu")
        self.act = F.silu if activation == "swiglu" else F.gelu
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden)) if self.gated else None
        self.grad_hook = None

    def params_per_expert(self) -> int:
        return sum(w.shape[1] * w.shape[2] for w in (self.w1, self.w2, self.w3) if w is not None)

    def _local(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """Under expert parallel in `kiln train` the weights are DTensors of the global shape: this
        rank's slice, its gradient reduced by `grad_hook` (set by kiln/parallel/expert_parallel.py)."""
        if not isinstance(w, DTensor):
            return w
        w = w.to_local()
        if self.grad_hook is not None and w.requires_grad:
            w.register_hook(self.grad_hook)
        return w

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows sorted by local expert, `counts[e]` rows for local expert e."""
        w1, w2, w3 = (self._local(w) for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            h = self.act(chunk @ w1[e])
            if w3 is not None:
                h = h * (chunk @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, hidden, cfg.activation)
        # Set by kiln.parallel.expert_parallel.apply_expert_parallel: None = all experts local.
        self.ep_group = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None

    def capacity(self, seq_len: int) -> int:
        if self.capacity_factor == 0:
            return seq_len * self.top_k  # dropless: room for every assignment
        return max(1, math.ceil(self.capacity_factor * self.top_k * seq_len / self.n_experts))

    def route(self, x: torch.Tensor):
        """x (B, T, D) -> kept assignments (token index, expert, gate) and the aux losses."""
        bsz, seqlen, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (B, T, E) fp32
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)  # (B, T, k)
        if self.top_k > 1:  # GShard: the k gates renormalized to sum to 1
            gates = gates / gates.sum(dim=-1, keepdim=True)
        # k-major order within each sequence: every token's first choice before any second choice.
        experts_km = experts.transpose(1, 2).reshape(bsz, self.top_k * seqlen)  # (B, kT)
        onehot = F.one_hot(experts_km, self.n_experts)  # (B, kT, E)
        position = (onehot.cumsum(dim=1) * onehot).sum(-1) - 1  # slot of each assignment in its expert
        keep = position < self.capacity(seqlen)
        # Load balancing per sequence: f_e = share of the sequence's assignments (before dropping)
        # routed to e, P_e = mean router probability of e; E * sum_e f_e P_e, averaged over sequences.
        f = onehot.float().mean(dim=1)  # (B, E)
        p = probs.mean(dim=1)  # (B, E)
        self.last_aux_loss = self.n_experts * (f * p).sum(-1).mean()
        self.last_z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        self.last_dropped_fraction = (~keep).float().mean().detach()
        token = (torch.arange(bsz, device=x.device)[:, None] * seqlen
                 + torch.arange(seqlen, device=x.device).repeat(self.top_k)[None])  # (B, kT)
        gates_km = gates.transpose(1, 2).reshape(bsz, self.top_k * seqlen)
        return token[keep], experts_km[keep], gates_km[keep]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        token, expert, gate = self.route(x)
        order = torch.argsort(expert, stable=True)
        token, expert, gate = token[order], expert[order], gate[order]
        rows = x.reshape(-1, dim)[token]
        counts = torch.bincount(expert, minlength=self.n_experts)
        if self.ep_group is None:
            y = self.experts(rows, counts.tolist())
        else:
            from kiln.parallel.expert_parallel import dispatch_and_combine

            y = dispatch_and_combine(rows, counts, self.experts, self.ep_group)
        out = torch.zeros(bsz * seqlen, dim, device=x.device, dtype=y.dtype)
        out = out.index_add(0, token, y * gate[:, None].to(y.dtype))
        return out.view(bsz, seqlen, dim).to(x.dtype)
