"""The differentiable parallel operations a parallelized model calls in its forward
(kiln/model/moe.py, kiln/model/transformer.py): torch collectives and DTensor redistributions with
the gradients Megatron-LM and torchtitan give them, and context parallelism's chunk map. They live
apart from the modules that lay a model out (tensor_parallel.py, expert_parallel.py,
context_parallel.py), which import the model to find its blocks: the model imports only this
module of kiln/parallel, and this module nothing of the model but its loss (kiln/model/loss.py).

- `grad_share_over_tp`: the identity, its gradient divided by tp, for a value every tp rank
  computes alike whose gradient joins partial ones that are summed over tp later.
- `local_with_partial_grad`: a replicated DTensor parameter's local tensor whose gradient is left a
  pending sum (Partial), settled once a step.
- `parallel_lm_loss`, `parallel_chunked_lm_loss`: the mean loss of vocabulary-sharded logits, or of
  a column-parallel head without the logits (train.loss = "chunked").
- `dispatch_and_combine`: expert parallelism's all-to-alls around this rank's experts, one row
  per token and destination rank.
- `zigzag_chunks`: the two chunks of each sequence a context-parallel rank holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from kiln import torch_compat
from kiln.model.loss import CHUNK_TOKENS, IGNORE_INDEX, chunked_lm_loss


def local_with_partial_grad(param: DTensor) -> torch.Tensor:
    """The local tensor of a replicated DTensor parameter whose gradient each rank computes only in
    part (the MoE router under tp: its gates see the experts' outputs for this rank's hidden slice
    only, or, ep borrowing tp, it routes this rank's sequence shard only), the gradient accumulated
    as a Partial DTensor over the micro-batches and summed once a step by kiln/train/step.py
    settle_grad_placements, as sequence parallelism's norm weights are; not an all-reduce in every
    micro-batch's backward."""
    return param.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)


def grad_share_over_tp(t: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """`t` unchanged; its gradient divided by tp. For a value every tp rank computes alike (the
    MoE's aux and z-losses, from the whole gathered sequence) whose gradient joins partial ones
    (the experts' hidden slices', through the gates) that are summed over tp afterwards (the
    router weight's settle, the block input's reduce-scatter): every rank's identical share then
    sums to it once (kiln/model/moe.py, MoETensorParallel). Plain tensor ops (the value exactly t:
    the added term is zero), which dynamo traces where a custom autograd.Function failed."""
    frozen = t.detach()
    return frozen + (t - frozen) / tp_mesh.size()


class _LossParallel(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits. Forward computes the loss and its gradient
    under `loss_parallel` (torch's sharded log-softmax / nll handlers need the context in backward
    too, and the step calls backward outside the model); backward scales the saved gradient."""

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_()
            loss = F.cross_entropy(leaf.float().flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE_INDEX)
            (grad,) = torch.autograd.grad(loss, leaf)
        ctx.save_for_backward(grad)
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        local = grad.to_local() * grad_output  # grad_output: a plain scalar, the same on every rank
        return DTensor.from_local(local, grad.device_mesh, grad.placements, shape=grad.shape,
                                  stride=grad.stride()), None


@torch.compiler.disable  # dynamo traces the loss without loss_parallel's context (mixed Tensor/DTensor)
def parallel_lm_loss(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (a plain replicated scalar) of logits sharded on the vocabulary; eager
    under a whole-model compile (parallelize.apply_compile)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LossParallel.apply(logits, targets)
    with loss_parallel():  # eval: no gradient to keep
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1),
                               ignore_index=IGNORE_INDEX).to_local()


def parallel_chunked_lm_loss(hidden: torch.Tensor, weight: DTensor, targets: torch.Tensor,
                             chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """`train.loss = "chunked"` under tp: the mean next-token loss (a plain replicated scalar) of
    the column-wise head `weight` (Shard(0) on the tp mesh: vocabulary rows) over the hidden states
    `hidden`, this rank's sequence shard (Shard(1), as the head's ColwiseParallel input), without
    the (tokens x vocab/tp) fp32 logits. The layout is the head's own, by DTensor: the sequence is
    all-gathered and the partial hidden gradient of each rank's vocabulary rows reduce-scattered
    back to the sequence shard; the chunked vocab-parallel cross-entropy is kiln/model/loss.py's."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"the chunked tp loss wants the head weight Shard(0) on a 1-D tp mesh, got "
                         f"{weight.placements} on {mesh}")
    full = (DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
            .to_local(grad_placements=[Partial()]))
    _, offset = torch_compat.shard_size_and_offset(weight.shape[0], mesh.size(), mesh.get_local_rank())
    return chunked_lm_loss(full, weight.to_local(), targets, chunk, vocab_offset=offset, group=mesh.get_group(),
                           vocab_size=weight.shape[0])


