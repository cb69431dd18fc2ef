"""Exact-substring dedup with a suffix array (Lee et al. 2021, "Deduplicating Training Data Makes
Language Models Better").

The corpus is the UTF-8 bytes of all documents joined by 0xFF (a byte UTF-8 never contains, so
no match crosses a document boundary once spans are clipped at it). `pydivsufsort` builds the
suffix array (libdivsufsort) and its LCP array (Kasai) or longest-previous-factor array:

* keep="first" (the paper's "all but one"): position p starts a repeat when the longest prefix
  of its suffix that also starts at an earlier position (LPF[p]) is >= k; [p, p + LPF[p]) is
  removed. Every removed byte thus has a copy earlier in the corpus.
* keep="none": suffixes adjacent in the suffix array with LCP >= k both start a duplicated span
  of that length; every occurrence is removed.

Spans are unioned (a +1/-1 difference array), widened to whole UTF-8 characters, and cut out of
their documents. Memory: ~4 bytes (int32 positions, < 2 GiB corpora; 8 beyond) for each of the
suffix array and the LCP/LPF array per corpus byte, plus the bytes themselves: ~10-14 bytes per
byte in total (measured by benchmarks/dedup_suffix_array.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pydivsufsort

from kiln.errors import ConfigError

SEPARATOR = 0xFF
KEEP_MODES = ("first", "none")


@dataclass
class SuffixArrayConfig:
    min_length: int = 100  # k: repeated spans of at least this many bytes are removed
    keep: str = "first"  # first: keep the earliest occurrence | none: remove every occurrence

    def validate(self, where: str = "suffix_array") -> None:
        if self.min_length < 1:
            raise ConfigError(f"{where}.min_length={self.min_length} must be >= 1")
        if self.keep not in KEEP_MODES:
            raise ConfigError(f"{where}.keep={self.keep!r} is not one of {', '.join(KEEP_MODES)}")


def join_documents(texts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(corpus bytes as a writable uint8 array, start offset of each document)."""
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    starts = np.zeros(len(texts), dtype=np.int64)
    if len(texts) > 1:
        np.cumsum(lengths[:-1] + 1, out=starts[1:])
    corpus = np.frombuffer(bytearray(bytes([SEPARATOR]).join(texts)), dtype=np.uint8)
    return corpus, starts


def _distance_to_separator(corpus: np.ndarray) -> np.ndarray:
    """For each position, bytes until the next separator (or the end)."""
    n = len(corpus)
    sep = np.flatnonzero(corpus == SEPARATOR)
    nxt = np.r_[sep, n]
    return nxt[np.searchsorted(sep, np.arange(n), side="left")] - np.arange(n)


def duplicate_mask(corpus: np.ndarray, config: SuffixArrayConfig) -> np.ndarray:
    """Boolean mask of the corpus bytes that belong to a removed repeated span."""
    config.validate()
    n = len(corpus)
    if n == 0:
        return np.zeros(0, dtype=bool)
    sa = pydivsufsort.divsufsort(corpus)
    if config.keep == "first":
        start = np.arange(n)
        length = pydivsufsort.longest_previous_factor(corpus, sa).astype(np.int64)
    else:
        lcp = pydivsufsort.kasai(corpus, sa).astype(np.int64)  # lcp[i]: sa[i] vs sa[i+1]
        best = np.maximum(lcp, np.r_[0, lcp[:-1]])  # longest match with either SA neighbour
        start = sa.astype(np.int64)
        length = best
        del lcp
    del sa
    candidates = np.flatnonzero(length >= config.min_length)
    start, length = start[candidates], length[candidates]
    length = np.minimum(length, _distance_to_separator(corpus)[start])  # clip at document ends
    keep = length >= config.min_length
    start, length = start[keep], length[keep]
    depth = np.zeros(n + 1, dtype=np.int32)
    np.add.at(depth, start, 1)
    np.add.at(depth, start + length, -1)
    removed = np.cumsum(depth[:n]) > 0
    return _whole_characters(corpus, removed)


def _whole_characters(corpus: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """Widen a byte mask so that a UTF-8 character is removed whole or not at all."""
    lead = (corpus & 0xC0) != 0x80
    char = np.cumsum(lead) - 1
    char_removed = np.bincount(char, weights=removed, minlength=int(char[-1]) + 1) > 0
    return char_removed[char]


@dataclass
class SpanDedupResult:
    texts: list[str]  # documents with their duplicated spans removed
    removed_bytes: list[int]  # per document


def dedup_substrings(texts: list[str], config: SuffixArrayConfig) -> SpanDedupResult:
    """Remove repeated spans of >= config.min_length bytes from a list of documents."""
    encoded = [t.encode("utf-8", errors="surrogatepass") for t in texts]
    corpus, starts = join_documents(encoded)
    mask = duplicate_mask(corpus, config)
    out, removed = [], []
    for text, data, start in zip(texts, encoded, starts.tolist()):
        doc_mask = mask[start:start + len(data)]
        count = int(doc_mask.sum())
        removed.append(count)
        if count == 0:
            out.append(text)
        else:
            kept = np.frombuffer(data, dtype=np.uint8)[~doc_mask].tobytes()
            out.append(kept.decode("utf-8", errors="surrogatepass"))
    return SpanDedupResult(out, removed)
