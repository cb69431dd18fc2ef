"""Next-token losses: the plain one over full logits, and a chunked LM head + cross-entropy that
never holds the (tokens x vocab) logits in fp32.

`lm_loss` is the reference: logits (bf16 under autocast) -> fp32 -> cross-entropy. At GPT-2 124M
shapes (12 x 1024 tokens, vocab 50304) its fp32 logits alone are 2.5 GB, written and read again
by softmax and its backward.

`chunked_lm_loss` is kiln's own (the idea is Liger-Kernel's fused linear cross-entropy, written
here in plain PyTorch so it runs on any device and under torch.compile): the head matmul and the
cross-entropy run over chunks of tokens, and the gradients with respect to the hidden states and
the head weight are computed in the same pass, chunk by chunk. The backward then only scales the
saved gradients, so peak memory holds one chunk's logits instead of all of them and nothing is
recomputed. Under autocast the matmuls run in the autocast dtype and softmax in fp32, as in
`lm_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 4096


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype | None) -> torch.Tensor:
        n = hidden.shape[0]
        w = weight if compute_dtype is None else weight.to(compute_dtype)
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if needs_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            h = h if compute_dtype is None else h.to(compute_dtype)
            t = targets[start:start + chunk]
            logits = (h @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if needs_h or needs_w:
                # d(mean CE)/d logits = (softmax - onehot) / n, formed in place in the fp32 logits.
                grad = logits.sub_(lse[:, None]).exp_()
                grad.scatter_add_(1, t[:, None], torch.full_like(t[:, None], -1, dtype=grad.dtype))
                grad = grad.div_(n).to(w.dtype)
                if needs_h:
                    grad_hidden[start:start + chunk] = (grad @ w).to(hidden.dtype)
                if needs_w:
                    grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden if needs_h else None, grad_weight if needs_w else None)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` without full fp32 logits.

    hidden: (..., dim), weight: (vocab, dim), targets: (...) int64. Under autocast the matmuls
    use the autocast dtype (as `nn.Linear` would); the loss and softmax are fp32.
    """
    compute_dtype = None
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                targets.reshape(-1), chunk, compute_dtype)
