"""The one scorer: loss, perplexity and bits-per-byte of a model over batches of token windows.

Used by the trainer's periodic evaluation (kiln.train.evaluate), `kiln eval`'s perplexity part
and the robustness probe (kiln.eval.perplexity), so the three report the same numbers for the
same windows. Windows are cut by kiln.data.loader (TokenWindows, window_batches).

Bits-per-byte divides the total loss (in bits) by the UTF-8 bytes the scored tokens stand for,
so runs with different tokenizers compare fairly (Gao et al. 2020, The Pile, sec. 5). The loss is
kiln's `lm_loss` (torch cross-entropy); the sums are kept in Python floats (float64), one
`.item()` per batch, as the trainer has always done.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch

from kiln.model.transformer import lm_loss


@torch.no_grad()
def score_batches(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  byte_lengths: torch.Tensor, *, device: torch.device | str = "cpu",
                  autocast: contextlib.AbstractContextManager | None = None) -> dict:
    """Score (inputs, targets) batches; returns {loss, ppl, bpb, tokens, bytes}.

    `byte_lengths[id]` is the UTF-8 length of token `id` (kiln.data.tokenizer.token_byte_lengths);
    `autocast` wraps each forward pass (kiln.train.evaluate.autocast_context; None: fp32). The
    model is put in eval mode for the pass and given back in the mode it was in.
    """
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    total_loss, n_tokens, n_bytes = 0.0, 0, 0
    try:
        for x, y in batches:
            n_bytes += int(byte_lengths[y.cpu()].sum())
            x, y = x.to(device), y.to(device)
            with autocast:
                loss = lm_loss(model(x), y)
            total_loss += loss.item() * y.numel()
            n_tokens += y.numel()
    finally:
        model.train(was_training)
    if n_tokens == 0:
        raise ValueError("score_batches: no batches to score")
    loss = total_loss / n_tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": total_loss / math.log(2) / max(n_bytes, 1),
            "tokens": n_tokens, "bytes": n_bytes}