def dispatch_and_combine(x: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, counts: torch.Tensor, experts,
                         group, node_groups=None) -> torch.Tensor:
    """Expert parallelism's exchange, once per destination rank (DeepEP's dispatch layout): the
    MoE output (x.shape[0], dim) of this rank's tokens `x`, the gated sum of their experts.

    `token`, `gate`: every assignment sorted by global expert, `counts[e]` kept for expert e, the
    dropped ones after them (MoE.sort_by_expert). A token whose top-k experts share a rank goes
    there once, not once per expert: each rank receives its unique (token, rank) rows plus, per
    assignment, the row's index and the gate; it runs its experts on every assignment, sums each
    row's gated outputs, and sends one row back per token, which this rank adds up over the ranks.
    For top-8 of 256 experts routed uniformly that is ~7.7 rows per token each way instead of 8 on
    64 ranks, ~5.3 on 8 (DeepSeek-V3's layer on one node), ~3.7 on 4. The index and gate (two
    float64 scalars per assignment) go in one more exchange. Dropped assignments never leave this
    rank. One host read of the split sizes per layer, as before (the all-to-all needs host ints).

    `node_groups` (inter, intra), parallel.ep_node_ranks: the ep ranks split into nodes of
    consecutive ranks. The exchange is then two-level, DeepEP's internode layout: a token crosses
    to each node holding one of its experts once, to the rank there at its own place in the node
    (`inter`), which passes it on once to each rank of its node holding one of them (`intra`); the
    gated sums come back the same way, summed on each level."""
    if node_groups is None:
        return _exchange(x, token, gate, counts, experts.n_local, group,
                         lambda *received: _local_experts(*received, experts))
    inter, intra = node_groups
    per_node = experts.n_local * dist.get_world_size(intra)
    return _exchange(x, token, gate, counts, per_node, inter,
                     lambda *received: _through_node(*received, experts, intra))


