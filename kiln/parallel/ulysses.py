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
runs unchanged; but cp must divide the heads each tp rank holds, and attention waits for its
inputs. K/V heads fewer than cp are repeated to the least multiple of cp that keeps each query
head with its K/V head.

With parallel.ulysses_rounds R > 1 the heads go in R rounds (each destination's share of the query
heads cut in R, and of the K/V heads with them where they split so, else all in the first round):
every round's all-to-all is started first, round i attends once its own exchange is in, and its
output's all-to-all runs while round i + 1 attends, so forward all but the first round's inputs
and the last round's output travel behind attention. Backward, autograd reaches each round's
reverse exchanges in turn, each waited for where its result is used (benchmarks/cp_modes.py
times the forward and the whole step).

The cp ranks hold their zig-zag chunks (context_parallel.py: the loader, positions and loss are
cp-mode-agnostic), so the gathered chunks are put in sequence order before attention and back in
the ranks' order after it. With parallel.ulysses_degree U < cp (USP's hybrid) Ulysses runs inside
groups of U consecutive cp ranks and ring attention across the groups (`Ulysses.ring`; the groups
and positions: context_parallel.py `hybrid_groups`, `hybrid_positions`). kiln's own: the chunk
order, the hybrid's layout, the rounds and the K/V repetition; the exchange and the groups are
torch's.
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


