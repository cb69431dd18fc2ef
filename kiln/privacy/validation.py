"""Validation loss, perplexity and bits-per-byte before/after unlearning, split over the
data-parallel ranks.

The windows are those of `kiln eval`'s perplexity part (kiln.eval.perplexity.evaluate_tokens):
the stream's first `max_tokens` + 1 tokens cut by kiln.data.loader.TokenWindows with a ragged
tail, scored by kiln.eval.scoring.score_batches. Here each rank scores one contiguous block of the
windows (numpy array_split) and the sums - loss x tokens, tokens, bytes - are all-reduced in
float64 (torch.distributed through kiln.privacy.metrics.Shard), so N ranks do 1/N of the forwards
and every rank returns the one-process numbers (up to the order of the float64 sums). Under FSDP
every forward is a collective: a rank with fewer batches (the ragged tail is a batch of its own,
and blocks differ by a window) runs one-token idle forwards up to the largest count, as
kiln.privacy.metrics does (score_batches counts nothing of them: rows 0). The trainer's
evaluation splits its windows with kiln.data.loader `rank_batches` instead (equal shapes on every
rank, which tp, cp and pp need); it takes full-length windows only, and these have a ragged tail.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from kiln.data.loader import TokenWindows, window_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.eval.perplexity import stream_prefix
from kiln.eval.scoring import score_batches
from kiln.privacy.metrics import Shard, reshard


def validation_score(model: torch.nn.Module, tokenizer, ids: np.ndarray, *, seq_len: int, batch_size: int = 8,
                     max_tokens: int = 0, autocast: contextlib.AbstractContextManager | None = None,
                     shard: Shard = Shard(), doc_offsets: np.ndarray | None = None) -> dict:
    """{loss, ppl, bpb, tokens, bytes, rank_tokens} of the token stream `ids` (at most
    `max_tokens` predictions; 0: all); `rank_tokens`: the predictions each rank scored. Every rank
    passes the same stream and gets the same dict back. `doc_offsets`: attention within each
    document (a packed_masked run), as evaluate_tokens takes them."""
    ids, doc_offsets = stream_prefix(ids, max_tokens, doc_offsets)
    windows = TokenWindows([ids], seq_len, ragged_tail=True, source="the validation tokens", doc_offsets=doc_offsets)
    mine = np.array_split(np.arange(len(windows)), shard.size)[shard.rank]
    batches = list(window_batches(windows, mine, batch_size))
    device = next(model.parameters()).device
    # Agreed before any forward: under FSDP a collective issued between forwards would pair with
    # another rank's all-gather. The idle forwards (rows 0) are scored as nothing.
    idle = shard.max(len(batches)) - len(batches)
    one_token = torch.zeros(1, 1, dtype=torch.long)
    try:
        scores = score_batches(model, batches + [(one_token, one_token, 0)] * idle,
                               torch.from_numpy(token_byte_lengths(tokenizer)), device=device, autocast=autocast,
                               group=dist.group.WORLD if shard.size > 1 else None)
    finally:
        reshard(model)  # FSDP: the shards again, not what the last forward left gathered
    local = scores.pop("rank_tokens", scores["tokens"])
    return {**scores, "rank_tokens": shard.gather([local])}
