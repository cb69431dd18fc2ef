"""Mixture-of-experts feed-forward layer: a router, top-k gating, capacity (or dropless), the
load-balancing and router z-losses, and grouped experts that expert parallelism can shard.

- Top-1 routing with a capacity factor and the load-balancing loss `E * sum_e f_e * P_e` follow
  Switch Transformer (Fedus, Zoph & Shazeer 2021, sec. 2.1-2.2); top-2 with renormalized gates
  follows GShard (Lepikhin et al. 2020); the router z-loss `mean(logsumexp(logits)^2)` follows
  ST-MoE (Zoph et al. 2022, sec. 3.1). `f_e` counts all k assignments (GShard's top-2 form).
- The router runs in fp32 (ST-MoE: the softmax is where bf16 routing goes unstable).
- Capacity and the load-balancing loss are computed per sequence (GShard's "groups" of tokens).
  That makes routing independent of how the batch is split over data-parallel or expert-parallel
  ranks, so N ranks reproduce one process on the same global batch. Under context parallelism
  (`cp_group`, a zig-zag half of every sequence per rank) the counts behind both are summed over
  the cp ranks, so capacity and the balancing loss are still those of the whole sequence. Each expert takes at most
  `ceil(capacity_factor * k * seq_len / E)` assignments of a sequence, first choices before
  second ones, in token order; the rest are dropped (the token passes through the residual).
  `capacity_factor = 0` is dropless: every assignment is computed.
- Experts are stored as stacked tensors (expert dimension first), so kiln/parallel/
  expert_parallel.py shards them by slicing dim 0. Tokens are sorted by expert and multiplied
  with torch's `F.grouped_mm`, whose group offsets stay on the device; where it does not run
  (`grouped_mm_runs`: CUDA needs bf16 on sm80+, and every device rows of 16-byte multiples) a loop
  over experts splits the rows at host-read counts, one host read per layer.
- Without expert parallelism the forward never reads the device from the host when
  `F.grouped_mm` runs: every assignment keeps its slot (fixed shapes, no boolean indexing, no
  bincount), a dropped one is sorted last and masked out with `torch.where`. Expert parallelism
  sorts the same way and sends each token once to every rank holding one of its kept experts
  (not once per expert), at the all-to-all's split sizes, which must be host integers (one read
  per layer); that rank returns the token's gated sum over its experts
  (kiln/parallel/functional.py `dispatch_and_combine`). The forward is steps around the experts
  and the all-to-all (`sort_by_expert`, `GroupedExperts.compute`, and without ep `weighted_sum`),
  which compile can take one by one (kiln/parallel/parallelize.py `apply_compile`).
- Under tensor parallelism (kiln/parallel/tensor_parallel.py, `MoETensorParallel`) the layer sees
  the whole sequence on every tp rank: routing, capacity and the aux/z losses are replicated and
  equal one process's; each rank computes a slice of every expert's hidden units, and its output
  is a partial sum that the style reduce-scatters back to the sequence shard. With expert
  parallelism as well, the all-to-all runs among the ep ranks of each tp coordinate. With
  parallel.etp=1 (`MoELocalSequence`, `sp_mesh`) each tp rank routes only its contiguous shard of
  every sequence instead: queue slots, the balancing loss and the z-loss are still those of the
  whole sequence (counts exchanged over tp, as over cp), and the all-to-all spans tp too. With
  cp as well, rank (c, t) holds the t-th tp slice of cp rank c's zig-zag chunks (`cp_sp_pieces`):
  the counts are exchanged over cp and tp, and the all-to-all spans cp and tp.
- The auxiliary losses of the last forward stay on the device (`last_aux_loss`,
  `last_z_loss`); the transformer adds them to its loss and exposes them for logging.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
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

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows sorted by local expert, `counts[e]` (a device tensor) rows for local expert e.
        Rows after the last expert's (`sum(counts)` onwards) are not computed: their output is
        undefined, for the caller to mask."""
        return self.compute(x, counts, *(self._local(w) for w in (self.w1, self.w2, self.w3)))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor | None) -> torch.Tensor:
        """The experts' math on local weights (no DTensor, no hook: what `apply_compile` compiles
        on its own under expert parallelism, see expert_parallel.py `compile_moe_steps`)."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x, w1, w2, w3 = (t.to(dtype) if t is not None else None for t in (x, w1, w2, w3))
        if grouped_mm_runs(x, w1):
            offs = counts.cumsum(0).to(torch.int32)
            h = self.act(F.grouped_mm(x, w1, offs=offs))
            if w3 is not None:
                h = h * F.grouped_mm(x, w3, offs=offs)
            return F.grouped_mm(h, w2, offs=offs)
        sizes = counts.tolist()  # host read: the loop needs its split sizes
        outs = []
        for e, chunk in enumerate(torch.split(x, [*sizes, x.shape[0] - sum(sizes)])[:len(sizes)]):
            h = self.act(chunk @ w1[e])
            if w3 is not None:
                h = h * (chunk @ w3[e])
            outs.append(h @ w2[e])
        outs.append(x.new_zeros(x.shape[0] - sum(sizes), w2.shape[-1]))
        return torch.cat(outs)


def _gather_over_sp(t: torch.Tensor, mesh) -> torch.Tensor:
    """The tp ranks' `t` concatenated on dim 0 (torch's DTensor Shard(0) -> Replicate all-gather).
    Its backward keeps each rank's own slice of the gradient, unsummed: every tp rank has the same
    loss and so the same upstream gradient (a summing all-gather backward would count it tp times)."""
    from torch.distributed.tensor import Shard

    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False).full_tensor()


def grouped_mm_runs(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: on CUDA bf16 on sm80+ (its kernels,
    and its meta function, take bf16 only); on CPU any float dtype; on both, row strides of
    16-byte multiples (model dim and expert hidden size)."""
    if not hasattr(F, "grouped_mm"):  # torch releases before grouped_mm (kiln declares torch>=2.6)
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its meta function (what compile traces with) takes bf16 only, on every device
    row = x.element_size()
    if x.shape[-1] * row % 16 or w1.shape[-1] * row % 16:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def cp_sp_pieces(seq_len: int, cp: int, sp: int, cp_rank: int, sp_rank: int) -> list[int]:
    """Which pieces of a sequence (in sequence order, pieces of gcd(chunk, slice) tokens) the rank
    (cp_rank, sp_rank) holds, in the order it holds them, when context parallelism gives cp rank r
    the zig-zag chunks (r, 2cp-1-r) of 2cp (kiln/parallel/functional.py `zigzag_chunks`),
    concatenated, and tp's sequence parallelism gives tp rank t the contiguous t-th of `sp` equal
    slices of that (parallel.etp=1 with cp: a slice may span both chunks when sp is odd)."""
    from kiln.parallel.functional import zigzag_chunks

    chunk, slice_len = seq_len // (2 * cp), seq_len // (cp * sp)
    piece = math.gcd(chunk, slice_len)
    per_chunk, per_slice = chunk // piece, slice_len // piece
    local = [c * per_chunk + i for c in zigzag_chunks(cp, cp_rank) for i in range(per_chunk)]
    return local[sp_rank * per_slice:(sp_rank + 1) * per_slice]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, hidden, cfg.activation)
        # Set by kiln.parallel.expert_parallel.apply_expert_parallel: None = all experts local.
        self.ep_group = None
        self.ep_node_groups = None  # and a two-level dispatch's (inter-node, intra-node) groups
        # Set by kiln.parallel.tensor_parallel.MoETensorParallel: the tp mesh the experts' hidden
        # units are sharded over; None = whole experts.
        self.tp_mesh = None
        # Set by kiln.parallel.context_parallel.ContextParallel around a training step: the cp group
        # over which each sequence is split; None = this rank sees whole sequences.
        self.cp_group = None
        # Set by kiln.parallel.tensor_parallel.MoELocalSequence (parallel.etp=1): the tp mesh over
        # which each sequence is split in contiguous shards, one per rank; None = not split over tp.
        self.sp_mesh = None
        self.router_kind, self.norm_gates, self.gate_scale = cfg.moe_router, cfg.moe_norm_gates, cfg.moe_gate_scale
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups
        # Auxiliary-loss-free balancing (model.moe_bias_update_rate > 0; `balance_experts`): a
        # per-expert bias added to the scores when choosing experts, kept in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts) if cfg.moe_bias_update_rate > 0 else None)
        self.last_load: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None

    def capacity(self, seq_len: int) -> int:
        if self.capacity_factor == 0:
            return seq_len * self.top_k  # dropless: room for every assignment
        return max(1, math.ceil(self.capacity_factor * self.top_k * seq_len / self.n_experts))

    def route(self, x: torch.Tensor):
        """x (B, T, D) -> every assignment (token index, expert, gate, kept), flat in (B, kT)
        order, and the aux losses."""
        bsz, seqlen, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):
            weight = self.router.weight  # tensor parallel: replicated, a DTensor
            if self.sp_mesh is not None or self.tp_mesh is not None:
                # each tp rank routes other tokens (sp), or sees the experts' outputs for its slice
                # of their hidden units only (tp): the router's gradient is partial over tp
                from kiln.parallel.functional import local_with_partial_grad

                weight = local_with_partial_grad(weight)
            elif isinstance(weight, DTensor):
                weight = weight.to_local()
            logits = F.linear(x.float(), weight.float())  # (B, T, E) fp32
        scores = logits.sigmoid() if self.router_kind == "sigmoid" else logits.softmax(dim=-1)
        if self.expert_bias is None and self.groups == 1:
            gates, experts = scores.topk(self.top_k, dim=-1)  # (B, T, k)
        else:  # DeepSeek-V3: the balancing bias picks the experts, the unbiased scores weigh them
            choice = scores
            if self.expert_bias is not None:
                bias = self.expert_bias.to_local() if isinstance(self.expert_bias, DTensor) else self.expert_bias
                choice = scores + bias
            if self.groups > 1:
                choice = self._within_best_groups(choice)
            experts = choice.topk(self.top_k, dim=-1).indices
            gates = scores.gather(-1, experts)
        if self.top_k > 1 and self.norm_gates:  # GShard, DeepSeek-V3: the k gates renormalized to sum to 1
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if self.gate_scale != 1.0:
            gates = gates * self.gate_scale
        # k-major order within each sequence: every token's first choice before any second choice.
        experts_km = experts.transpose(1, 2).reshape(bsz, self.top_k * seqlen)  # (B, kT)
        onehot = F.one_hot(experts_km, self.n_experts)  # (B, kT, E)
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        sp = 1 if self.sp_mesh is None else self.sp_mesh.size()
        if cp > 1 and sp > 1:
            position = self._cp_sp_positions(onehot)
        elif cp > 1:
            position = self._cp_positions(onehot)
        elif sp > 1:
            position = self._sp_positions(onehot)
        else:
            position = (onehot.cumsum(dim=1) * onehot).sum(-1) - 1  # slot of each assignment in its expert
        keep = position < self.capacity(seqlen * cp * sp)
        # Load balancing per sequence: f_e = share of the sequence's assignments (before dropping)
        # routed to e, P_e = mean router probability of e; E * sum_e f_e P_e, averaged over sequences.
        f = onehot.float().sum(dim=1)  # (B, E) counts
        # P_e from a distribution over the experts: sigmoid scores normalized (DeepSeek-V3 eq. 19)
        p = (scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)).sum(dim=1)
        if cp > 1:
            # Context parallel: the sums over the whole sequence (torch's differentiable
            # all-gather, summed). Every cp rank then has the same aux loss; its backward sums the
            # ranks' gradients, which the gradient average over cp turns into the one-process one.
            from kiln import torch_compat

            both = torch_compat.all_gather_autograd(torch.stack([f, p]), 0, self.cp_group)
            f, p = both.view(cp, 2, *f.shape).sum(0).unbind(0)
        z = torch.logsumexp(logits, dim=-1).square().mean()
        if sp > 1:  # tp ranks of one loss: sums over the whole sequence, each rank's gradient its own part
            f, p = _gather_over_sp(torch.stack([f, p]), self.sp_mesh).view(sp, 2, *f.shape).sum(0).unbind(0)
            z = _gather_over_sp(z[None], self.sp_mesh).mean()
        self.last_load = f.detach().sum(0)  # (E,) assignments of these sequences, whole on every cp/tp rank
        f, p = f / (self.top_k * seqlen * cp * sp), p / (seqlen * cp * sp)
        self.last_aux_loss = self.n_experts * (f * p).sum(-1).mean()
        self.last_z_loss = z
        self.last_dropped_fraction = (~keep).float().mean().detach()
        token = (torch.arange(bsz, device=x.device)[:, None] * seqlen
                 + torch.arange(seqlen, device=x.device).repeat(self.top_k)[None])  # (B, kT)
        gates_km = gates.transpose(1, 2).reshape(bsz, self.top_k * seqlen)
        return token.flatten(), experts_km.flatten(), gates_km.flatten(), keep.flatten()

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing: each group of E / groups experts is rated by the sum
        of its two best (biased) scores (its best alone for groups of one), and every expert outside
        a token's topk_groups best groups is ruled out (-inf)."""
        per = self.n_experts // self.groups
        grouped = choice.unflatten(-1, (self.groups, per))  # (B, T, G, E/G)
        rating = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # (B, T, G)
        best = rating.topk(self.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(rating, dtype=torch.bool).scatter_(-1, best, True)
        return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(-2)

    def _cp_positions(self, onehot: torch.Tensor) -> torch.Tensor:
        """Slots of this rank's assignments in their experts' queues for the whole sequence, when
        context parallelism holds the zig-zag chunks (r, 2cp-1-r) of every sequence
        (kiln/parallel/context_parallel.py)."""
        cp = dist.get_world_size(self.cp_group)
        return self._split_positions(onehot, self.cp_group, lambda q: (q, 2 * cp - 1 - q))

    def _sp_positions(self, onehot: torch.Tensor) -> torch.Tensor:
        """The same when tp rank r holds the contiguous chunk r of every sequence (parallel.etp=1)."""
        return self._split_positions(onehot, self.sp_mesh.get_group(), lambda q: (q,))

    def _cp_sp_positions(self, onehot: torch.Tensor) -> torch.Tensor:
        """The same under both (parallel.etp=1 with cp): cp rank r holds the zig-zag chunks of
        every sequence and tp rank t of it a contiguous slice of those (`cp_sp_pieces`); the
        all-gathers run over cp (outer) and tp (inner)."""
        cp, sp = dist.get_world_size(self.cp_group), self.sp_mesh.size()
        seq_len = onehot.shape[1] // self.top_k * cp * sp
        return self._split_positions(onehot, (self.cp_group, self.sp_mesh.get_group()),
                                     lambda q: cp_sp_pieces(seq_len, cp, sp, *divmod(q, sp)))

    @torch.no_grad()
    def _split_positions(self, onehot: torch.Tensor, groups, chunks_of) -> torch.Tensor:
        """Slots of this rank's assignments in their experts' queues for the whole sequence (first
        choices before second ones, in token order) when rank q holds the equal chunks
        `chunks_of(q)` (indices in sequence order) of every sequence, concatenated: the per-chunk
        counts of all ranks (one all-gather per group) give each chunk's offset. `groups` is one
        process group or a tuple of them, outer first: q = (outer rank) * (inner size) + inner rank."""
        groups = groups if isinstance(groups, tuple) else (groups,)
        rank = 0
        for g in groups:
            rank = rank * dist.get_world_size(g) + dist.get_rank(g)
        mine = list(chunks_of(rank))
        bsz, kt, n_exp = onehot.shape
        # (B, k, my chunks, chunk length, E)
        blocks = onehot.view(bsz, self.top_k, len(mine), kt // (len(mine) * self.top_k), n_exp)
        counts = blocks.sum(3)  # (B, k, my chunks, E)
        for g in reversed(groups):  # innermost first: the result is (outer, ..., inner, *counts.shape)
            parts = [torch.empty_like(counts) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, counts.contiguous(), group=g)
            counts = torch.stack(parts)
        gathered = counts.flatten(0, len(groups) - 1).unbind(0)
        n = len(gathered)
        whole = counts.new_empty(bsz, self.top_k, n * len(mine), n_exp)  # counts per chunk in sequence order
        for q, c in enumerate(gathered):
            for j, chunk in enumerate(chunks_of(q)):
                whole[:, :, chunk] = c[:, :, j]
        before = whole.flatten(1, 2).cumsum(1).view_as(whole) - whole  # assignments in earlier (k, chunk) blocks
        offset = before[:, :, mine]  # (B, k, my chunks, E)
        within = (blocks.cumsum(3) * blocks).sum(-1) - 1  # (B, k, my chunks, chunk length)
        position = within + (offset.unsqueeze(3) * blocks).sum(-1)
        return position.view(bsz, kt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routing and sorting, the experts, and the weighted sum, as three steps that
        kiln/parallel/parallelize.py `apply_compile` can compile one by one (expert_parallel.py
        `compile_moe_steps`), leaving the all-to-all and the experts' own FSDP unit eager."""
        token, gate, kept, counts, rows = self.sort_by_expert(x)
        if self.tp_mesh is not None:
            # Under tp (MoETensorParallel) the experts see a slice of the hidden units: the
            # gradients they send back to their replicated inputs, the tokens and the gates, are
            # partial sums and stay so: the router weight's is summed once a step (route), x's by
            # the reduce-scatter of the block's input gather. The aux and z-losses, the same on
            # every tp rank, join them with a 1/tp share each.
            from kiln.parallel.functional import grad_share_over_tp

            self.last_aux_loss = grad_share_over_tp(self.last_aux_loss, self.tp_mesh)
            self.last_z_loss = grad_share_over_tp(self.last_z_loss, self.tp_mesh)
        if self.ep_group is None:
            mask = kept[:, None]
            # Dropped rows go in as zeros and come out masked (where, not a product: the experts
            # leave them undefined, and a product would carry a NaN into the gradients).
            y = torch.where(mask, self.experts(torch.where(mask, rows, 0), counts), 0)
            return self.weighted_sum(y, token, gate, x)
        # Expert parallel: the tokens go to the experts' ranks (once per rank, the dropped
        # assignments stay home), which return each token's gated sum over their experts
        from kiln.parallel.functional import dispatch_and_combine

        y = dispatch_and_combine(x.reshape(-1, x.shape[-1]), token, gate, counts, self.experts, self.ep_group,
                                 self.ep_node_groups)
        return y.view(x.shape).to(x.dtype)

    def sort_by_expert(self, x: torch.Tensor):
        """Route x and sort every assignment by expert: kept ones grouped by expert, in (sequence,
        k-major) order within an expert; dropped ones (sort key E) last. Returns the sorted token
        index, gate and kept flag of each assignment, the kept count per expert and the rows
        (x at each assignment's token; None under expert parallelism, which sends each token once
        per rank instead). Fixed shapes, no host read: counts by scatter_add
        (bincount reads its max on the host), drops masked rather than removed."""
        dim = x.shape[-1]
        token, expert, gate, keep = self.route(x)
        order = torch.argsort(torch.where(keep, expert, self.n_experts), stable=True)
        token, expert, gate, kept = token[order], expert[order], gate[order], keep[order]
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(0, expert, kept.long())
        rows = x.reshape(-1, dim)[token] if self.ep_group is None else None
        return token, gate, kept, counts, rows

    def weighted_sum(self, y: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each token's output: the sum of its assignments' expert outputs times their gates
        (index_put accumulating, not index_add, whose backward would keep the weighted rows)."""
        out = torch.zeros(x.shape[0] * x.shape[1], x.shape[2], device=x.device, dtype=y.dtype)
        out = out.index_put((token,), y * gate[:, None].to(y.dtype), accumulate=True)
        return out.view(x.shape).to(x.dtype)


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


@torch.no_grad()
def balance_experts(moes: list[MoE], loads: torch.Tensor, skipped: torch.Tensor, rate: float,
                    group=None) -> torch.Tensor:
    """After an optimizer step: the step's largest expert load relative to its layer's mean (1:
    balanced; a device scalar, logged as `moe_max_load`) and, with rate > 0, auxiliary-loss-free
    load balancing (DeepSeek-V3, sec. 2.1.2; Wang et al. 2024): each layer's `expert_bias` moves
    by `rate` towards balance, up for an expert that took fewer assignments than the layer's mean
    over the step, down for one that took more.

    `loads` (layers, E): this rank's assignments per expert over the step's micro-batches (before
    capacity drops), counted over whole sequences (`MoE.last_load`: cp and tp ranks hold the same
    counts), so the sum over `group` (the data-parallel ranks, which see other sequences) is the
    global batch's and every rank moves its bias alike, as one process would. Float64 keeps
    counts of large global batches exact. A `skipped` step (non-finite; a device bool) leaves the
    biases as they were. Hand-written: torch has no such update (torchtitan has its own)."""
    if group is not None:
        dist.all_reduce(loads, group=group)
    mean = loads.mean(dim=-1, keepdim=True)
    if rate > 0:
        delta = rate * torch.sign(mean - loads)
        delta = torch.where(skipped, torch.zeros_like(delta), delta)
        for moe, d in zip(moes, delta):
            bias = moe.expert_bias.to_local() if isinstance(moe.expert_bias, DTensor) else moe.expert_bias
            bias.add_(d.to(bias.dtype))
    return (loads / mean).max().float()
