"""Memorization metrics of a model on given sequences, and the "never seen" reference.

- `sequence_nll`: summed negative log-likelihood (log-perplexity, nats) of each whole sequence,
  one batched forward pass with padding masked out (torch `cross_entropy(reduction="none")`).
- `exposure` (Carlini et al. 2019, "The Secret Sharer"): rank of the true canary's log-perplexity
  among candidates of the same format; exposure = log2(|candidates|) - log2(rank). With
  10**digits <= `candidates` + 1 the whole secret space is enumerated (exact exposure); otherwise
  `candidates` random secrets are sampled and the true one added, so exposure is the sampled
  estimate, at most log2(candidates + 1). An unseen canary has exposure ~1.4 bits on average.
- `memorization_accuracy` (Jang et al. 2022, MA): share of positions whose greedy next token
  (argmax, teacher forced) is the true one.
- `extraction_likelihood` (Jang et al. 2022, EL_n): mean over prefix lengths t of the n-gram
  overlap between the greedy continuation of x[:t] (kiln.model.generate) and the true suffix
  x[t:]; `stride` > 1 evaluates every stride-th prefix only (cost: one generation per prefix).

All functions take the model's device from its parameters, so they run on CPU and GPU alike.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch
import torch.nn.functional as F

from kiln.model.generate import generate


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def pad_batch(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for next-token prediction; padded targets are -100 (ignored)."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = torch.as_tensor(list(s), dtype=torch.long)
        inputs[i, :len(s) - 1] = s[:-1]
        targets[i, :len(s) - 1] = s[1:]
    return inputs.to(device), targets.to(device)


def token_nll(model: torch.nn.Module, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL [B, T] (0 at padding) and the logits' argmax hits [B, T] (False at padding);
    differentiable when grad is enabled (kiln.privacy.unlearn ascends on it)."""
    inputs, targets = pad_batch(seqs, _device(model))
    logits = model(inputs).float()
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    hits = (logits.argmax(-1) == targets) & (targets != -100)
    return nll, hits


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 64) -> list[float]:
    """Summed NLL (nats) of each sequence's tokens after the first."""
    out: list[float] = []
    for i in range(0, len(seqs), batch_size):
        nll, _ = token_nll(model, seqs[i:i + batch_size])
        out.extend(nll.sum(1).tolist())
    return out


@torch.no_grad()
def memorization_accuracy(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 64) -> list[float]:
    out: list[float] = []
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i:i + batch_size]
        _, hits = token_nll(model, batch)
        out.extend((hits.sum(1).float() / torch.tensor([len(s) - 1 for s in batch], device=hits.device)).tolist())
    return out


def ngram_overlap(generated: Sequence[int], reference: Sequence[int], n: int) -> float:
    """Share of the reference's n-grams (as a set) that the generated sequence also contains;
    sequences shorter than n compare as one shorter gram."""
    n = max(1, min(n, len(reference)))
    ref = {tuple(reference[i:i + n]) for i in range(len(reference) - n + 1)}
    gen = {tuple(generated[i:i + n]) for i in range(len(generated) - n + 1)}
    return len(ref & gen) / len(ref) if ref else 0.0


def extraction_likelihood(model: torch.nn.Module, seq: Sequence[int], n: int = 5, stride: int = 1) -> float:
    """EL_n of one sequence: greedy continuation of each prefix vs the true suffix."""
    scores = []
    for t in range(1, len(seq), stride):
        suffix = list(seq[t:])
        continuation = generate(model, list(seq[:t]), max_new_tokens=len(suffix), temperature=0.0)
        scores.append(ngram_overlap(continuation, suffix, n))
    return sum(scores) / len(scores) if scores else 0.0


def exposure(model: torch.nn.Module, tokenizer, prefix: str, secret: str, digits: int,
             candidates: int = 1000, seed: int = 0) -> dict:
    """Exposure of the canary `prefix + secret` (secret: `digits` digits joined by '-')."""
    from kiln.privacy.canaries import format_secret, random_secret

    space = 10 ** digits
    if space <= candidates + 1:
        secrets = [format_secret([int(c) for c in str(v).zfill(digits)]) for v in range(space)]
        exact = True
    else:
        rng = random.Random(f"kiln-exposure-{seed}-{secret}")
        secrets = [secret]
        while len(secrets) < candidates + 1:
            s = random_secret(rng, digits)
            if s != secret:
                secrets.append(s)
        exact = False
    seqs = [tokenizer.encode(prefix + s) for s in secrets]
    nll = sequence_nll(model, seqs)
    true_nll = nll[secrets.index(secret)]
    rank = 1 + sum(1 for v in nll if v < true_nll)
    return {"exposure": math.log2(len(secrets)) - math.log2(rank), "rank": rank, "candidates": len(secrets),
            "exact": exact, "nll": true_nll}


def sequence_metrics(model: torch.nn.Module, tokenizer, rows: list[dict], *, ngram: int = 5, stride: int = 1,
                     candidates: int = 1000, seed: int = 0) -> list[dict]:
    """Per-row {ma, el, nll_per_token, exposure?} for rows {"text", optional canary fields
    "prefix", "secret", "digits"} (exposure only for canaries)."""
    was_training = model.training
    model.eval()
    try:
        seqs = [tokenizer.encode(r["text"]) for r in rows]
        ma = memorization_accuracy(model, seqs)
        nll = sequence_nll(model, seqs)
        out = []
        for row, ids, m, s in zip(rows, seqs, ma, nll):
            item = {"ma": m, "el": extraction_likelihood(model, ids, ngram, stride), "nll_per_token": s / (len(ids) - 1)}
            if row.get("secret") is not None:
                item["exposure"] = exposure(model, tokenizer, row["prefix"], row["secret"], row["digits"],
                                            candidates, seed)["exposure"]
            out.append(item)
        return out
    finally:
        model.train(was_training)


def summarize(items: list[dict]) -> dict:
    """Means of each metric over items (keys present in every item)."""
    if not items:
        return {"n": 0}
    keys = [k for k in items[0] if all(k in it for it in items)]
    return {"n": len(items), **{k: sum(it[k] for it in items) / len(items) for k in keys}}
