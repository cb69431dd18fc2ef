"""Loss, perplexity and bits-per-byte of a model on held-out text or a token stream.

The stream is cut into non-overlapping seq_len+1 windows by kiln.data.loader.TokenWindows (the
last one may be shorter) and scored by kiln.eval.scoring.score_batches, the scorer the trainer's
evaluation uses too. A model trained on packed documents with attention masked to each one
(data.windows = "packed_masked") is scored the same way: pass the stream's document offsets
(`doc_offsets`) or `masked=True` for texts.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from kiln.data.loader import TokenWindows, leading_batches
from kiln.data.tokenizer import token_byte_lengths
from kiln.eval.scoring import score_batches


def stream_prefix(ids: np.ndarray, max_tokens: int = 0,
                  doc_offsets: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """(the first `max_tokens` + 1 tokens of a stream, int64; 0: all of it, and its document
    offsets cut to match, as TokenWindows' `doc_offsets` takes them, or None without)."""
    ids = np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64)
    if doc_offsets is None:
        return ids, None
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    inside = doc_offsets[doc_offsets < len(ids)]
    return ids, [np.append(inside, len(ids)) if len(ids) else inside]


def evaluate_tokens(model, tokenizer, ids: np.ndarray, *, seq_len: int, batch_size: int = 8,
                    device: str = "cpu", max_tokens: int = 0,
                    autocast: contextlib.AbstractContextManager | None = None,
                    doc_offsets: np.ndarray | None = None) -> dict:
    """Score a token stream (at most `max_tokens` predictions; 0: all); {loss, ppl, bpb, tokens, bytes}.
    Fewer than 2 tokens is a DataError. `doc_offsets` (0, the documents' starts, len(ids)):
    attention stays within each document."""
    ids, doc_offsets = stream_prefix(ids, max_tokens, doc_offsets)
    windows = TokenWindows([ids], seq_len, ragged_tail=True, source="the text to evaluate", doc_offsets=doc_offsets)
    byte_lengths = torch.from_numpy(token_byte_lengths(tokenizer))
    return score_batches(model, leading_batches(windows, batch_size), byte_lengths, device=device,
                         autocast=autocast)


def evaluate_texts(model, tokenizer, texts: list[str], *, seq_len: int, batch_size: int = 8,
                   device: str = "cpu", max_tokens: int = 0,
                   autocast: contextlib.AbstractContextManager | None = None, masked: bool = False) -> dict:
    """Documents are joined with EOS, as in training, then scored; `masked`: each text is a
    document attention does not cross (a packed_masked run)."""
    parts = [np.append(np.asarray(ids, dtype=np.int64), tokenizer.eos_id) for ids in tokenizer.encode_batch(texts)]
    offsets = np.cumsum([0] + [len(p) for p in parts]) if masked else None
    return evaluate_tokens(model, tokenizer, np.concatenate(parts), seq_len=seq_len, batch_size=batch_size,
                           device=device, max_tokens=max_tokens, autocast=autocast, doc_offsets=offsets)
