"""Next-token losses: the plain one over full logits, and a chunked LM head + cross-entropy that
never holds the (tokens x vocab) logits in fp32, on one process or with the head sharded on the
vocabulary over a tensor-parallel group.

`lm_loss` is the reference: logits (bf16 under autocast) -> fp32 -> cross-entropy, targets equal
to IGNORE_INDEX left out of the mean (torch's default). At GPT-2 124M shapes (12 x 1024 tokens,
vocab 50304) its fp32 logits alone are 2.5 GB, written and read again by softmax and its backward.

`chunked_lm_loss` is kiln's own (the idea is Liger-Kernel's fused linear cross-entropy, written
here in plain PyTorch so it runs on any device and under torch.compile): the head matmul and the
cross-entropy run over chunks of tokens, and the gradients with respect to the hidden states and
the head weight are computed in the same pass, chunk by chunk. The backward then only scales the
saved gradients, so peak memory holds one chunk's logits instead of all of them and nothing is
recomputed. Under autocast the matmuls run in the autocast dtype and softmax in fp32, as in
`lm_loss`.

Vocab-parallel (`vocab_offset`, `group`; Megatron-LM's vocab-parallel cross-entropy, per chunk):
`weight` is this rank's rows [offset, offset + V_local) of the head, `hidden` every token's
hidden state (the same on every rank of `group`). Each rank takes the log-sum-exp of its logit
slice and the target logit where it owns the target (0 elsewhere); one all-gather of those two
rows per chunk, then log-sum-exp over the ranks and a sum, gives every rank the full-vocabulary
values (one collective per chunk instead of Megatron's max / sum-exp / target all-reduces; the
per-rank log-sum-exps keep it as stable as a global max shift). The returned hidden gradient is
this rank's partial sum (its vocabulary rows only): the caller sums it over the group, and the
weight gradient is this rank's shard's. kiln/parallel/functional.py `parallel_chunked_lm_loss`
does the layout around it (the sequence-sharded hidden gathered, its gradient reduce-scattered).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.torch_compat import all_gather_single

CHUNK_TOKENS = 4096
IGNORE_INDEX = -100  # F.cross_entropy's default: such targets count in neither the sum nor the mean


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (logits may be bf16 under autocast); targets equal to
    IGNORE_INDEX are left out."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def combine_over_vocab_shards(lse: torch.Tensor, target_logit: torch.Tensor,
                              group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-sum-exp, target logit) of the whole vocabulary from each rank's over its own
    rows: one all-gather of both, then log-sum-exp and sum over the ranks. No group: unchanged."""
    if group is None:
        return lse, target_logit
    both = torch.stack([lse, target_logit])
    ranks = dist.get_world_size(group)
    gathered = both.new_empty((ranks * 2, *lse.shape))  # the concatenated form (gloo has no stacked one)
    all_gather_single(gathered, both, group=group)
    gathered = gathered.view(ranks, 2, *lse.shape)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype | None, vocab_offset: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        n = hidden.shape[0]
        w = weight if compute_dtype is None else weight.to(compute_dtype)
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if needs_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # The mean is over the counted targets (none: nan, as lm_loss); a device tensor, no host sync.
        counted = (targets != IGNORE_INDEX).sum().float()
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            h = h if compute_dtype is None else h.to(compute_dtype)
            t = targets[start:start + chunk]
            local_t = t - vocab_offset
            owned = (local_t >= 0) & (local_t < weight.shape[0])  # IGNORE_INDEX is owned by no rank
            index = torch.where(owned, local_t, 0)[:, None]
            logits = (h @ w.t()).float()
            target_logit = torch.where(owned, logits.gather(1, index).squeeze(1), 0.0)
            # exp(logits - row max) in place of the logits (no second chunk-sized buffer, as
            # torch.logsumexp would take); log-sum-exp from its row sums.
            row_max = logits.amax(dim=-1)
            probs = logits.sub_(row_max[:, None]).exp_()
            lse = row_max + probs.sum(dim=-1).log()
            lse, target_logit = combine_over_vocab_shards(lse, target_logit, group)
            counts = t != IGNORE_INDEX
            total += torch.where(counts, lse - target_logit, 0.0).sum()
            if needs_h or needs_w:
                # d(mean CE)/d logits = (softmax - onehot) / counted, 0 on an ignored target's row;
                # softmax = exp(logits - row max) * exp(row max - lse): one pass over the chunk.
                row_scale = counts / counted.clamp(min=1)
                grad = probs.mul_((torch.exp(row_max - lse) * row_scale)[:, None])
                grad.scatter_add_(1, index, -(owned * row_scale)[:, None])
                grad = grad.to(w.dtype)
                if needs_h:
                    grad_hidden[start:start + chunk] = (grad @ w).to(hidden.dtype)
                if needs_w:
                    grad_weight += (grad.t() @ h).float()
                del grad
            del logits, probs  # before the next chunk's matmul: one chunk's logits live, not two
        ctx.save_for_backward(grad_hidden if needs_h else None, grad_weight if needs_w else None)
        ctx.weight_dtype = weight.dtype
        return total / counted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk: int = CHUNK_TOKENS, *, vocab_offset: int = 0,
                    group: dist.ProcessGroup | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` without full fp32 logits.

    hidden: (..., dim), weight: (vocab, dim), targets: (...) int64 (IGNORE_INDEX: not counted).
    Under autocast the matmuls use the autocast dtype (as `nn.Linear` would); the loss and softmax
    are fp32. With `group`: `weight` holds the vocabulary rows from `vocab_offset` on, split over
    the group's ranks, and the hidden gradient is this rank's partial sum (module docstring);
    `vocab_size` is then the whole vocabulary (default: this rank's rows).

    A target outside [0, vocab) other than IGNORE_INDEX fails as `lm_loss`'s gather would (the
    masked gather here would silently count its logit as 0): an on-device assert, no host sync.
    """
    vocab = vocab_size if vocab_size is not None else vocab_offset + weight.shape[0]
    flat = targets.reshape(-1)
    torch._assert_async(((flat == IGNORE_INDEX) | ((flat >= 0) & (flat < vocab))).all(),
                        f"chunked_lm_loss: a target is outside [0, {vocab}) and is not {IGNORE_INDEX}")
    compute_dtype = None
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                flat, chunk, compute_dtype, vocab_offset, group)
