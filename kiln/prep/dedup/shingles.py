"""Shingling of a batch of documents into uint64 hashes, fully vectorized (see `hashing`).

Word shingles are n consecutive whitespace-separated words of the normalized text; char
shingles are n consecutive bytes of it (UTF-8 bytes: equal to characters for ASCII text). A
document shorter than one shingle is one shingle (itself); an empty one has none.
"""

from __future__ import annotations

import numpy as np

from kiln.prep.dedup.hashing import ByteBatch, fmix64, mix_multiplier, normalize_text
from kiln.prep.dedup.jaccard import ranges
from kiln.errors import ConfigError

SHINGLE_KINDS = ("word", "char")


def check_shingling(kind: str, n: int, where: str = "dedup") -> None:
    if kind not in SHINGLE_KINDS:
        raise ConfigError(f"{where}.shingle={kind!r} is not one of {', '.join(SHINGLE_KINDS)}")
    if n < 1:
        raise ConfigError(f"{where}.ngram={n} must be >= 1")


def _combine(parts: np.ndarray, n: int) -> np.ndarray:
    """Position-aware hash of every window of n consecutive uint64 hashes in `parts`."""
    m = len(parts) - n + 1
    with np.errstate(over="ignore"):
        acc = parts[:m] * mix_multiplier(0)
        for j in range(1, n):
            acc += parts[j:j + m] * mix_multiplier(j)
    return fmix64(acc)


def shingle_hashes_of_texts(texts: list[str], kind: str = "word", n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 shingle hashes, document index of each), grouped by document in order."""
    return shingle_hashes(ByteBatch(texts, collapse_spaces=kind != "word"), kind, n)


def shingle_hashes(batch: ByteBatch, kind: str = "word", n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 shingle hashes, document index of each) of a batch, grouped by document."""
    n_docs = len(batch.starts)
    if kind == "word":
        w_start, w_end, w_doc = batch.words()
        word_hash = batch.substring_hash(w_start, w_end)
        counts = np.bincount(w_doc, minlength=n_docs)
        hashes, docs = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        if len(word_hash) >= n:
            window = _combine(word_hash, n)
            valid = w_doc[: len(window)] == w_doc[n - 1:]
            hashes.append(window[valid])
            docs.append(w_doc[: len(window)][valid])
        first_word = np.cumsum(counts) - counts
        for d in np.flatnonzero((counts > 0) & (counts < n)):  # short documents: one shingle each
            k = int(counts[d])
            hashes.append(_combine(word_hash[first_word[d]:first_word[d] + k], k))
            docs.append(np.array([d], dtype=np.int64))
    elif kind == "char":
        lengths = batch.ends - batch.starts
        windows = np.maximum(lengths - n + 1, 0)
        s = ranges(batch.starts, windows)
        hashes = [batch.substring_hash(s, s + n)]
        docs = [np.repeat(np.arange(n_docs, dtype=np.int64), windows)]
        short = np.flatnonzero((lengths > 0) & (lengths < n))
        hashes.append(batch.substring_hash(batch.starts[short], batch.ends[short]))
        docs.append(short.astype(np.int64))
    else:
        check_shingling(kind, n)
        raise AssertionError("unreachable")
    hash_all, doc_all = np.concatenate(hashes), np.concatenate(docs)
    if len(hashes) > 2 or kind == "char":
        order = np.argsort(doc_all, kind="stable")
        hash_all, doc_all = hash_all[order], doc_all[order]
    return hash_all, doc_all


def shingle_strings(text: str, kind: str = "word", n: int = 5) -> set[str]:
    """The shingles themselves (slow, for exact Jaccard ground truth and other libraries)."""
    norm = normalize_text(text)
    if kind == "word":
        words = norm.split()
        if not words:
            return set()
        if len(words) < n:
            return {" ".join(words)}
        return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}
    data = norm.encode("utf-8", errors="surrogatepass")
    if not data:
        return set()
    if len(data) < n:
        return {data.decode("latin-1")}
    return {data[i:i + n].decode("latin-1") for i in range(len(data) - n + 1)}
