"""Near-duplicate detection with 64-bit SimHash (Charikar 2002) and block tables (Manku et al. 2007).

Fingerprint: every shingle hash votes +w / -w on each of the 64 bits, w = its occurrence count
in the document (term-frequency weights); bit i of the fingerprint is 1 where the vote is
positive. Similar documents get fingerprints at a small Hamming distance.

Lookup: two fingerprints within distance k differ in at most k of k+1 disjoint bit blocks, so
they agree exactly on at least one block (pigeonhole). Table t keys every fingerprint on block t
(equivalently: the permutation that moves block t to the top bits, with the fingerprints sorted);
candidates share a key in some table and are confirmed by an exact popcount of their XOR.
Identical fingerprints are collapsed first, so exact duplicates never make quadratic buckets.
`table_pairs` (one table) and `identical_pairs` are separate so that the dedup step can run them
as parallel tasks (`cluster_parts`); `near_pairs` is their union.

Memory per document: the 8-byte fingerprint, plus 16 bytes (key, id) per table while looking up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.prep.dedup.components import components_keep_lowest
from kiln.prep.dedup.sharded_components import check_cluster_parts
from kiln.prep.dedup.shingles import check_shingling, shingle_hashes_of_texts
from kiln.errors import ConfigError

_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


@dataclass
class SimHashConfig:
    shingle: str = "word"  # word | char
    ngram: int = 3
    max_distance: int = 3  # Hamming distance k at which fingerprints count as duplicates
    batch_bytes: int = 4_000_000
    # 0: clusters by scipy in one process; N: pairs found per block table in parallel, then
    # sharded connected components over N node partitions, as executor tasks (sharded_components.py)
    cluster_parts: int = 0

    def validate(self, where: str = "simhash") -> None:
        check_shingling(self.shingle, self.ngram, where)
        check_cluster_parts(self.cluster_parts, where)
        if not 0 <= self.max_distance <= 31:
            raise ConfigError(f"{where}.max_distance={self.max_distance} must be in [0, 31] "
                              "(k + 1 blocks of a 64-bit fingerprint)")


def popcount64(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64."""
    return _POPCOUNT8[x.view(np.uint8).reshape(-1, 8)].sum(axis=1, dtype=np.int64)


def fingerprints_of_hashes(hashes: np.ndarray, docs: np.ndarray, n_docs: int) -> np.ndarray:
    """uint64 SimHash per document from shingle hashes grouped by document index."""
    out = np.zeros(n_docs, dtype=np.uint64)
    if not len(hashes):
        return out
    bits = np.unpackbits(hashes.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    firsts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    totals = np.diff(np.r_[firsts, len(hashes)])
    # votes for 1 per (document, bit): a sparse document-indicator matrix times the bit matrix
    # (scipy's sparse product is ~20x faster here than numpy's add.reduceat over rows)
    rows = np.repeat(np.arange(len(firsts)), totals)
    from scipy.sparse import csr_matrix  # here: importing scipy costs ~1 s on every `kiln prep`

    indicator = csr_matrix((np.ones(len(hashes), np.float32), (rows, np.arange(len(hashes)))),
                           shape=(len(firsts), len(hashes)))
    ones = indicator @ bits.astype(np.float32)
    positive = (2 * ones > totals[:, None]).astype(np.uint8)
    out[docs[firsts]] = np.packbits(positive, axis=1, bitorder="little").view("<u8").ravel()
    return out


def fingerprints(texts: list[str], config: SimHashConfig) -> np.ndarray:
    config.validate()
    out = np.zeros(len(texts), dtype=np.uint64)
    lo = 0
    while lo < len(texts):
        hi, size = lo, 0
        while hi < len(texts) and (hi == lo or size + len(texts[hi]) <= config.batch_bytes):
            size += len(texts[hi])
            hi += 1
        hashes, docs = shingle_hashes_of_texts(texts[lo:hi], config.shingle, config.ngram)
        out[lo:hi] = fingerprints_of_hashes(hashes, docs, hi - lo)
        lo = hi
    return out


def block_masks(max_distance: int) -> list[np.uint64]:
    """Bit masks of the k+1 (nearly equal) blocks of a 64-bit fingerprint."""
    edges = np.linspace(0, 64, max_distance + 2).round().astype(int)
    return [np.uint64(((1 << int(hi)) - 1) ^ ((1 << int(lo)) - 1)) for lo, hi in zip(edges[:-1], edges[1:])]


def _distinct(fps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fps = np.asarray(fps, dtype=np.uint64)
    unique, first, inverse = np.unique(fps, return_index=True, return_inverse=True)
    return unique, first, inverse.ravel()


def identical_pairs(fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first carrier, other carrier) of every fingerprint carried by several documents."""
    _, first, inverse = _distinct(fps)
    same = np.flatnonzero(first[inverse] != np.arange(len(inverse)))
    return first[inverse[same]].astype(np.int64), same.astype(np.int64)


def table_pairs(fps: np.ndarray, max_distance: int, table: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (u < v) of first carriers of distinct fingerprints within `max_distance` bits that
    share block `table` (0..max_distance): the union over all tables is every such pair."""
    unique, first, _ = _distinct(fps)
    key = unique & block_masks(max_distance)[table]
    order = np.argsort(key, kind="stable")
    k, i = key[order], np.arange(len(unique))[order]
    cand_u, cand_v = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    # pairs at distance d in sorted order that share the key; stop when no bucket is that big
    for d in range(1, len(k)):
        same_key = k[d:] == k[:-d]
        if not same_key.any():
            break
        cand_u.append(i[:-d][same_key])
        cand_v.append(i[d:][same_key])
    cu, cv = np.concatenate(cand_u), np.concatenate(cand_v)
    close = popcount64(unique[cu] ^ unique[cv]) <= max_distance
    # back to original indices (the first document of each distinct fingerprint)
    u, v = first[cu[close]], first[cv[close]]
    return np.minimum(u, v).astype(np.int64), np.maximum(u, v).astype(np.int64)


def near_pairs(fps: np.ndarray, max_distance: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (u < v) within `max_distance` bits, each once: every such pair of distinct
    fingerprints; a fingerprint carried by several documents is linked to its first carrier only
    (the same connected components with fewer edges)."""
    pieces = [identical_pairs(fps)] + [table_pairs(fps, max_distance, t) for t in range(max_distance + 1)]
    u = np.concatenate([p[0] for p in pieces])
    v = np.concatenate([p[1] for p in pieces])
    if len(u):
        pairs = np.unique(np.stack([u, v], axis=1), axis=0)
        return pairs[:, 0], pairs[:, 1]
    return u, v


def simhash_duplicates(texts: list[str], config: SimHashConfig) -> np.ndarray:
    """Boolean mask: True for documents within max_distance of a lower-index document's cluster."""
    u, v = near_pairs(fingerprints(texts, config), config.max_distance)
    return ~components_keep_lowest(len(texts), u, v)
