"""Knowledge unlearning by gradient ascent (Jang et al. 2022, "Knowledge Unlearning for
Mitigating Privacy Risks in Language Models").

The forget sequences are split into sequential chunks of `chunk` sequences (0: all at once). For
each chunk the model takes AdamW steps on the *negated* LM loss of the chunk (plus, optionally, a
retain term: the LM loss, or the KL divergence from the original model, on windows of retain
text) until the chunk's extraction likelihood and memorization accuracy are no higher than the
held-out reference (measured before unlearning) plus `margin` - and, for canary rows, their
exposure no higher than the held-out canaries' plus `exposure_margin` bits - or `max_steps` is
spent. Jang et al. stop as soon as the forget set reaches the held-out level, so the chunk is
measured after every step by default (`check_every` 1) at a small lr: a coarser check or a large
lr overshoots far below the "never seen" level and damages the model.

With `secret_only` (default) the ascent on a canary row is masked to its secret's digits: the
loss counts only those tokens, not the prefix ("my code is ") or the '-' separators that every
canary - and the held-out ones - share, so the format is not unlearned with the secret. Rows without a secret
(plain text) ascend on every token. Metrics come from kiln.privacy.metrics; the optimizer and KL
are torch's (AdamW, F.kl_div); the masking is hand-written (a boolean mask on the per-token NLL).

Nothing here assumes one device: tensors go to the device of the model's parameters. Run under
FSDP it would need generation that gathers parameters; that path is not tested (docs/privacy.md).
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kiln.privacy.metrics import sequence_metrics, summarize, token_nll


@dataclass
class UnlearnOptions:
    chunk: int = 0  # sequences per sequential chunk; 0: all at once
    lr: float = 1e-4
    max_steps: int = 200  # step budget per chunk
    check_every: int = 1  # measure the chunk every this many steps (1: stop at the first step that reaches it)
    secret_only: bool = True  # canary rows: ascend only on the secret's tokens, not the shared prefix
    margin: float = 0.05  # stop when EL and MA <= held-out reference + margin
    exposure_margin: float = 1.0  # canaries: and exposure <= held-out reference + this (bits)
    retain_loss: str = "lm"  # lm | kl (used only with retain windows)
    retain_weight: float = 1.0
    retain_batch: int = 8
    clip_grad_norm: float = 1.0
    force: bool = False  # unlearn even when the forget set does not look memorized
    ngram: int = 5
    el_stride: int = 1
    candidates: int = 1000
    seed: int = 0


def _memorized(summary: dict, reference: dict, opts: "UnlearnOptions") -> bool:
    """Above the held-out reference on EL or MA (or, for canaries, exposure), beyond the margins."""
    if "exposure" in summary and "exposure" in reference \
            and summary["exposure"] > reference["exposure"] + opts.exposure_margin:
        return True
    return summary["el"] > reference["el"] + opts.margin or summary["ma"] > reference["ma"] + opts.margin


def ascent_mask(tokenizer, rows: list[dict], seqs: list[list[int]], secret_only: bool) -> list[list[bool]]:
    """Per target position (token 1..n-1 of each sequence): ascend on it? With `secret_only`, a
    canary row ascends only on the tokens that start a digit of its secret: the prefix and the
    '-' separators are the format every canary (and every held-out one) shares. A digit's token
    is located by encoding text up to it, so this holds for any tokenizer whose encodings of
    those prefixes are prefixes of the text's tokens (the byte tokenizer); otherwise the row
    ascends on every token."""
    out = []
    for row, ids in zip(rows, seqs):
        keep = [True] * (len(ids) - 1)
        if secret_only and row.get("secret") is not None and row.get("prefix") is not None:
            starts = []
            for i, ch in enumerate(row["secret"]):
                if ch.isdigit():
                    head = tokenizer.encode(row["prefix"] + row["secret"][:i])
                    if not 0 < len(head) < len(ids) or ids[:len(head)] != head:
                        starts = []
                        break
                    starts.append(len(head))
            if starts:
                keep = [False] * (len(ids) - 1)
                for t in starts:
                    keep[t - 1] = True  # target j is token j + 1
        out.append(keep)
    return out


def unlearn(model: torch.nn.Module, tokenizer, forget: list[dict], heldout: list[dict],
            retain_windows: list[list[int]], opts: UnlearnOptions,
            log: Callable[[str], None] = print) -> dict:
    """Unlearn `forget` rows in place on `model`; returns the report (metrics before/after, per
    chunk). With a forget set that is not memorized (and not `force`) the model is left untouched
    and the report's status is "not_memorized"."""
    metric_kw = dict(ngram=opts.ngram, stride=opts.el_stride, candidates=opts.candidates, seed=opts.seed)
    reference = summarize(sequence_metrics(model, tokenizer, heldout, **metric_kw))
    before_items = sequence_metrics(model, tokenizer, forget, **metric_kw)
    before = summarize(before_items)
    report = {"options": asdict(opts), "heldout_reference": reference, "forget_before": before, "chunks": []}
    log(f"forget set: EL {before['el']:.3f} MA {before['ma']:.3f}; held-out reference: "
        f"EL {reference['el']:.3f} MA {reference['ma']:.3f}")
    if not _memorized(before, reference, opts) and not opts.force:
        report["status"] = "not_memorized"
        return report

    device = next(model.parameters()).device
    original = None
    if retain_windows and opts.retain_loss == "kl":
        original = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
    rng = random.Random(opts.seed)
    size = opts.chunk or len(forget)
    total_steps, t0 = 0, time.perf_counter()
    for start in range(0, len(forget), size):
        rows = forget[start:start + size]
        seqs = [tokenizer.encode(r["text"]) for r in rows]
        keep = ascent_mask(tokenizer, rows, seqs, opts.secret_only)
        width = max(len(s) for s in seqs) - 1
        mask = torch.tensor([k + [False] * (width - len(k)) for k in keep], device=device)
        n_targets = int(mask.sum())
        # Measured now, not before unlearning: earlier chunks' steps may already have brought this
        # chunk to the reference, and a step beyond it only overshoots.
        summary = summarize(before_items[start:start + size] if start == 0
                            else sequence_metrics(model, tokenizer, rows, **metric_kw))
        steps, reached = 0, not _memorized(summary, reference, opts)
        while not reached and steps < opts.max_steps:
            model.train()
            nll, _ = token_nll(model, seqs)
            loss = -(nll * mask).sum() / n_targets  # gradient ascent on the chunk's (secret) tokens
            if retain_windows:
                batch = [retain_windows[rng.randrange(len(retain_windows))] for _ in range(opts.retain_batch)]
                inputs = torch.tensor([w[:-1] for w in batch], device=device)
                targets = torch.tensor([w[1:] for w in batch], device=device)
                logits = model(inputs).float()
                if original is None:
                    retain = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                else:
                    with torch.no_grad():
                        ref_logp = original(inputs).float().log_softmax(-1)
                    retain = F.kl_div(logits.log_softmax(-1).flatten(0, 1), ref_logp.flatten(0, 1),
                                      log_target=True, reduction="batchmean")
                loss = loss + opts.retain_weight * retain
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if opts.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip_grad_norm)
            optimizer.step()
            steps += 1
            if steps % opts.check_every == 0 or steps == opts.max_steps:
                summary = summarize(sequence_metrics(model, tokenizer, rows, **metric_kw))
                if not _memorized(summary, reference, opts):
                    reached = True
                    break
        total_steps += steps
        report["chunks"].append({"first": start, "size": len(rows), "steps": steps, "reached_reference": reached,
                                 **{k: summary[k] for k in ("el", "ma", "exposure") if k in summary}})
        log(f"chunk {start // size + 1}: {len(rows)} sequences, {steps} steps, EL {summary['el']:.3f} "
            f"MA {summary['ma']:.3f}{'' if reached else ' (step budget spent)'}")
    model.eval()
    report["forget_after"] = summarize(sequence_metrics(model, tokenizer, forget, **metric_kw))
    report["heldout_after"] = summarize(sequence_metrics(model, tokenizer, heldout, **metric_kw))
    report["steps"] = total_steps
    report["seconds"] = time.perf_counter() - t0
    report["status"] = "done" if all(c["reached_reference"] for c in report["chunks"]) else "step_budget"
    return report

