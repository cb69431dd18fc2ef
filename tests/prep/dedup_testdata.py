"""Shared helpers for the dedup tests: English-like documents and controlled word edits."""

from __future__ import annotations

import random

WORDS = ("the of and to in that have with it for not on be as at this but by from they we say her she or an "
         "will my one all would there their what so up out if about who get which go me when make can like time "
         "no just him know take people into year your good some could them see other than then now look only "
         "come its over think also back after use two how our work first well way even new want because river "
         "stone light paper window garden music winter market bridge forest silver engine doctor island").split()


def random_docs(n: int, words: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def edit_words(text: str, n_edits: int, seed: int = 0) -> str:
    """Substitute n_edits words at random positions (with made-up words, so shingles change)."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), n_edits):
        words[i] = f"zq{rng.randrange(10**6)}"
    return " ".join(words)
