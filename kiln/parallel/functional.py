"""The differentiable parallel operations a parallelized model calls in its forward
(kiln/model/moe.py, kiln/model/transformer.py): torch collectives and DTensor redistributions with
the gradients Megatron-LM and torchtitan give them, and context parallelism's chunk map. They live
apart from the modules that lay a model out (tensor_parallel.py, expert_parallel.py,
context_parallel.py), which import the model to find its blocks: the model imports only this
module of kiln/parallel, and this module nothing of the model but its loss (kiln/model/loss.py).

- `sum_grad_over_tp`: the identity, its gradient summed over tp (Megatron's "f").
- `parallel_lm_loss`, `parallel_chunked_lm_loss`: the mean loss of vocabulary-sharded logits, or of
  a column-parallel head without the logits (train.loss = "chunked").
- `dispatch_and_combine`: expert parallelism's two all-to-alls around this rank's experts.
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


def sum_grad_over_tp(t: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """`t` unchanged; its gradient summed over the tp ranks (Megatron's "f" operator), for a
    replicated tensor read by a computation whose weights are sharded. DTensor's own rules: a
    Replicate tensor whose local gradient is declared Partial is all-reduced in backward."""
    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


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


def dispatch_and_combine(rows: torch.Tensor, counts: torch.Tensor, experts, group) -> torch.Tensor:
    """rows: this rank's routed token copies sorted by global expert, `counts[e]` for expert e,
    the dropped ones after them (MoE.sort_by_expert). Returns the experts' outputs for those rows,
    in the same order, zeros for the dropped ones (which never leave this rank)."""
    ep = dist.get_world_size(group)
    n_local = experts.n_local
    # counts_in[s * n_local + e]: rows that rank s sends to local expert e.
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    # Split sizes must be host ints: one host read per MoE layer (as in every all-to-all MoE).
    recv_matrix = counts_in.view(ep, n_local)
    send_splits, recv_splits = torch.stack([counts.view(ep, n_local).sum(1), recv_matrix.sum(1)]).tolist()
    sent = sum(send_splits)
    received = funcol.all_to_all_single_autograd(rows[:sent], recv_splits, send_splits, group)
    out = _expert_outputs(received, counts_in, recv_matrix.sum(0), experts)
    back = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)
    return torch.cat([back, back.new_zeros(rows.shape[0] - sent, back.shape[1])])


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
