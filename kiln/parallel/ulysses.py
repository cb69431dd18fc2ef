"""Ulysses context parallelism (`parallel.cp_mode = "ulysses"`; DeepSpeed-Ulysses, Jacobs et al.
2023; Megatron-LM's `--cp-comm-type a2a`): around each attention, all-to-alls over the cp ranks
trade the sequence split for a head split. Each rank enters attention with its slice of every
sequence for all its heads, (B, H, T/C, D), and leaves the first all-to-all with the whole
sequences for H/C of the heads, (B, H/C, T, D); attention then runs locally, exactly as without
cp (`kiln.model.transformer.causal_attention`: SDPA's causal kernel, the sliding window, packed
documents' masks, dropout), and a last all-to-all hands each rank its slice of the output for all
heads again. Autograd runs the reverse all-to-alls backward (torch's functional
`all_to_all_single_autograd`, which dynamo traces, so a compiled block stays one graph).

Against ring attention (kiln/parallel/ring_attention.py): each rank sends (C-1)/C of its q, k,
v (in one all-to-all) and of its output per layer forward (the same backward) instead of K/V round
the whole ring, so the bytes per rank fall as cp grows where the ring's stay; any attention kernel
runs unchanged; but cp must divide the heads each tp rank holds, and nothing overlaps the exchange
(attention waits for its inputs). K/V heads fewer than cp are repeated to the least multiple of cp
that keeps each query head with its K/V head.

The cp ranks hold their zig-zag chunks (context_parallel.py: the loader, positions and loss are
cp-mode-agnostic), so the gathered chunks are put in sequence order before attention and back in
the ranks' order after it. With parallel.ulysses_degree U < cp (USP's hybrid) Ulysses runs inside
groups of U consecutive cp ranks and ring attention across the groups (`Ulysses.ring`; the groups
and positions: context_parallel.py `hybrid_groups`, `hybrid_positions`). kiln's own: the chunk
order, the hybrid's layout and the K/V repetition; the exchange and the groups are torch's.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kiln.model.transformer import causal_attention
from kiln.parallel.functional import zigzag_chunks
from kiln.parallel.ring_attention import ring_attention


@contextlib.contextmanager
def _dropout_stream(seed: torch.Tensor | None, device: torch.device):
    """With `seed`, torch's random state on `device` seeded by it inside, restored after; else
    nothing."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        if cuda:  # SDPA draws from its device's generator: that one only
            with torch.cuda.device(device):
                torch.cuda.manual_seed(int(seed))
        else:
            torch.default_generator.manual_seed(int(seed))
        yield


class Ulysses:
    """Attention over the cp group `group` (of `size` ranks) by all-to-alls: the ContextParallel
    handle's `attention` under cp_mode 'ulysses'.

    With `ring` (parallel.ulysses_degree U < cp, USP's hybrid, Megatron's a2a+p2p), `group` is U
    consecutive cp ranks: they hold the two zig-zag chunks of their place on the ring of cp / U
    such groups cut in U pieces each (`hybrid_positions`), the all-to-all gives each rank both
    chunks whole for n_heads / U heads, and ring attention over `ring` (the ranks of the other
    groups at the same place) computes them."""

    def __init__(self, group, size: int, ring=None, expand_kv: bool = False):
        # by name, as torch's functional collectives take it: dynamo before 2.10 cannot put a
        # ProcessGroup object into a graph
        self.group_name, self.size, self.ring = group.group_name, size, ring
        self.rank = dist.get_rank(group)  # which head group this rank attends for
        # the model's Attention.expand_kv (kiln/train/attention.py: where only expanded heads get a
        # fused SDPA kernel): K/V repeated to the query heads after the exchange, not before it
        self.expand_kv = expand_kv
        # the 2 pieces from each rank j, gathered in rank order (slot 2 j + half), go to place
        # chunk_at[slot]: the sequence's chunk zigzag_chunks(size, j)[half], or with a ring piece
        # j of the ring chunk `half`; slots[place] is the inverse
        if ring is None:
            self.chunk_at = [c for j in range(size) for c in zigzag_chunks(size, j)]
        else:
            self.chunk_at = [half * size + j for j in range(size) for half in range(2)]
        slots = [0] * (2 * size)
        for slot, c in enumerate(self.chunk_at):
            slots[c] = slot
        self.slots = slots

    def attention(self, q, k, v, dropout_p: float = 0.0, window: int = 0, mask=None):
        """Causal attention of this rank's sequence slices q (B, H, T/C, D), k/v (B, Hkv, T/C, D);
        the result as q's. `mask`: packed documents' `document_mask` of the whole sequences (the
        model builds it: `Transformer.cp_whole_masks`), with a ring their ids; or None."""
        heads, kv_heads = q.shape[1], k.shape[1]
        repeat = self.size // math.gcd(kv_heads, self.size)  # K/V copies so that cp divides them
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        c = self.size
        # one exchange for all three: per destination rank j, its q heads, then its k and v heads
        grouped = torch.cat([t.unflatten(1, (c, t.shape[1] // c)) for t in (q, k, v)], dim=2)
        q, k, v = self._to_heads(grouped).split([heads // c, k.shape[1] // c, v.shape[1] // c], dim=1)
        # Attention dropout: the ranks of a group hold one random state (the same seed), so each
        # draws from a stream of its own head group's, one seed drawn per call from that state
        # (activation checkpointing's recompute restores it, and draws the same).
        seed = torch.randint(0, 2**62, (1,)) + self.rank if dropout_p > 0 else None
        if self.ring is not None:  # the ring takes grouped K/V as they are
            out = ring_attention(q, k, v, self.ring, dropout_p, seed=seed, window=window, doc_ids=mask)
        else:
            if self.expand_kv and k.shape[1] != q.shape[1]:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            with _dropout_stream(seed, q.device):
                out = causal_attention(q, k, v, dropout_p, window, mask, enable_gqa=k.shape[1] != q.shape[1])
        return self._to_sequence(out, heads)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, C, H', T/C, D) of this rank's chunks, head group j for rank j -> (B, H', T, D) of
        its own group, in sequence order."""
        b, c, h, n, d = t.shape
        send = t.transpose(0, 1).contiguous()  # dim 0 the destination
        got = funcol.all_to_all_single_autograd(send, None, None, self.group_name)  # dim 0: the source rank
        got = got.view(c, b, h, 2, n // 2, d).permute(2, 0, 3, 1, 4, 5).reshape(h, 2 * c, b, n // 2, d)
        got = got[:, self.slots]  # chunks in sequence order
        return got.permute(2, 0, 1, 3, 4).reshape(b, h, c * n, d)

    def _to_sequence(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, H/C, T, D) of this rank's heads -> (B, H, T/C, D) of its chunks."""
        b, h, length, d = t.shape
        c = self.size
        size = length // (2 * c)
        t = t.reshape(b, h, 2 * c, size, d)[:, :, self.chunk_at]  # chunks in the ranks' order
        send = t.view(b, h, c, 2 * size, d).permute(2, 0, 1, 3, 4).contiguous()  # dim 0: destination
        got = funcol.all_to_all_single_autograd(send, None, None, self.group_name)  # dim 0: the head group
        # With a batch of 1 this reshape is a view, and torch's eager result stays a lazy
        # AsyncCollectiveTensor, waited for at its first compute (the output projection). Not
        # funcol.wait_tensor: torch 2.9 has no autograd formula for it (2.11 has), and the gradient stops
        # there (torch 2.9: compiled cp=2 off one process by 1e-4 from step 2).
        return got.transpose(0, 1).reshape(b, heads, 2 * size, d)
