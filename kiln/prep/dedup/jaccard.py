"""Exact Jaccard similarity of candidate pairs from per-document shingle-hash sets.

A document's set is its sorted, unique 32-bit shingle hashes (1.2 KB for 300 shingles), stored
flat with offsets. Many pairs are scored at once without a Python loop: the pair number is put
in the high 32 bits of each hash of both sides, everything is sorted, and equal neighbours are
the intersections. (32-bit hashes make a false shingle match ~n/2^32 likely per shingle: nil.)
"""

from __future__ import annotations

import numpy as np


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + counts[i]) for all i."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def shingle_sets(hashes: np.ndarray, docs: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat sorted unique uint32 hashes per document, offsets of length n_docs + 1)."""
    values = (hashes >> np.uint64(32)).astype(np.uint32) if hashes.dtype == np.uint64 else hashes
    keys = (docs.astype(np.uint64) << np.uint64(32)) | values.astype(np.uint64)  # one sort key
    keys.sort()
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]]
    values, owners = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32), (keys >> np.uint64(32)).astype(np.int64)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(np.bincount(owners, minlength=n_docs), out=offsets[1:])
    return values, offsets


def pair_jaccard(flat_u: np.ndarray, len_u: np.ndarray, flat_v: np.ndarray, len_v: np.ndarray) -> np.ndarray:
    """Jaccard of pairs given as the concatenated sets of the u sides and of the v sides."""
    n = len(len_u)
    pair_u = np.repeat(np.arange(n, dtype=np.uint64), len_u)
    pair_v = np.repeat(np.arange(n, dtype=np.uint64), len_v)
    keys = np.concatenate([(pair_u << np.uint64(32)) | flat_u.astype(np.uint64),
                           (pair_v << np.uint64(32)) | flat_v.astype(np.uint64)])
    keys.sort()
    same = keys[1:] == keys[:-1]
    inter = np.bincount((keys[1:][same] >> np.uint64(32)).astype(np.int64), minlength=n)
    union = len_u + len_v - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def exact_jaccard_pairs(flat: np.ndarray, offsets: np.ndarray, u: np.ndarray, v: np.ndarray,
                        chunk: int = 20000) -> np.ndarray:
    """Exact Jaccard of document pairs (u[i], v[i]) from `shingle_sets` output."""
    out = np.empty(len(u), dtype=np.float64)
    for lo in range(0, len(u), chunk):
        cu, cv = u[lo:lo + chunk], v[lo:lo + chunk]
        len_u, len_v = offsets[cu + 1] - offsets[cu], offsets[cv + 1] - offsets[cv]
        out[lo:lo + chunk] = pair_jaccard(flat[ranges(offsets[cu], len_u)], len_u,
                                          flat[ranges(offsets[cv], len_v)], len_v)
    return out
