"""Ring attention (Liu et al. 2023), context parallelism's `cp_mode = "ring"` (the zig-zag split
and the trainer's handle: kiln/parallel/context_parallel.py): each rank keeps its queries and
passes its K/V block around the ring with point-to-point `batch_isend_irecv` (gloo and NCCL),
starting the next exchange before computing on the current block, and merges the partial results
with their log-sum-exp (online softmax). The backward runs the ring again: dQ stays local, and
dK/dV accumulators travel with their K/V block and return to its owner after a full turn. Per
pair of chunks: a chunk in the past is attended in full, the same chunk causally, a future
chunk is skipped.

A sliding-window layer needs the K/V of a few ranks only: its keys reach back at most
ceil((W - 1) / chunk) chunks, and zig-zag puts chunks d apart on ranks at most d apart, but one
of a rank's two chunks looks behind it on the ring and the other ahead. Where that neighbourhood
is smaller than the ring (kiln/parallel/ring_layout.py `window_hops`), K/V go that many hops both
ways instead of round the ring (6 blocks sent per hop forward and backward instead of 3 cp - 2),
and each dK/dV share is sent straight home. kiln's own. Packed documents (data.windows =
"packed_masked") reach the ring as the whole sequences' document ids, from which each pair of
chunks is masked (`_same_document`, `ring_blocks.allowed_keys`).

Block kernels (kiln/parallel/ring_blocks.py): on CPU torch's fused flash-attention kernel, which
returns the log-sum-exp the merge needs and never holds a block's scores; elsewhere, and with
attention dropout, a plain fp32 matmul block attention written there (SDPA's LSE-returning CUDA
ops are private, differ from the CPU one, and are untested here). Torch's own
`torch.distributed.tensor.experimental.context_parallel` (CUDA only) is not wired in: see
docs/parallel.md.

Attention dropout (`model.dropout` while training) is applied to each block's probabilities,
never to the normalizer, as FlashAttention does: out = sum_j (P_j * M_j) V_j with P the global
softmax and M_j the block's keep mask scaled by 1/(1-p), so the result is attention dropout over
the whole row. The mask of the block (query chunk a, key chunk b) comes from a generator seeded
by (the call's seed, a, b) (`ring_blocks.block_keep`): the rank holding chunk a draws it in the forward and
again in the backward, whatever the order the ring brings the blocks in. The seed is drawn per
call from torch's default generator (restored by activation checkpointing's recompute).

Under train.compile the ring is two opaque ops (`torch.library.custom_op`: forward, and backward
via `register_autograd`, each with a fake implementation for shapes), the pattern torch's own
flex-attention context parallel uses for its all-gather: dynamo cannot trace `P2POp`, and an
opaque op keeps each compiled block one graph (fullgraph) that calls the ring eagerly, its
overlap untouched. Eager training runs the same ops. The process group reaches the ops by name
(as torch's functional collectives).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from kiln import torch_compat
from kiln.parallel import ring_blocks
from kiln.parallel.functional import zigzag_chunks
from kiln.parallel.ring_layout import window_hops


class Ring:
    """The cp process group as a ring: this rank's place, and the shift to the next rank."""

    def __init__(self, group):
        self.group = group
        self.group_name = group.group_name  # how the ring ops (below) receive the group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, tensor: torch.Tensor):
        """Send `tensor` to the next rank and receive the previous rank's; returns (buffer, works)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        received, works = self.start_shift(tensor)
        _wait(works)
        return received

    def start_both_ways(self, ahead: torch.Tensor, behind: torch.Tensor):
        """`ahead` to the next rank and `behind` to the previous one, receiving in their place the
        previous rank's `ahead` and the next rank's `behind`; returns ((ahead, behind), works)."""
        from_prev, from_next = torch.empty_like(ahead), torch.empty_like(behind)
        ops = [dist.P2POp(dist.isend, ahead, self.next, self.group),
               dist.P2POp(dist.irecv, from_prev, self.prev, self.group),
               dist.P2POp(dist.isend, behind, self.prev, self.group),
               dist.P2POp(dist.irecv, from_next, self.next, self.group)]
        return (from_prev, from_next), dist.batch_isend_irecv(ops)

    def start_swap(self, tensor: torch.Tensor, to: int, source: int):
        """`tensor` to ring position `to`, and a tensor like it from `source`; returns (buffer, works)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(self.group, to), self.group),
               dist.P2POp(dist.irecv, received, dist.get_global_rank(self.group, source), self.group)]
        return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _ring_blocks(kv: torch.Tensor, ring: Ring):
    """(source ring position, its K/V block) for every rank of the ring, this rank's first; the
    next block's exchange is in flight while the caller computes on the current one."""
    for step in range(ring.size):
        pending = ring.start_shift(kv) if step < ring.size - 1 else None
        yield (ring.rank - step) % ring.size, kv
        if pending is not None:
            kv, works = pending
            _wait(works)


