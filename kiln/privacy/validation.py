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
kiln.privacy.metrics does. The final loss/ppl/bpb formulas repeat score_batches' (hand-written,
three lines) because that function returns means, not the sums to all-reduce.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from kiln.data.loader import TokenWindows, window_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.eval.scoring import score_batches
from kiln.privacy.metrics import Shard, _idle_forward, reshard


def validation_score(model: torch.nn.Module, tokenizer, ids: np.ndarray, *, seq_len: int, batch_size: int = 8,
                     max_tokens: int = 0, autocast: contextlib.AbstractContextManager | None = None,
                     shard: Shard = Shard()) -> dict:
    """{loss, ppl, bpb, tokens, bytes, rank_tokens} of the token stream `ids` (at most
    `max_tokens` predictions; 0: all); `rank_tokens`: the predictions each rank scored. Every rank
    passes the same stream and gets the same dict back."""
    ids = np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64)
    windows = TokenWindows([ids], seq_len, ragged_tail=True, source="the validation tokens")
    mine = np.array_split(np.arange(len(windows)), shard.size)[shard.rank]
    batches = list(window_batches(windows, mine, batch_size))
    device = next(model.parameters()).device
    # Agreed before any forward: under FSDP a collective issued between forwards would pair with
    # another rank's all-gather.
    idle = shard.max(len(batches)) - len(batches)
    try:
        if batches:
            local = score_batches(model, batches, torch.from_numpy(token_byte_lengths(tokenizer)), device=device,
                                  autocast=autocast)
        else:
            local = {"loss": 0.0, "tokens": 0, "bytes": 0}
        if idle:
            was_training = model.training
            model.eval()
            with torch.no_grad():
                for _ in range(idle):
                    _idle_forward(model)
            model.train(was_training)
    finally:
        reshard(model)  # FSDP: the shards again, not what the last forward left gathered
    sums = torch.tensor([local["loss"] * local["tokens"], local["tokens"], local["bytes"]], dtype=torch.float64,
                        device=shard.device)
    total_loss, tokens, n_bytes = shard.sum(sums).tolist()
    loss = total_loss / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": total_loss / math.log(2) / max(n_bytes, 1),
            "tokens": int(tokens), "bytes": int(n_bytes), "rank_tokens": shard.gather([local["tokens"]])}
