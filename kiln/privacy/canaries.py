"""Canaries: random secret sequences of one documented format, inserted into training data.

Format (Carlini et al. 2019, "The Secret Sharer"): `"{prefix}{secret}"` with the prefix
`"my code is "` and the secret `digits` random decimal digits joined by "-", e.g.
`"my code is 7-3-9-1-0-2"`. The space of secrets has 10**digits members, small enough to
enumerate (digits <= 3) or to sample candidates from (kiln.privacy.metrics.exposure).

Every call draws `n` inserted canaries plus `n` held-out canaries of the same format that are
never inserted: the held-out ones are the "never seen" reference of the memorization metrics and
of `kiln unlearn`'s stopping rule. The record (`canaries.jsonl`: text, prefix, secret, digits,
repeats, heldout) is written into the run directory (or the prep step's `record` path), never into
token-shard metadata, and the documents carry no marker a model could read besides their text.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.data.corpus import is_val
from kiln.data.documents import Doc
from kiln.io import atomic_write_text

CANARY_PREFIX = "my code is "
CANARY_FILE = "canaries.jsonl"


@dataclass
class Canary:
    text: str
    prefix: str
    secret: str
    digits: int
    repeats: int  # times inserted into the training documents (0 for held-out canaries)
    heldout: bool


def format_secret(values: list[int] | tuple[int, ...]) -> str:
    return "-".join(str(v) for v in values)


def random_secret(rng: random.Random, digits: int) -> str:
    return format_secret([rng.randrange(10) for _ in range(digits)])


def make_canaries(n: int, repeats: int, digits: int, seed: int) -> list[Canary]:
    """`n` inserted canaries (each to be repeated `repeats` times) then `n` held-out ones, all
    with distinct secrets (so 2n must not exceed the 10**digits secrets)."""
    if 2 * n > 10 ** digits:
        raise ValueError(f"{2 * n} distinct canaries need more than {digits} digits (10**{digits} secrets)")
    rng = random.Random(f"kiln-canaries-{seed}")
    secrets: list[str] = []
    seen: set[str] = set()
    while len(secrets) < 2 * n:
        s = random_secret(rng, digits)
        if s not in seen:
            seen.add(s)
            secrets.append(s)
    return [Canary(CANARY_PREFIX + s, CANARY_PREFIX, s, digits, 0 if i >= n else repeats, i >= n)
            for i, s in enumerate(secrets)]


def canary_docs(canaries: list[Canary], seed: int, val_fraction: float = 0.0) -> list[Doc]:
    """One document per repetition of each inserted canary, in a seeded random order. Ids are
    chosen so that kiln.data.corpus.is_val(id, val_fraction) is False: every copy trains."""
    docs = []
    for i, c in enumerate(x for x in canaries if not x.heldout):
        for r in range(c.repeats):
            salt = 0
            while val_fraction > 0 and is_val(f"canary-{i}-{r}-{salt}", val_fraction):
                salt += 1
            docs.append(Doc(f"canary-{i}-{r}-{salt}", c.text, {}))
    random.Random(f"kiln-canary-order-{seed}").shuffle(docs)
    return docs


def interleave(docs: list[Doc], inserted: list[Doc], seed: int) -> list[Doc]:
    """`docs` with `inserted` spread over seeded random positions (their order kept)."""
    rng = random.Random(f"kiln-canary-positions-{seed}")
    slots = sorted(rng.randrange(len(docs) + 1) for _ in inserted)
    out, j = [], 0
    for pos, doc in enumerate(docs):
        while j < len(slots) and slots[j] == pos:
            out.append(inserted[j])
            j += 1
        out.append(doc)
    out.extend(inserted[j:])
    return out


def write_record(path: str | Path, canaries: list[Canary]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(asdict(c)) + "\n" for c in canaries))