def _neighbour_blocks(kv: torch.Tensor, ring: Ring, hops: int):
    """(source ring position, its K/V block) for this rank and the `hops` ranks on either side of
    it (`window_hops`): the blocks travel both ways around the ring for `hops` steps instead of
    all the way round, the next hop's two exchanges in flight while the caller computes."""
    ahead = behind = kv
    for hop in range(hops + 1):
        pending = ring.start_both_ways(ahead, behind) if hop < hops else None
        if hop == 0:
            yield ring.rank, kv
        else:
            yield (ring.rank - hop) % ring.size, ahead
            yield (ring.rank + hop) % ring.size, behind
        if pending is not None:
            (ahead, behind), works = pending
            _wait(works)


def _chunk_pairs(my_chunks, src_chunks, size, window: int = 0):
    """(query slice, key slice, (query chunk, key chunk)) for every pair of chunks that is not
    entirely masked: key chunks in the future are, and with a sliding `window` those whose nearest
    key is `window` or more positions behind the chunk's first query."""
    for i, a in enumerate(my_chunks):
        for j, b in enumerate(src_chunks):
            if b <= a and not (window and (a - b) * size - (size - 1) >= window):
                yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), (a, b)


def _same_document(doc_ids: torch.Tensor | None, chunks: tuple[int, int], size: int) -> torch.Tensor | None:
    """(B, S, S): whether query i of chunk a and key j of chunk b are in the same packed document,
    from the whole sequences' document ids (B, 2 cp S); None without packed documents."""
    if doc_ids is None:
        return None
    a, b = chunks
    return doc_ids[:, a * size:(a + 1) * size, None] == doc_ids[:, None, b * size:(b + 1) * size]


def _ring_forward(q, k, v, ring: Ring, dropout_p: float = 0.0, seed: int = 0, window: int = 0, doc_ids=None):
    """The ring's forward: out (B, Hkv, rep, T, D) and its log-sum-exp (B, Hkv, rep, T), fp32."""
    bsz, n_heads, seqlen, head_dim = q.shape
    n_kv = k.shape[1]
    size = seqlen // 2
    scale = 1.0 / math.sqrt(head_dim)
    mine = zigzag_chunks(ring.size, ring.rank)
    q5 = q.float().reshape(bsz, n_kv, n_heads // n_kv, seqlen, head_dim)
    # Contiguous whatever q's strides (zeros_like would copy them): the op's fake says so.
    out = torch.zeros(q5.shape, device=q.device)
    lse = torch.full(q5.shape[:-1], float("-inf"), device=q.device)
    kv = torch.stack([k.float(), v.float()]).contiguous()
    hops = window_hops(ring.size, size, window)
    for source, kv in _ring_blocks(kv, ring) if hops is None else _neighbour_blocks(kv, ring, hops):
        for qs, ks, chunks in _chunk_pairs(mine, zigzag_chunks(ring.size, source), size, window):
            shape = (*q5.shape[:3], size, size)
            keep = ring_blocks.block_keep(seed, chunks, shape, dropout_p, q.device) if dropout_p > 0 else None
            block = ring_blocks.forward_block(q5[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], chunks, size,
                                              window, scale, keep, _same_document(doc_ids, chunks, size))
            out[..., qs, :], lse[..., qs] = ring_blocks.merge_block(out[..., qs, :], lse[..., qs], *block)
    return out, lse


def _ring_backward(grad_out, q, k, v, out, lse, ring: Ring, dropout_p: float = 0.0, seed: int = 0,
                   window: int = 0, doc_ids=None):
    """The ring's backward: dq (q's shape and dtype) and dK/dV stacked (2, B, Hkv, T, D) in fp32.
    Around the ring the dK/dV accumulator travels with its block and comes home after a full turn;
    in a window's neighbourhood (`window_hops`) each block's share goes straight home once computed."""
    bsz, n_heads, seqlen, head_dim = q.shape
    size = seqlen // 2
    scale = 1.0 / math.sqrt(head_dim)
    mine = zigzag_chunks(ring.size, ring.rank)
    q5 = q.float().reshape(out.shape)
    dout = grad_out.float().reshape(out.shape)
    dq = torch.zeros(q5.shape, device=q.device)  # contiguous, as the fake (see _ring_forward)

    def block_grads(source: int, kv: torch.Tensor, dkv: torch.Tensor) -> None:
        """This rank's queries against `source`'s block: into dq, and into `dkv` for that block."""
        for qs, ks, chunks in _chunk_pairs(mine, zigzag_chunks(ring.size, source), size, window):
            shape = (*q5.shape[:3], size, size)
            keep = ring_blocks.block_keep(seed, chunks, shape, dropout_p, q.device) if dropout_p > 0 else None
            dq_b, dk_b, dv_b = ring_blocks.backward_block(dout[..., qs, :], q5[..., qs, :], kv[0][..., ks, :],
                                                          kv[1][..., ks, :], out[..., qs, :], lse[..., qs], chunks,
                                                          size, window, scale, keep,
                                                          _same_document(doc_ids, chunks, size))
            dq[..., qs, :] += dq_b
            dkv[0][..., ks, :] += dk_b
            dkv[1][..., ks, :] += dv_b

    kv = torch.stack([k.float(), v.float()]).contiguous()
    dkv = torch.zeros_like(kv)
    hops = window_hops(ring.size, size, window)
    if hops is None:
        for source, kv in _ring_blocks(kv, ring):
            block_grads(source, kv, dkv)
            dkv = ring.shift(dkv)  # the accumulator travels with its block; the last shift takes it home
    else:
        shares = []  # (what another rank computed for this rank's block, its works)
        for source, kv in _neighbour_blocks(kv, ring, hops):
            if source == ring.rank:
                block_grads(source, kv, dkv)
                continue
            share = torch.zeros_like(dkv)
            block_grads(source, kv, share)
            # sent home; in return the rank as far the other way sends its share of this rank's block
            shares.append(ring.start_swap(share, source, (2 * ring.rank - source) % ring.size))
        for received, works in shares:
            _wait(works)
            dkv += received
    return dq.view(bsz, n_heads, seqlen, head_dim).to(q.dtype), dkv


# The ring as two opaque torch ops (torch.library.custom_op, the way torch's own flex-attention CP
# wraps its all-gather): a compiled block keeps one graph and calls them eagerly, since dynamo
# cannot trace P2POp. Fake implementations give AOTAutograd/inductor the output shapes; the
# process group travels by name, resolved in the op by c10d's `_resolve_process_group` (private,
# what torch's functional collectives use).
# cudagraph_unsafe: inductor splits a CUDA graph (train.cuda_graphs) around them (P2P waited on the host).
# torch 2.6 has neither the tag nor custom_op's `tags` (dims.check_model refuses cuda_graphs with cp there).
_OP_TAGS = {"tags": (torch_compat.cudagraph_unsafe_tag(),)} if torch_compat.cudagraph_unsafe_tag() else {}


# `seed`: a one-element int64 CPU tensor (drawn per call, so a compiled graph does not bake it in).
@torch.library.custom_op("kiln::ring_attention", mutates_args=(), **_OP_TAGS)
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, dropout_p: float,
                       seed: torch.Tensor, window: int,
                       doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, Ring(_resolve_process_group(group_name)), dropout_p, int(seed), window, doc_ids)


