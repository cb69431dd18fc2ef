"""Exact-substring dedup with a suffix array (Lee et al. 2021, "Deduplicating Training Data Makes
Language Models Better").

The corpus is the UTF-8 bytes of all documents joined by 0xFF (a byte UTF-8 never contains, so
a repeat that crosses a document boundary is recognised and ignored). `pydivsufsort` builds the
suffix array (libdivsufsort) and the LCP array (Kasai); runs of suffix-array neighbours with
LCP >= k are the occurrences of repeated k-grams (see `duplicate_mask`):

* keep="first" (the paper's "all but one"): every occurrence but the earliest is removed, so
  every removed byte has a copy earlier in the corpus;
* keep="none": every occurrence is removed.

Spans are unioned (a +1/-1 difference array), widened to whole UTF-8 characters, and cut out of
their documents. Memory: 4 bytes per corpus byte for each of the suffix array and the LCP array
(int32 below 2 GiB; pydivsufsort switches to int64 beyond), 4 more inside Kasai, plus the bytes
and per-repeated-position arrays (benchmarks/dedup_suffix_array.py measures it).
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


def duplicate_mask(corpus: np.ndarray, config: SuffixArrayConfig) -> np.ndarray:
    """Boolean mask of the corpus bytes that belong to a removed repeated span.

    A k-gram (k = min_length) that occurs more than once appears as a run of suffixes adjacent
    in the suffix array with LCP >= k between neighbours. Its occurrences' windows [p, p + k)
    are removed -- all but the earliest (keep="first") or all (keep="none"); the union of these
    windows is exactly the union of the maximal repeated spans of >= k bytes. Windows holding a
    separator (crossing a document boundary) are ignored. Memory: corpus, suffix array and LCP
    array (int32 each below 2 GiB) plus arrays over the repeated positions only.
    """
    config.validate()
    n, k = len(corpus), config.min_length
    if n == 0:
        return np.zeros(0, dtype=bool)
    sa = pydivsufsort.divsufsort(corpus)
    lcp = pydivsufsort.kasai(corpus, sa)  # lcp[i]: common prefix of suffixes sa[i] and sa[i + 1]
    joined = lcp >= k  # SA neighbours i and i + 1 share a k-gram
    del lcp
    in_run = joined.copy()
    in_run[1:] |= joined[:-1]
    rank = np.flatnonzero(in_run)  # SA indices of the repeated k-grams, runs are contiguous
    del in_run
    run_start = np.r_[True, ~joined[rank[:-1]]] if len(rank) else np.zeros(0, dtype=bool)
    del joined
    position = sa[rank].astype(np.int64)
    del sa, rank
    separators = np.flatnonzero(corpus == SEPARATOR)
    next_sep = np.r_[separators, n][np.searchsorted(separators, position, side="left")]
    inside_doc = next_sep - position >= k
    run_id = np.cumsum(run_start) - 1
    position, run_id = position[inside_doc], run_id[inside_doc]
    if config.keep == "first" and len(position):  # runs are contiguous: reduce per run
        firsts = np.flatnonzero(np.r_[True, run_id[1:] != run_id[:-1]])
        earliest = np.minimum.reduceat(position, firsts)
        position = position[position != np.repeat(earliest, np.diff(np.r_[firsts, len(position)]))]
    position.sort()
    start, end = _merge(position, position + k)
    start, end = _merge(*_widen_to_characters(corpus, start, end))
    edges = np.zeros(n + 1, dtype=np.int8)  # merged spans are disjoint and apart: plain stores
    edges[start] = 1
    edges[end] = -1
    return np.cumsum(edges[:n], dtype=np.int8) > 0


def _merge(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of spans [start, end) sorted by start, as disjoint, non-touching spans."""
    if not len(start):
        return start, end
    reach = np.maximum.accumulate(end)
    new = np.r_[True, start[1:] > reach[:-1]]
    return start[new], reach[np.r_[new[1:], True]]


def _widen_to_characters(corpus: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Move span ends outward so a UTF-8 character is removed whole or not at all (starts stay
    sorted: each moves to the start of its character, a non-decreasing function of position)."""
    start, end = start.copy(), end.copy()
    n = len(corpus)
    for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes (10xxxxxx)
        inside = (corpus[start] & 0xC0) == 0x80
        start[inside] -= 1
        cont = np.zeros(len(end), dtype=bool)
        ok = end < n
        cont[ok] = (corpus[end[ok]] & 0xC0) == 0x80
        end[cont] += 1
    return start, end


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
