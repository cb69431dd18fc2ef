"""Ring attention's block math (kiln/parallel/ring_attention.py): one query chunk against one key
chunk, forward and backward, and the online merge of the blocks' partial results.

A block is q (B, Hkv, rep, S, D) against k / v (B, Hkv, S, D), fp32, S the chunk length: GQA
without repeating K/V in the layout the ring carries. Its forward gives the block's own softmax
output and log-sum-exp, -inf (output 0) on rows the block masks whole (a sliding window's rows met
before their diagonal); `merge_block` folds it into the rows' running (output, log-sum-exp) as
ring-flash-attention does. Its backward takes the rows' final output and log-sum-exp, so P is the
global softmax's and the block's dQ/dK/dV are exactly its share.

Two kernels, the same numbers (within fp32 rounding):
- CPU without dropout: torch's fused flash-attention kernel for CPU
  (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward: private ops, the same
  signature over torch 2.6-2.13; K/V heads repeated for it, since 2.6 mishandles GQA there). It
  never holds a block's (S, S) scores: a ring layer 2.3x faster than with the matmul kernel at
  S = 512 and 4.5x at S = 4096, with 11.6x fewer peak bytes there (benchmarks/ring_attention.py).
  A sliding window's partial blocks pass their mask as one (S, S) additive tensor.
- Otherwise (GPUs, whose fused ops differ in signature and are untested here, and attention
  dropout, whose per-block masks `block_keep` draws so that the backward draws them again): a
  plain matmul block attention written here (scores, exp, matmul), kiln's own.
"""

from __future__ import annotations

import torch


def block_mask(chunks: tuple[int, int], size: int, window: int, device) -> torch.Tensor | None:
    """Where query chunk a's tokens may attend to key chunk b's (True), or None where all may: key
    j of b is (a - b) * size + i - j positions behind query i of a, allowed from 0 (causal) up to
    window - 1 (sliding window; 0: no limit)."""
    a, b = chunks
    if b < a and not (window and (a - b) * size + size - 1 >= window):
        return None
    offsets = torch.arange(size, device=device)
    behind = (a - b) * size + offsets[:, None] - offsets[None, :]
    return (behind >= 0) & (behind < window) if window else behind >= 0


def _plain_causal(chunks: tuple[int, int], size: int, window: int, documents) -> bool:
    """A chunk against itself with no window or document cutting into it: the causal triangle."""
    return chunks[0] == chunks[1] and (not window or window >= size) and documents is None


def allowed_keys(chunks: tuple[int, int], size: int, window: int, documents: torch.Tensor | None,
                 device) -> torch.Tensor | None:
    """`block_mask`, and with packed documents (`documents` (B, S, S): query i and key j of the
    block in the same document) only within them: None (all allowed), (S, S) or (B, S, S)."""
    allowed = block_mask(chunks, size, window, device)
    if documents is None:
        return allowed
    return documents if allowed is None else documents & allowed


def block_keep(seed: int, chunks: tuple[int, int], shape, dropout_p: float, device) -> torch.Tensor:
    """The dropout multiplier of one block of attention probabilities: 0 where dropped, 1/(1-p)
    where kept, the same for the same (seed, query chunk, key chunk) on every call and rank."""
    a, b = chunks
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + a * 65_537 + b) % (2**63))
    keep = torch.rand(shape, generator=g, device=device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def fused_kernel(device: torch.device, dropout: bool) -> bool:
    """Whether blocks run torch's fused CPU flash-attention kernel (see the module doc)."""
    return device.type == "cpu" and not dropout


def _over_heads(t: torch.Tensor, per_batch: bool, heads: int) -> torch.Tensor:
    """A mask (or a row flag) per batch row (`per_batch`, batch first) made to broadcast over
    `heads` head dimensions after the batch; one shared by every batch row as it is."""
    return t.view(t.shape[0], *([1] * heads), *t.shape[1:]) if per_batch else t


def _fused_args(q, k, v, chunks, size, window, documents):
    """q, k and v as the fused kernel takes them ((B, H, S, D), K/V heads repeated), its causal
    flag and additive mask for this block, and the block's allowed keys (None: all, or causal)."""
    bsz, n_kv, rep, length, head_dim = q.shape
    q4 = q.reshape(bsz, n_kv * rep, length, head_dim)
    k4, v4 = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k, v))
    if _plain_causal(chunks, size, window, documents):
        return q4, k4, v4, True, None, None
    allowed = allowed_keys(chunks, size, window, documents, q.device)
    if allowed is None:
        return q4, k4, v4, False, None, None
    mask = torch.zeros(allowed.shape, device=q.device).masked_fill(~allowed, float("-inf"))
    return q4, k4, v4, False, _over_heads(mask, documents is not None, 1), allowed