def _exchange(x, token, gate, counts, per_dest: int, group, remote) -> torch.Tensor:
    """One level of the exchange: destination rank of `group` = expert // per_dest; `remote(rows,
    row, gate, counts)` on the destination turns the received unique rows, each assignment's row
    and gate (grouped by source, then expert) and the per-(source, expert) counts into one gated
    sum per received row."""
    ep, n_tokens, n_assign = dist.get_world_size(group), x.shape[0], token.shape[0]
    # each assignment's destination rank (ep: dropped), from the kept counts, without a host read
    ends = counts.cumsum(0)
    expert = torch.searchsorted(ends, torch.arange(n_assign, device=x.device), right=True)
    dest = torch.clamp(expert // per_dest, max=ep)
    # needed[r, t]: token t has an assignment on rank r; its row's place in r's block by cumsum
    needed = torch.zeros(ep + 1, n_tokens, dtype=torch.long, device=x.device)
    needed.index_put_((dest, token), torch.ones_like(token))
    needed = needed[:ep]
    place = needed.cumsum(1) - 1
    meta = torch.cat([counts.view(ep, per_dest), needed.sum(1, keepdim=True)], 1)  # per rank: assignments, rows
    meta_in = torch.empty_like(meta)
    dist.all_to_all_single(meta_in, meta, group=group)
    # One host read: assignments and rows sent to / received from each rank.
    send_assign, recv_assign, send_rows, recv_rows = torch.stack([
        meta[:, :per_dest].sum(1), meta_in[:, :per_dest].sum(1), meta[:, per_dest], meta_in[:, per_dest]]).tolist()
    sent, n_rows = sum(send_assign), sum(send_rows)
    # the rows in (rank, token) order: scattered to their places, the unneeded into a spare slot
    flat = needed.view(-1)
    slot = torch.where(flat.bool(), flat.cumsum(0) - 1, n_rows)
    row_token = torch.zeros(n_rows + 1, dtype=torch.long, device=x.device).scatter_(
        0, slot, torch.arange(n_tokens, device=x.device).repeat(ep))[:n_rows]
    rows_in = funcol.all_to_all_single_autograd(x[row_token], recv_rows, send_rows, group)
    # each assignment's row (float64 holds it exactly) and gate (differentiable), in one exchange
    pairs = torch.stack([place[dest[:sent], token[:sent]].double(), gate[:sent].double()], 1)
    pairs_in = funcol.all_to_all_single_autograd(pairs, recv_assign, send_assign, group)
    index_in, gate_in = pairs_in[:, 0].detach().long(), pairs_in[:, 1]
    # received assignments come grouped by source rank, then expert: rows by source offset
    offsets = torch.tensor([0, *recv_rows[:-1]], device=x.device).cumsum(0)
    row = index_in + offsets.repeat_interleave(torch.tensor(recv_assign, device=x.device), output_size=len(index_in))
    summed = remote(rows_in, row, gate_in, meta_in[:, :per_dest])
    back = funcol.all_to_all_single_autograd(summed, send_rows, recv_rows, group)
    # index_put (accumulate), not index_add, for the sums: autograd keeps only their indices
    # (index_add's backward keeps its whole source: one more row matrix per layer)
    return back.new_zeros(n_tokens, back.shape[1]).index_put((row_token,), back, accumulate=True)


def _local_experts(rows, row, gate, counts_in, experts) -> torch.Tensor:
    """This rank's experts on every received assignment, gated and summed per received row."""
    out = _expert_outputs(rows[row], counts_in.reshape(-1), counts_in.sum(0), experts)
    return out.new_zeros(rows.shape[0], out.shape[1]).index_put((row,), out * gate[:, None].to(out.dtype),
                                                                accumulate=True)


def _through_node(rows, row, gate, counts_in, experts, intra) -> torch.Tensor:
    """The first level's destination: the rows received from other nodes passed on within this
    node (its experts sorted as `_exchange` takes them), the gated sums per received row."""
    per_node = counts_in.shape[1]
    expert = torch.arange(per_node, device=rows.device).repeat(counts_in.shape[0]).repeat_interleave(
        counts_in.reshape(-1), output_size=row.shape[0])
    order = torch.argsort(expert, stable=True)
    return _exchange(rows, row[order], gate[order], counts_in.sum(0), experts.n_local, intra,
                     lambda *received: _local_experts(*received, experts))


def _expert_outputs(received: torch.Tensor, counts_in: torch.Tensor, per_expert: torch.Tensor, experts) -> torch.Tensor:
    """The local experts on the received rows, which come grouped by source rank, then expert:
    regrouped by local expert for them, and back to the order received."""
    n_local = per_expert.shape[0]
    local_expert = torch.arange(n_local, device=received.device).repeat(counts_in.shape[0] // n_local)
    order = torch.argsort(local_expert.repeat_interleave(counts_in, output_size=received.shape[0]), stable=True)
    out_sorted = experts(received[order], per_expert)
    return torch.empty_like(out_sorted).index_copy(0, order, out_sorted)


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank
