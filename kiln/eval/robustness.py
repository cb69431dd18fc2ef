"""Robustness probe: how much worse does a model score text that means the same but looks different?

Perturbations change case, whitespace, spelling (typos) or punctuation, never the words' order.
Each is a function `(text, rng) -> text`; randomness comes from a `random.Random` seeded from
(seed, perturbation name, document index), so results are identical across runs and processes.
A spec string names a perturbation and optionally its rate: `"typos:0.1"`, `"spaces"`, `"upper"`.
"""

from __future__ import annotations

import random
import re
import string
from pathlib import Path
from typing import Callable

from kiln.errors import KilnError

Perturbation = Callable[[str, random.Random], str]

DEFAULT_RATES = {"spaces": 0.1, "tabs": 0.2, "newlines": 0.1, "typos": 0.05}
DEFAULT_PROBE = ("lower", "upper", "title", "spaces", "tabs", "newlines", "typos", "punctuation")
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")


def lower(text: str, rng: random.Random | None = None) -> str:
    return text.lower()


def upper(text: str, rng: random.Random | None = None) -> str:
    return text.upper()


def title(text: str, rng: random.Random | None = None) -> str:
    """Capitalize each word's first letter (only letters after whitespace; `don't` stays intact)."""
    return re.sub(r"(^|\s)(\w)", lambda m: m.group(1) + m.group(2).upper(), text)


def strip_punctuation(text: str, rng: random.Random | None = None) -> str:
    return _PUNCTUATION.sub("", text)


def extra_spaces(text: str, rng: random.Random, rate: float = DEFAULT_RATES["spaces"]) -> str:
    """After each space, with probability `rate`, add one to three more."""
    return re.sub(" ", lambda m: " " * (1 + rng.randint(1, 3)) if rng.random() < rate else " ", text)


def tabs(text: str, rng: random.Random, rate: float = DEFAULT_RATES["tabs"]) -> str:
    """Replace each space with a tab with probability `rate`."""
    return re.sub(" ", lambda m: "\t" if rng.random() < rate else " ", text)


def newlines(text: str, rng: random.Random, rate: float = DEFAULT_RATES["newlines"]) -> str:
    """Replace each space with a line break with probability `rate`."""
    return re.sub(" ", lambda m: "\n" if rng.random() < rate else " ", text)


def typos(text: str, rng: random.Random, rate: float = DEFAULT_RATES["typos"]) -> str:
    """At each letter, with probability `rate`, swap it with the next letter (when that is a
    letter too) or drop it (half the time each). Digits and symbols are left alone."""
    chars = list(text)
    out: list[str] = []
    i = 0
    while i < len(chars):
        c = chars[i]
        if c.isalpha() and rng.random() < rate:
            if rng.random() < 0.5 and i + 1 < len(chars) and chars[i + 1].isalpha():
                out += [chars[i + 1], c]
                i += 2
                continue
            i += 1  # dropped
            continue
        out.append(c)
        i += 1
    return "".join(out)


FIXED: dict[str, Callable[[str, random.Random | None], str]] = {
    "lower": lower, "upper": upper, "title": title, "punctuation": strip_punctuation,
}
RATED: dict[str, Callable[..., str]] = {"spaces": extra_spaces, "tabs": tabs, "newlines": newlines, "typos": typos}
NAMES = tuple(FIXED) + tuple(RATED)


def parse_perturbation(spec: str) -> tuple[str, Perturbation]:
    """`"typos:0.1"` -> ("typos:0.1", function). Unknown names and bad rates are KilnErrors."""
    name, _, rate_text = spec.strip().partition(":")
    if name in FIXED:
        if rate_text:
            raise KilnError(f"perturbation {spec!r}: {name} takes no rate")
        return name, FIXED[name]
    if name not in RATED:
        raise KilnError(f"unknown perturbation {spec!r}; expected one of {', '.join(NAMES)} "
                        f"(rated ones as NAME:RATE, e.g. typos:0.05)")
    try:
        rate = float(rate_text) if rate_text else DEFAULT_RATES[name]
    except ValueError:
        raise KilnError(f"perturbation {spec!r}: rate {rate_text!r} is not a number") from None
    if not 0.0 <= rate <= 1.0:
        raise KilnError(f"perturbation {spec!r}: rate must be in [0, 1]")
    fn = RATED[name]
    return f"{name}:{rate:g}", lambda text, rng: fn(text, rng, rate)


def perturb(texts: list[str], spec: str, seed: int = 0) -> list[str]:
    """Apply one perturbation to each text, deterministically for (seed, spec, index)."""
    label, fn = parse_perturbation(spec)
    # str seeds are hashed with SHA-512 by random.Random, so this does not depend on PYTHONHASHSEED
    return [fn(text, random.Random(f"{seed}/{label}/{i}")) for i, text in enumerate(texts)]


def shard_texts(shard_dir: str | Path, tokenizer, split: str = "val", max_chars: int = 200_000) -> list[str]:
    """Documents of a token-shard split decoded back to text (lossless for byte and byte-level BPE
    tokenizers), in order, until `max_chars` characters: the probe needs text to perturb."""
    from kiln.data.shards import ShardSet

    shards = ShardSet(shard_dir, split)
    texts: list[str] = []
    total = 0
    for shard in range(len(shards.docs)):
        for doc in range(shards.docs[shard].shape[0] - 1):
            text = tokenizer.decode(shards.document(shard, doc).tolist())
            if not text.strip():
                continue
            texts.append(text[: max_chars - total])
            total += len(texts[-1])
            if total >= max_chars:
                return texts
    if not texts:
        raise KilnError(f"{shard_dir}: the {split} split has no documents to probe; pass text files instead")
    return texts


def robustness_probe(model, tokenizer, texts: list[str], seq_len: int,
                     perturbations: list[str] | tuple[str, ...] = DEFAULT_PROBE, *, seed: int = 0,
                     batch_size: int = 8, device: str = "cpu", max_tokens: int = 0,
                     autocast=None, masked: bool = False) -> dict[str, dict[str, float]]:
    """Score `texts` clean and under each perturbation with `evaluate_texts` (kiln's one scorer;
    `autocast` and `masked`, attention within each text, as there).

    Returns {"clean": {...}, spec: {loss, ppl, bpb, delta_loss, delta_bpb, tokens, bytes}, ...}; deltas
    are relative to clean (positive = worse). bpb divides by the perturbed text's own bytes, so it
    stays comparable when a perturbation adds or removes characters.
    """
    from kiln.eval.perplexity import evaluate_texts

    if not texts or not any(t.strip() for t in texts):
        raise KilnError("robustness probe: no text to score (expected non-empty documents)")
    specs = [parse_perturbation(s)[0] for s in perturbations]  # validate every spec before any work

    def score(docs: list[str]) -> dict:
        r = evaluate_texts(model, tokenizer, docs, seq_len=seq_len, batch_size=batch_size, device=device,
                           max_tokens=max_tokens, autocast=autocast, masked=masked)
        return {k: r[k] for k in ("loss", "ppl", "bpb", "tokens", "bytes")}

    clean = score(texts)
    results: dict[str, dict[str, float]] = {"clean": {**clean, "delta_loss": 0.0, "delta_bpb": 0.0}}
    for spec in specs:
        r = score(perturb(texts, spec, seed))
        results[spec] = {**r, "delta_loss": r["loss"] - clean["loss"], "delta_bpb": r["bpb"] - clean["bpb"]}
    return results
