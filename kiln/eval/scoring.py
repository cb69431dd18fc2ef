"""The one scorer: loss, perplexity and bits-per-byte of a model over batches of token windows.

Used by the trainer's periodic evaluation (kiln.train.evaluate), `kiln eval`'s perplexity part
and the robustness probe (kiln.eval.perplexity), so the three report the same numbers for the
same windows. Windows are cut by kiln.data.loader (TokenWindows, window_batches).

Bits-per-byte divides the total loss (in bits) by the UTF-8 bytes the scored tokens stand for,
so runs with different tokenizers compare fairly (Gao et al. 2020, The Pile, sec. 5). The loss is
kiln's `lm_loss` (torch cross-entropy); the sums are kept in Python floats (float64), one
`.item()` per batch, as the trainer has always done.

Split over ranks (the trainer's evaluation under data and context parallelism; the unlearning
command's validation, kiln/privacy/validation.py, splits its own): kiln.data.loader
`rank_batches` gives each data-parallel rank one contiguous block of the windows, cut so every
rank runs the same number of forwards of the same shapes (padding rows, rows beyond a batch's
`rows`, are copies whose loss is not counted), `context` cuts each window to this
rank's zig-zag slice for the cp ring, and the sums (loss x tokens, tokens, bytes) are all-reduced
in float64 over `group`, so N ranks do 1/N of the work and each returns the one-process numbers
up to the order of the sums.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import torch.distributed as dist

from kiln.model.transformer import lm_loss


@torch.no_grad()
def score_batches(model: torch.nn.Module, batches: Iterable[tuple], byte_lengths: torch.Tensor, *,
                  device: torch.device | str = "cpu", autocast: contextlib.AbstractContextManager | None = None,
                  context=None, group=None) -> dict:
    """Score (inputs, targets[, rows[, doc_ids]]) batches; returns {loss, ppl, bpb, tokens,
    bytes}, and with a `group` also `rank_tokens` (the predictions this rank scored). `doc_ids`
    (the inputs' documents, kiln.data.loader `window_batches`) mask attention to each token's own
    document, as training does with data.windows = "packed_masked"; under cp they stay whole.

    `byte_lengths[id]` is the UTF-8 length of token `id` (kiln.data.tokenizer.token_byte_lengths);
    `autocast` wraps each forward pass (kiln.train.evaluate.autocast_context; None: fp32). The
    model is put in eval mode for the pass and given back in the mode it was in. `context`: a
    kiln.parallel.context_parallel.ContextParallel (this rank scores its slice of every window
    through the ring); `group`: a process group the sums are all-reduced over (None: not reduced).
    """
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    ring = context if context is not None else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    total_loss, n_tokens, n_bytes = 0.0, 0, 0
    try:
        for x, y, *extra in batches:
            rows = extra[0] if extra else len(x)
            masked = {"doc_ids": extra[1].to(device)} if len(extra) > 1 else {}
            x, y = x.to(device), y.to(device)
            if context is not None:
                x, y = context.shard(x, y)
            with autocast, ring:
                if hasattr(model, "eval_loss"):  # the model scores the batch itself: kiln's
                    # Transformer through its training loss path (chunked / vocab-parallel: no full
                    # fp32 logits), the pipeline on its last stage (PipelineEvalModel)
                    loss = model.eval_loss(x, y, rows, **masked)
                else:
                    logits = model(x, **masked)
                    loss = lm_loss(logits[:rows], y[:rows]) if rows else None
            if rows == 0:  # a padding batch: its forward only joins the others' collectives
                continue
            y = y[:rows]
            n_bytes += int(byte_lengths[y.cpu()].sum())
            total_loss += loss.item() * y.numel()
            n_tokens += y.numel()
    finally:
        model.train(was_training)
    rank_tokens, reduced = n_tokens, {}
    if group is not None:
        sums = torch.tensor([total_loss, n_tokens, n_bytes], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        total_loss, n_tokens, n_bytes = sums.tolist()
        n_tokens, n_bytes = int(n_tokens), int(n_bytes)
        reduced = {"rank_tokens": rank_tokens}
    if n_tokens == 0:
        raise ValueError("score_batches: no batches to score")
    loss = total_loss / n_tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": total_loss / math.log(2) / max(n_bytes, 1),
            "tokens": n_tokens, "bytes": n_bytes, **reduced}
