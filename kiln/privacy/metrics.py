"""Memorization metrics of a model on given sequences, and the "never seen" reference.

- `sequence_nll`: summed negative log-likelihood (log-perplexity, nats) of each whole sequence,
  batched forward passes with padding masked out (torch `cross_entropy(reduction="none")`).
- `exposure` (Carlini et al. 2019, "The Secret Sharer"): rank of the true canary's log-perplexity
  among candidates of the same format; exposure = log2(|candidates|) - log2(rank). With
  10**digits <= `candidates` + 1 the whole secret space is enumerated (exact exposure); otherwise
  `candidates` random secrets are sampled and the true one added, so exposure is the sampled
  estimate, at most log2(candidates + 1). An unseen canary has exposure ~1.4 bits on average.
- `memorization_accuracy` (Jang et al. 2022, MA): share of positions whose greedy next token
  (argmax, teacher forced) is the true one.
- `extraction_likelihood` (Jang et al. 2022, EL_n): mean over prefix lengths t of the n-gram
  overlap between the greedy continuation of x[:t] and the true suffix x[t:]; `stride` > 1
  evaluates every stride-th prefix only. `sequence_metrics` decodes each prefix length for a batch
  of sequences together (`greedy_suffixes`, hand-written batching over the model's KV cache),
  which gives the same tokens as kiln.model.generate's greedy decoding per prefix
  (`extraction_likelihood`, kept as the reference implementation) with far fewer calls.

Data parallel (`Shard`): each rank measures a contiguous block of the rows and the per-row results
are gathered (torch.distributed.all_gather_object), so every rank returns the same list. Under
FSDP every forward is a collective, so every rank runs the same number of forwards: block sizes
are padded to the largest, batch counts and decoding lengths are the maximum over ranks
(all_reduce MAX), and a rank with nothing left runs a one-token forward whose result it drops.
All functions take the model's device from its parameters, so they run on CPU and GPU alike.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.model.generate import generate


@dataclass(frozen=True)
class Shard:
    """This rank's place among the data-parallel ranks (rank 0 of 1: one process). The collectives
    use the default process group, so every process must be a data-parallel rank (the unlearn
    command refuses tp/cp/pp layouts)."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"  # where collective tensors live (cuda under NCCL)

    def block(self, items: Sequence) -> tuple[list, int]:
        """(this rank's contiguous block padded to the common size with copies of items[0], the
        number of real items in it)."""
        per = -(-len(items) // self.size)
        mine = list(items[self.rank * per:(self.rank + 1) * per])
        real = len(mine)
        return mine + [items[0]] * (per - real if items else 0), real

    def max(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            value = value.detach().clone()
            dist.all_reduce(value)
        return value

    def gather(self, local: list) -> list:
        """Every rank's list, concatenated in rank order."""
        if self.size == 1:
            return list(local)
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, list(local))
        return [x for part in out for x in part]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batches(items: Sequence, size: int, shard: Shard) -> list[list]:
    """`items` in batches of `size`, padded with empty batches to the largest count over ranks."""
    out = [list(items[i:i + size]) for i in range(0, len(items), size)]
    return out + [[] for _ in range(shard.max(len(out)) - len(out))]


def _idle_forward(model: torch.nn.Module) -> None:
    """A forward whose result is dropped: joins the collectives of a forward (FSDP's all-gather)."""
    model(torch.zeros(1, 1, dtype=torch.long, device=_device(model)))


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
def _nll_and_ma(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int,
                shard: Shard) -> tuple[list[float], list[float]]:
    """(summed NLL, memorization accuracy) of each of this rank's sequences."""
    nll_out: list[float] = []
    ma_out: list[float] = []
    for batch in _batches(seqs, batch_size, shard):
        if not batch:
            _idle_forward(model)
            continue
        nll, hits = token_nll(model, batch)
        lengths = torch.tensor([len(s) - 1 for s in batch], device=hits.device)
        nll_out.extend(nll.sum(1).tolist())
        ma_out.extend((hits.sum(1).float() / lengths).tolist())
    return nll_out, ma_out


def sequence_nll(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 64,
                 shard: Shard = Shard()) -> list[float]:
    """Summed NLL (nats) of each sequence's tokens after the first (this rank's, under `shard`)."""
    return _nll_and_ma(model, seqs, batch_size, shard)[0]


def memorization_accuracy(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 64,
                          shard: Shard = Shard()) -> list[float]:
    return _nll_and_ma(model, seqs, batch_size, shard)[1]


def ngram_overlap(generated: Sequence[int], reference: Sequence[int], n: int) -> float:
    """Share of the reference's n-grams (as a set) that the generated sequence also contains;
    sequences shorter than n compare as one shorter gram."""
    n = max(1, min(n, len(reference)))
    ref = {tuple(reference[i:i + n]) for i in range(len(reference) - n + 1)}
    gen = {tuple(generated[i:i + n]) for i in range(len(generated) - n + 1)}
    return len(ref & gen) / len(ref) if ref else 0.0


def extraction_likelihood(model: torch.nn.Module, seq: Sequence[int], n: int = 5, stride: int = 1) -> float:
    """EL_n of one sequence, one kiln.model.generate call per prefix (the reference for
    `greedy_suffixes`; one process only)."""
    scores = []
    for t in range(1, len(seq), stride):
        suffix = list(seq[t:])
        continuation = generate(model, list(seq[:t]), max_new_tokens=len(suffix), temperature=0.0)
        scores.append(ngram_overlap(continuation, suffix, n))
    return sum(scores) / len(scores) if scores else 0.0


@torch.no_grad()
def greedy_suffixes(model: torch.nn.Module, seqs: Sequence[Sequence[int]], stride: int = 1, batch: int = 64,
                    shard: Shard = Shard()) -> list[list[list[int]]]:
    """For each sequence, the greedy continuation of each prefix seq[:t] (t = 1, 1+stride, ...) to
    the sequence's length. Sequences are taken `batch` at a time and, for each t, every sequence
    longer than t is decoded together with the model's KV cache (kiln.model.transformer.KVCache):
    one forward of the [n, t] prefixes, then one [n, 1] forward per new token. All rows share the
    prefix length, so no padding is needed; rows past their own length decode on and are cut."""
    out: list[list[list[int]]] = [[] for _ in seqs]
    for group in _batches(list(range(len(seqs))), batch, shard):
        longest = shard.max(max((len(seqs[i]) for i in group), default=0))
        for t in range(1, longest, stride):
            rows = [i for i in group if len(seqs[i]) > t]
            calls = longest - t  # the same on every rank: FSDP's forwards are collectives
            if not rows:
                for _ in range(calls):
                    _idle_forward(model)
                continue
            device = _device(model)
            cache = model.new_cache(len(rows), longest)
            prompt = torch.tensor([list(seqs[i][:t]) for i in rows], device=device)
            logits = model(prompt, cache=cache, start_pos=0)[:, -1]
            tokens = [logits.argmax(-1)]
            for j in range(1, calls):
                logits = model(tokens[-1][:, None], cache=cache, start_pos=t + j - 1)[:, -1]
                tokens.append(logits.argmax(-1))
            gen = torch.stack(tokens, 1).tolist()
            for k, i in enumerate(rows):
                out[i].append(gen[k][:len(seqs[i]) - t])
    return out


def exposure_candidates(secret: str, digits: int, candidates: int, seed: int) -> tuple[list[str], bool]:
    """(candidate secrets, the true one included; exact: the whole space)."""
    from kiln.privacy.canaries import format_secret, random_secret

    space = 10 ** digits
    if space <= candidates + 1:
        return [format_secret([int(c) for c in str(v).zfill(digits)]) for v in range(space)], True
    rng = random.Random(f"kiln-exposure-{seed}-{secret}")
    secrets = [secret]
    while len(secrets) < candidates + 1:
        s = random_secret(rng, digits)
        if s != secret:
            secrets.append(s)
    return secrets, False


def _exposure_from(nll: list[float], secrets: list[str], secret: str, exact: bool) -> dict:
    true_nll = nll[secrets.index(secret)]
    rank = 1 + sum(1 for v in nll if v < true_nll)
    return {"exposure": math.log2(len(secrets)) - math.log2(rank), "rank": rank, "candidates": len(secrets),
            "exact": exact, "nll": true_nll}


def exposure(model: torch.nn.Module, tokenizer, prefix: str, secret: str, digits: int,
             candidates: int = 1000, seed: int = 0) -> dict:
    """Exposure of the canary `prefix + secret` (secret: `digits` digits joined by '-')."""
    secrets, exact = exposure_candidates(secret, digits, candidates, seed)
    nll = sequence_nll(model, [tokenizer.encode(prefix + s) for s in secrets])
    return _exposure_from(nll, secrets, secret, exact)


def sequence_metrics(model: torch.nn.Module, tokenizer, rows: list[dict], *, ngram: int = 5, stride: int = 1,
                     candidates: int = 1000, seed: int = 0, with_exposure: bool = True,
                     shard: Shard = Shard()) -> list[dict]:
    """Per-row {ma, el, nll_per_token, exposure?} for rows {"text", optional canary fields
    "prefix", "secret", "digits"} (exposure only for canaries, and only `with_exposure`). Under
    `shard` every rank passes the same rows and gets the same list back."""
    if not rows:
        return []
    was_training = model.training
    model.eval()
    try:
        mine, real = shard.block(rows)
        seqs = [tokenizer.encode(r["text"]) for r in mine]
        nll, ma = _nll_and_ma(model, seqs, 64, shard)
        suffixes = greedy_suffixes(model, seqs, stride, shard=shard)
        out = []
        for ids, m, s, gens in zip(seqs, ma, nll, suffixes):
            scores = [ngram_overlap(g, ids[t:], ngram) for g, t in zip(gens, range(1, len(ids), stride))]
            out.append({"ma": m, "el": sum(scores) / len(scores) if scores else 0.0,
                        "nll_per_token": s / (len(ids) - 1)})
        if with_exposure:  # all candidates of this rank's canaries in one lockstep pass
            spans, cands = [], []
            for k, row in enumerate(mine):
                if row.get("secret") is not None:
                    secrets, exact = exposure_candidates(row["secret"], row["digits"], candidates, seed)
                    spans.append((k, secrets, exact, len(cands)))
                    cands.extend(tokenizer.encode(row["prefix"] + x) for x in secrets)
            cand_nll = sequence_nll(model, cands, shard=shard)
            for k, secrets, exact, at in spans:
                row = mine[k]
                out[k]["exposure"] = _exposure_from(cand_nll[at:at + len(secrets)], secrets, row["secret"],
                                                    exact)["exposure"]
        return shard.gather(out[:real])
    finally:
        model.train(was_training)
        reshard(model)


def reshard(model: torch.nn.Module) -> None:
    """Under FSDP, free the parameters a forward left gathered (the last block is not resharded
    after forward), so `model.parameters()` are the sharded ones again - an optimizer built or a
    checkpoint saved after measuring must see those. A no-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def summarize(items: list[dict]) -> dict:
    """Means of each metric over items (keys present in every item)."""
    if not items:
        return {"n": 0}
    keys = [k for k in items[0] if all(k in it for it in items)]
    return {"n": len(items), **{k: sum(it[k] for it in items) / len(items) for k in keys}}