def forward_block(q, k, v, chunks, size: int, window: int, scale: float, keep=None, documents=None):
    """The block's softmax output (q's shape) and log-sum-exp (q's shape less D); rows it masks
    whole: output 0, log-sum-exp -inf. `keep`: the block's dropout multiplier (`block_keep`) on
    the probabilities that weigh V only; `documents`: see `allowed_keys`."""
    if fused_kernel(q.device, keep is not None):
        q4, k4, v4, causal, mask, allowed = _fused_args(q, k, v, chunks, size, window, documents)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal,
                                                                              attn_mask=mask, scale=scale)
        lse = lse.view(q.shape[:-1])
        if allowed is not None:  # the kernel gives a wholly masked row lse 0 (and output 0)
            lse = lse.masked_fill(_over_heads(~allowed.any(-1), documents is not None, 2), float("-inf"))
        return out.view(q.shape), lse
    allowed = allowed_keys(chunks, size, window, documents, q.device)
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~_over_heads(allowed, documents is not None, 2), float("-inf"))
    m = s.amax(-1)
    m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m.unsqueeze(-1))
    l = p.sum(-1)
    out = (p if keep is None else p * keep) @ v.unsqueeze(2)
    return out / l.masked_fill(l == 0, 1.0).unsqueeze(-1), m + torch.log(l)


def merge_block(out, lse, block_out, block_lse):
    """Online softmax: one block's (output, log-sum-exp) folded into its rows' running ones, each
    weighted by its share of the rows' new normalizer; rows still without a key stay (0, -inf)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return merged, new


def backward_block(dout, q, k, v, out, lse, chunks, size: int, window: int, scale: float, keep=None,
                   documents=None):
    """The block's share of dQ (q's shape) and dK, dV (k's shape), from the rows' final output and
    log-sum-exp (P is the global softmax's). With dropout (M the block's multiplier): dV = (P M)^T
    dO, dP = (dO V^T) M, and the softmax correction rowsum(dO * O) is unchanged (O already holds
    the dropped weights)."""
    if fused_kernel(q.device, keep is not None):
        q4, k4, v4, causal, mask, _ = _fused_args(q, k, v, chunks, size, window, documents)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.reshape(q4.shape), q4, k4, v4, out.reshape(q4.shape), lse.reshape(q4.shape[:-1]), 0.0, causal,
            attn_mask=mask, scale=scale)
        return dq.view(q.shape), *(g.reshape(q.shape[:3] + g.shape[2:]).sum(2) for g in (dk, dv))
    allowed = allowed_keys(chunks, size, window, documents, q.device)
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~_over_heads(allowed, documents is not None, 2), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = ((p if keep is None else p * keep).transpose(-1, -2) @ dout).sum(2)
    dp = dout @ v.unsqueeze(2).transpose(-1, -2)
    ds = p * ((dp if keep is None else dp * keep) - (dout * out).sum(-1, keepdim=True))
    dq = (ds @ k.unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q).sum(2) * scale
    return dq, dk, dv