def _kv_for_query_heads(kv: torch.Tensor, first: int, count: int, group: int) -> torch.Tensor:
    """The K/V heads (B, Hkv, T, D) that query heads first .. first + count - 1 attend with, each K/V
    head serving `group` consecutive query heads: part of one group (its head), or else one K/V head
    per query head. (Rounds of whole groups cut the K/V heads with them: `Ulysses.attention`.)"""
    if group % count == 0:
        return kv[:, first // group:first // group + 1]
    return kv[:, torch.arange(first, first + count, device=kv.device) // group]


class Ulysses:
    """Attention over the cp group `group` (of `size` ranks) by all-to-alls: the ContextParallel
    handle's `attention` under cp_mode 'ulysses'.

    With `ring` (parallel.ulysses_degree U < cp, USP's hybrid, Megatron's a2a+p2p), `group` is U
    consecutive cp ranks: they hold the two zig-zag chunks of their place on the ring of cp / U
    such groups cut in U pieces each (`hybrid_positions`), the all-to-all gives each rank both
    chunks whole for n_heads / U heads, and ring attention over `ring` (the ranks of the other
    groups at the same place) computes them."""

    def __init__(self, group, size: int, ring=None, expand_kv: bool = False, rounds: int = 1):
        # by name, as torch's functional collectives take it: dynamo before 2.10 cannot put a
        # ProcessGroup object into a graph
        self.group_name, self.size, self.ring = group.group_name, size, ring
        self.rank = dist.get_rank(group)  # which head group this rank attends for
        # the model's Attention.expand_kv (kiln/train/attention.py: where only expanded heads get a
        # fused SDPA kernel): K/V repeated to the query heads after the exchange, not before it
        self.expand_kv = expand_kv
        # parallel.ulysses_rounds: the heads exchanged and attended in this many rounds, each round's
        # all-to-all in flight while the one before it attends
        self.rounds = rounds
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
        c, r = self.size, self.rounds
        repeat = c // math.gcd(kv_heads, c)  # K/V copies so that cp divides them
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q_dest, kv_dest = heads // c, k.shape[1] // c  # the heads each destination rank attends
        # In rounds, each destination's query heads are cut in r, and its K/V heads with them where
        # they split so; where they do not, they go whole in the first round (never repeated for it).
        kv_rounds = r if kv_dest % r == 0 else 1
        q_parts = q.unflatten(1, (c, r, q_dest // r))
        k_parts, v_parts = (t.unflatten(1, (c, kv_rounds, kv_dest // kv_rounds)) for t in (k, v))
        # one exchange a round: per destination rank j, its q heads of the round, then k and v's
        sent = [self._send_to_heads(torch.cat([q_parts[:, :, i], k_parts[:, :, i], v_parts[:, :, i]], dim=2)
                                    if i < kv_rounds else q_parts[:, :, i]) for i in range(r)]
        # Attention dropout: the ranks of a group hold one random state (the same seed), so each
        # draws from a stream of its own head group's and round's, one seed drawn per call from that
        # state (activation checkpointing's recompute restores it, and draws the same).
        seed = torch.randint(0, 2**62, (1,)) + self.rank if dropout_p > 0 else None
        outs, q_round = [], q_dest // r
        for i, got in enumerate(sent):  # waits for round i's exchange only
            got = self._heads_in_order(got)
            if i < kv_rounds:
                q_i, k_i, v_i = got.split([q_round, kv_dest // kv_rounds, kv_dest // kv_rounds], dim=1)
                if kv_rounds == 1:
                    k_all, v_all = k_i, v_i
            else:
                q_i = got
            if kv_rounds == 1 and r > 1:  # round i's query heads' K/V heads among the first round's
                k_i, v_i = (_kv_for_query_heads(t, i * q_round, q_round, q_dest // kv_dest) for t in (k_all, v_all))
            out = self._attend(q_i, k_i, v_i, dropout_p, None if seed is None else seed + c * i, window, mask)
            outs.append(self._send_to_sequence(out))
        return self._sequence_in_order(outs, heads)

    def _attend(self, q, k, v, dropout_p, seed, window, mask):
        if self.ring is not None:  # the ring takes grouped K/V as they are
            return ring_attention(q, k, v, self.ring, dropout_p, seed=seed, window=window, doc_ids=mask)
        if self.expand_kv and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        with _dropout_stream(seed, q.device):
            return causal_attention(q, k, v, dropout_p, window, mask, enable_gqa=k.shape[1] != q.shape[1])

    def _send_to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, C, H', T/C, D) of this rank's chunks, head group j for rank j: the all-to-all
        started, its result (dim 0 the source rank) waited for at its first use."""
        send = t.transpose(0, 1).contiguous()  # dim 0 the destination
        return funcol.all_to_all_single_autograd(send, None, None, self.group_name)

    def _heads_in_order(self, got: torch.Tensor) -> torch.Tensor:
        """`_send_to_heads`' result -> (B, H', T, D) of this rank's group, in sequence order."""
        c, b, h, n, d = got.shape
        got = got.view(c, b, h, 2, n // 2, d).permute(2, 0, 3, 1, 4, 5).reshape(h, 2 * c, b, n // 2, d)
        got = got[:, self.slots]  # chunks in sequence order
        return got.permute(2, 0, 1, 3, 4).reshape(b, h, c * n, d)

    def _send_to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H/(C R), T, D) of this rank's heads in one round: the all-to-all back started, its
        result (C, B, H/(C R), T/C, D), dim 0 the head group."""
        b, h, length, d = t.shape
        c = self.size
        size = length // (2 * c)
        t = t.reshape(b, h, 2 * c, size, d)[:, :, self.chunk_at]  # chunks in the ranks' order
        send = t.view(b, h, c, 2 * size, d).permute(2, 0, 1, 3, 4).contiguous()  # dim 0: destination
        return funcol.all_to_all_single_autograd(send, None, None, self.group_name)

    def _sequence_in_order(self, rounds: list[torch.Tensor], heads: int) -> torch.Tensor:
        """Every round's `_send_to_sequence` result -> (B, H, T/C, D) of this rank's chunks."""
        c, b, _, n, d = rounds[0].shape
        got = rounds[0].unsqueeze(2) if len(rounds) == 1 else torch.stack(rounds, dim=2)  # (C, B, R, h, n, d)
        # With a batch of 1 and one round this reshape is a view, and torch's eager result stays a
        # lazy AsyncCollectiveTensor, waited for at its first compute (the output projection). Not
        # funcol.wait_tensor: torch 2.9 has no autograd formula for it (2.11 has), and the gradient stops
        # there (torch 2.9: compiled cp=2 off one process by 1e-4 from step 2).
        return got.transpose(0, 1).reshape(b, heads, n, d)