@_ring_attention_op.register_fake
def _(q, k, v, group_name, dropout_p, seed, window, doc_ids=None):
    bsz, n_heads, seqlen, head_dim = q.shape
    out = q.new_empty((bsz, k.shape[1], n_heads // k.shape[1], seqlen, head_dim), dtype=torch.float32)
    return out, out.new_empty(out.shape[:-1])


@torch.library.custom_op("kiln::ring_attention_backward", mutates_args=(), **_OP_TAGS)
def _ring_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str, dropout_p: float,
                                seed: torch.Tensor, window: int,
                                doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_backward(grad_out, q, k, v, out, lse, Ring(_resolve_process_group(group_name)), dropout_p,
                          int(seed), window, doc_ids)


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, dropout_p, seed, window, doc_ids=None):
    # Contiguous, as the real op returns them (empty_like would copy q's strides).
    return q.new_empty(q.shape), k.new_empty((2, *k.shape), dtype=torch.float32)


def _save_for_ring_backward(ctx, inputs, output):
    q, k, v, ctx.group_name, ctx.dropout_p, seed, ctx.window, doc_ids = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, seed, doc_ids)


def _ring_attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, seed, doc_ids = ctx.saved_tensors
    dq, dkv = _ring_attention_backward_op(grad_out, q, k, v, out, lse, ctx.group_name, ctx.dropout_p, seed,
                                          ctx.window, doc_ids)
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


_ring_attention_op.register_autograd(_ring_attention_grad, setup_context=_save_for_ring_backward)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, dropout_p: float = 0.0,
                   seed: torch.Tensor | None = None, window: int = 0,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag slice: q (B, H, T, D), k/v (B, Hkv, T, D) with
    H a multiple of Hkv (GQA); T = 2 chunks. Equals the matching rows of full causal attention
    (with dropout_p > 0: attention dropout with `block_keep`'s masks for `seed`, drawn when None;
    with `window` > 0: sliding-window attention, blocks wholly outside the window skipped; with
    `doc_ids` (B, whole sequence length), packed documents: a token attends within its own)."""
    if seed is None:
        seed = (torch.randint(0, 2**62, (1,)) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64))
    with torch.autocast(q.device.type, enabled=False):  # the blocks run in fp32 (see module doc)
        out, _ = _ring_attention_op(q, k, v, ring.group_name, float(dropout_p), seed, int(window), doc_ids)
        return out.view(q.shape).to(q.dtype)
