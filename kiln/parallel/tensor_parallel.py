"""Tensor parallel + sequence parallel + loss parallel for kiln's transformer (Megatron-LM style).

Everything here is torch's DTensor API (`parallelize_module` with ColwiseParallel /
RowwiseParallel / SequenceParallel / PrepareModuleInput, and `loss_parallel`); kiln's own code is
the plan (which module gets which style, following torchtitan's Llama plan) and the autograd
wrapper that keeps the loss's backward inside `loss_parallel` without the caller knowing.

Layout of the residual stream: sharded on the sequence (Shard(1)) between the blocks, as plain
local tensors. Norms and dropout run on the local sequence shard (SP); attention and the MLP
gather the sequence (PrepareModuleInput -> Replicate), shard heads / hidden units over the tp
ranks (q/k/v and w1/w3 column-wise, wo and w2 row-wise, biases included), and reduce-scatter
back to the sequence shard. The token embedding is row-wise (vocab-sharded table, output
reduce-scattered to Shard(1)); learned positions are row-wise too, with their output sharded on
dim 0 of the (seq, dim) lookup, which is exactly the local sequence shard of the tokens. RoPE
tables stay replicated: attention sees the whole sequence. The LM head is column-wise: logits
stay sharded on the vocabulary (a DTensor) and the cross-entropy runs under `loss_parallel`, so no
rank ever holds the full (tokens x vocab) logits.

Under pipeline parallelism the plan covers one pipeline rank's modules (`tp_plan` on a
`PipelineModel`); the stages pass the sequence-sharded residual stream between them unchanged.

Tied embeddings keep working: the embedding (row-wise) and the head (column-wise) both shard the
shared (vocab, dim) weight on dim 0 over the same mesh, and `Transformer.to_empty` re-ties them
after materialization, so the tie holds with identical placements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def tp_plan(model: nn.Module) -> dict[str, object]:
    """Module FQN -> ParallelStyle for `parallelize_module`, for both architectures (rope or
    learned positions, RMSNorm or LayerNorm with bias, pre- or post-norm, gated or plain MLP).

    `model` is the whole `Transformer` or one pipeline rank's `PipelineModel`
    (kiln/parallel/pipeline.py), which holds only some layers (`layers` keyed by the layer index)
    and the embeddings / final norm and head only on the first / last stage: the plan covers the
    modules that are there, under their names."""
    plan: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "pos_embeddings", None) is not None:
        # positions (seq,) -> (seq, dim), sharded on seq like the token embeddings' Shard(1).
        plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if getattr(model, "output", None) is not None:
        # Logits stay a vocab-sharded DTensor for loss_parallel (use_local_output=False).
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if _has_params(model.norm):
            plan["norm"] = SequenceParallel(use_local_output=True)
    for key, block in model.layers.named_children():
        p = f"layers.{key}"
        for norm in ("attention_norm", "ffn_norm"):
            if _has_params(getattr(block, norm)):
                # Local outputs: post-norm blocks add them to plain residual tensors.
                plan[f"{p}.{norm}"] = SequenceParallel(use_local_output=True)
        # attention(x, rope, cache, start_pos): only x is a tensor to gather.
        plan[f"{p}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None))
        for name in ("wq", "wk", "wv"):
            plan[f"{p}.attention.{name}"] = ColwiseParallel()
        plan[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{p}.feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{p}.feed_forward.w1"] = ColwiseParallel()
        if block.feed_forward.w3 is not None:
            plan[f"{p}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{p}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (on the meta device, before materialization) over `tp_mesh` in place."""
    parallelize_module(model, tp_mesh, tp_plan(model))


class _LossParallel(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits. Forward computes the loss and its gradient
    under `loss_parallel` (torch's sharded log-softmax / nll handlers need the context in backward
    too, and the step calls backward outside the model); backward scales the saved gradient."""

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_()
            loss = F.cross_entropy(leaf.float().flatten(0, 1), targets.flatten(0, 1))
            (grad,) = torch.autograd.grad(loss, leaf)
        ctx.save_for_backward(grad)
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        local = grad.to_local() * grad_output  # grad_output: a plain scalar, the same on every rank
        return DTensor.from_local(local, grad.device_mesh, grad.placements, shape=grad.shape,
                                  stride=grad.stride()), None


def parallel_lm_loss(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (a plain replicated scalar) of logits sharded on the vocabulary."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LossParallel.apply(logits, targets)
    with loss_parallel():  # eval: no gradient to keep
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1)).to_local()
