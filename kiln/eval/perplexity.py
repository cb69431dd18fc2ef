"""Loss, perplexity and bits-per-byte of a model on held-out text or a token stream.

The stream is cut into non-overlapping seq_len+1 windows by kiln.data.loader.TokenWindows (the
last one may be shorter) and scored by kiln.eval.scoring.score_batches, the scorer the trainer's
evaluation uses too.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from kiln.data.loader import TokenWindows, leading_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.eval.scoring import score_batches


def evaluate_tokens(model, tokenizer, ids: np.ndarray, *, seq_len: int, batch_size: int = 8,
                    device: str = "cpu", max_tokens: int = 0,
                    autocast: contextlib.AbstractContextManager | None = None) -> dict:
    """Score a token stream (at most `max_tokens` predictions; 0: all); {loss, ppl, bpb, tokens, bytes}.
    Fewer than 2 tokens is a DataError."""
    ids = np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64)
    windows = TokenWindows([ids], seq_len, ragged_tail=True, source="the text to evaluate")
    byte_lengths = torch.from_numpy(token_byte_lengths(tokenizer))
    return score_batches(model, leading_batches(windows, batch_size), byte_lengths, device=device,
                         autocast=autocast)


def evaluate_texts(model, tokenizer, texts: list[str], *, seq_len: int, batch_size: int = 8,
                   device: str = "cpu", max_tokens: int = 0,
                   autocast: contextlib.AbstractContextManager | None = None) -> dict:
    """Documents are joined with EOS, as in training, then scored."""
    parts = []
    for ids in tokenizer.encode_batch(texts):
        parts.append(np.asarray(ids, dtype=np.int64))
        parts.append(np.array([tokenizer.eos_id], dtype=np.int64))
    return evaluate_tokens(model, tokenizer, np.concatenate(parts), seq_len=seq_len, batch_size=batch_size,
                           device=device, max_tokens=max_tokens, autocast=autocast)
