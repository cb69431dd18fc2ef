"""Loss, perplexity and bits-per-byte of a model on held-out text or token shards.

Bits-per-byte divides the total loss (in bits) by the UTF-8 bytes the scored tokens stand for,
so runs with different tokenizers compare fairly (Gao et al. 2020, The Pile, sec. 5).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.data.tokenizer import token_byte_lengths
from kiln.model.transformer import lm_loss


@torch.no_grad()
def evaluate_tokens(model, tokenizer, ids: np.ndarray, *, seq_len: int, batch_size: int = 8,
                    device: str = "cpu", max_tokens: int = 0) -> dict:
    """Score a token stream in non-overlapping windows of seq_len (the last one may be shorter)."""
    ids = torch.as_tensor(np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64))
    if ids.numel() < 2:
        raise ValueError("need at least 2 tokens to evaluate")
    byte_lengths = torch.from_numpy(token_byte_lengths(tokenizer))
    was_training = model.training
    model.eval()
    starts = list(range(0, ids.numel() - 1, seq_len))
    total_loss, n_tokens, n_bytes = 0.0, 0, 0
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        full = [s for s in chunk if s + seq_len + 1 <= ids.numel()]
        groups = [full] if full else []
        groups += [[s] for s in chunk if s not in full]  # the ragged tail on its own
        for group in groups:
            end = min(seq_len, ids.numel() - 1 - group[0])
            windows = torch.stack([ids[s:s + end + 1] for s in group])
            x, y = windows[:, :-1].to(device), windows[:, 1:].to(device)
            loss = lm_loss(model(x), y)
            total_loss += loss.item() * y.numel()
            n_tokens += y.numel()
            n_bytes += int(byte_lengths[y.cpu()].sum())
    model.train(was_training)
    loss = total_loss / n_tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": total_loss / math.log(2) / max(n_bytes, 1),
            "tokens": n_tokens, "bytes": n_bytes}


def evaluate_texts(model, tokenizer, texts: list[str], *, seq_len: int, batch_size: int = 8,
                   device: str = "cpu", max_tokens: int = 0) -> dict:
    """Documents are joined with EOS, as in training, then scored."""
    parts = []
    for ids in tokenizer.encode_batch(texts):
        parts.append(np.asarray(ids, dtype=np.int64))
        parts.append(np.array([tokenizer.eos_id], dtype=np.int64))
    return evaluate_tokens(model, tokenizer, np.concatenate(parts), seq_len=seq_len, batch_size=batch_size,
                           device=device, max_tokens=max_tokens)
