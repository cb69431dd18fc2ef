"""Near-duplicate detection with MinHash signatures and LSH banding.

Signatures: every shingle is hashed once (vectorized, `shingles`) to a 32-bit value x; each of
`num_perm` permutations is pi_i(x) = (a_i * x + b_i) mod 2**32 with a_i odd -- a bijection of
the 32-bit space, i.e. a true permutation -- and the signature keeps min_x pi_i(x). The whole
batch x all permutations is one numpy multiply-add in native uint32 lanes, reduced per document
in row chunks that stay in cache. (A prime modulus as in datasketch
needs 64-bit products and a division: ~3x slower here for the same estimate quality, because
the inputs are already uniform hashes and the minimum is decided by the well-mixed high bits.)

Candidates: documents whose r signature values of some band agree share a bucket (band key =
a 64-bit hash of the r values). Each bucket yields edges from its lowest id to every member
and between id-consecutive members. Verification then keeps an edge only when
  verify="exact":     the exact Jaccard of the two shingle sets is >= threshold (default; LSH
                      false positives are free to remove, so the auto (b, r) favours recall),
  verify="signature": the signatures agree on >= threshold of the permutations (an unbiased
                      estimate, std sqrt(J(1-J)/num_perm): pairs near the threshold go either way),
  verify="none":      always (datasketch's behaviour).
Connected components of the edges are the clusters; the lowest id of each is kept.

Memory per document: signatures num_perm x 4 bytes, plus for exact verification the sorted
unique 32-bit shingle hashes (~4 bytes per shingle); band keys 8 bytes + id 8 bytes per band
while bucketing (one band at a time on the sharded path, `minhash_stages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.prep.dedup.components import components_keep_lowest
from kiln.prep.dedup.hashing import fmix64, mix_multiplier
from kiln.prep.dedup.jaccard import exact_jaccard_pairs, shingle_sets
from kiln.prep.dedup.lsh_params import optimal_bands_rows
from kiln.prep.dedup.shingles import check_shingling, shingle_hashes_of_texts
from kiln.prep.dedup.sharded_components import check_cluster_parts
from kiln.errors import ConfigError

EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a document without shingles
VERIFY_MODES = ("exact", "signature", "none")
AUTO_WEIGHTS = {"exact": (0.05, 0.95), "signature": (0.2, 0.8), "none": (0.5, 0.5)}


@dataclass
class MinHashConfig:
    num_perm: int = 128
    shingle: str = "word"  # word | char
    ngram: int = 5  # shingle size, in words or bytes
    threshold: float = 0.8  # Jaccard similarity at which documents count as duplicates
    bands: int = 0  # 0 (with rows 0): chosen by `optimal_bands_rows`
    rows: int = 0
    # weights of the false-positive/-negative areas for the auto (bands, rows) choice; 0/0: by
    # `verify` (exact 0.05/0.95, signature 0.2/0.8, none 0.5/0.5: verification removes FPs)
    fp_weight: float = 0.0
    fn_weight: float = 0.0
    verify: str = "exact"  # exact | signature | none: how candidate pairs are confirmed
    seed: int = 1
    batch_bytes: int = 1_000_000  # text hashed per vectorized batch (~40 bytes of RAM per byte)
    # 0: clusters by scipy in one process; N: pairs verified per band in parallel, then sharded
    # connected components over N node partitions, as executor tasks (sharded_components.py)
    cluster_parts: int = 0

    def validate(self, where: str = "minhash") -> None:
        check_shingling(self.shingle, self.ngram, where)
        if self.num_perm < 2:
            raise ConfigError(f"{where}.num_perm={self.num_perm} must be >= 2")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"{where}.threshold={self.threshold} must be in (0, 1)")
        if (self.bands == 0) != (self.rows == 0):
            raise ConfigError(f"{where}.bands and {where}.rows must both be set or both be 0 (auto)")
        if self.bands < 0 or self.rows < 0 or self.bands * self.rows > self.num_perm:
            raise ConfigError(f"{where}.bands x rows = {self.bands} x {self.rows} must be >= 0 and "
                              f"<= num_perm={self.num_perm}")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"{where}.verify={self.verify!r} is not one of {', '.join(VERIFY_MODES)}")
        if self.fp_weight < 0 or self.fn_weight < 0 or (self.fp_weight == 0) != (self.fn_weight == 0):
            raise ConfigError(f"{where}.fp_weight/fn_weight must both be > 0, or both 0 (auto)")
        check_cluster_parts(self.cluster_parts, where)
        if self.batch_bytes < 1:
            raise ConfigError(f"{where}.batch_bytes={self.batch_bytes} must be >= 1")

    def bands_rows(self) -> tuple[int, int]:
        if self.bands:
            return self.bands, self.rows
        weights = (self.fp_weight, self.fn_weight) if self.fp_weight else AUTO_WEIGHTS[self.verify]
        return optimal_bands_rows(self.threshold, self.num_perm, *weights)


class MinHasher:
    """Computes signatures for a config; deterministic for `config.seed`."""

    def __init__(self, config: MinHashConfig):
        config.validate()
        self.config = config
        rng = np.random.default_rng(config.seed)
        self.a = rng.integers(0, 2**32, size=config.num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        self.b = rng.integers(0, 2**32, size=config.num_perm, dtype=np.uint64).astype(np.uint32)

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint32 signatures."""
        return self.signatures_and_sets(texts, with_sets=False)[0]

    def signatures_and_sets(self, texts: list[str], with_sets: bool = True
                            ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(signatures, flat shingle sets, set offsets) -- the sets only `with_sets` (`jaccard`)."""
        out = np.empty((len(texts), self.config.num_perm), dtype=np.uint32)
        flats, lengths = [], []
        lo = 0
        while lo < len(texts):  # batches of about batch_bytes of text
            hi, size = lo, 0
            while hi < len(texts) and (hi == lo or size + len(texts[hi]) <= self.config.batch_bytes):
                size += len(texts[hi])
                hi += 1
            hashes, docs = shingle_hashes_of_texts(texts[lo:hi], self.config.shingle, self.config.ngram)
            x = (hashes >> np.uint64(32)).astype(np.uint32)
            out[lo:hi] = self.signatures_of_hashes(x, docs, hi - lo)
            if with_sets:
                flat, offsets = shingle_sets(x, docs, hi - lo)
                flats.append(flat)
                lengths.append(np.diff(offsets))
            lo = hi
        if not with_sets:
            return out, None, None
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return out, (np.concatenate(flats) if flats else np.zeros(0, np.uint32)), offsets

    def signatures_of_hashes(self, x: np.ndarray, docs: np.ndarray, n_docs: int,
                             chunk_rows: int = 1024) -> np.ndarray:
        """Signatures from 32-bit shingle hashes `x` grouped by document index `docs`.

        Rows are processed in cache-sized chunks of whole documents; each document's minimum is
        a contiguous `min(axis=0)` (numpy's `minimum.reduceat` is ~8x slower on 2-D input).
        """
        out = np.full((n_docs, self.config.num_perm), EMPTY, dtype=np.uint32)
        if not len(x):
            return out
        work = np.empty((chunk_rows, self.config.num_perm), dtype=np.uint32)
        bounds = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1], True])
        starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
        ids = docs[bounds[:-1]].tolist()
        ends_arr = bounds[1:]
        i = 0
        while i < len(starts):
            lo = starts[i]
            j = max(i + 1, int(np.searchsorted(ends_arr, lo + chunk_rows, side="right")))
            hi = ends[j - 1]
            if hi - lo > chunk_rows:  # one document larger than a chunk: running minimum
                for r in range(lo, hi, chunk_rows):
                    perm = self._permute(x[r:min(r + chunk_rows, hi)], work)
                    np.minimum(out[ids[i]], perm.min(axis=0), out=out[ids[i]])
            else:
                perm = self._permute(x[lo:hi], work)
                for k in range(i, j):
                    out[ids[k]] = perm[starts[k] - lo:ends[k] - lo].min(axis=0)
            i = j
        return out

    def _permute(self, x: np.ndarray, work: np.ndarray) -> np.ndarray:
        """(len(x), num_perm) values (a * x + b) mod 2**32, written into `work`."""
        perm = work[: len(x)]
        np.multiply(x[:, None], self.a, out=perm)
        np.add(perm, self.b, out=perm)
        return perm


def band_keys(signatures: np.ndarray, band: int, rows: int) -> np.ndarray:
    """uint64 key of band `band` (columns band*rows .. +rows) of every signature."""
    cols = signatures[:, band * rows:(band + 1) * rows].astype(np.uint64)
    key = np.full(len(signatures), np.uint64(band + 1), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(rows):
            key = fmix64(key * mix_multiplier(j) + cols[:, j])
    return key


def bucket_edges(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges (u < v) inside equal-key buckets: lowest id -> each member, and consecutive members."""
    order = np.lexsort((ids, keys))
    k, i = keys[order], ids[order]
    same = np.r_[False, k[1:] == k[:-1]]  # member that is not the first of its bucket
    if not same.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first_pos = np.maximum.accumulate(np.where(same, 0, np.arange(len(k))))
    members = np.flatnonzero(same)
    u = np.concatenate([i[first_pos[members]], i[members - 1]])
    v = np.concatenate([i[members], i[members]])
    return unique_edges(u, v)


def signature_agreement(sig_u: np.ndarray, sig_v: np.ndarray) -> np.ndarray:
    """Fraction of equal signature values per row pair: the MinHash Jaccard estimate."""
    return (sig_u == sig_v).mean(axis=1)


def lsh_edges(signatures: np.ndarray, bands: int, rows: int,
              threshold: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Unique candidate edges (row indices u < v) over all bands, verified when `threshold`."""
    ids = np.arange(len(signatures), dtype=np.int64)
    us, vs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for band in range(bands):
        u, v = bucket_edges(band_keys(signatures, band, rows), ids)
        us.append(u)
        vs.append(v)
    u, v = unique_edges(np.concatenate(us), np.concatenate(vs))
    if threshold is not None and len(u):
        ok = signature_agreement(signatures[u], signatures[v]) >= threshold
        u, v = u[ok], v[ok]
    return u, v


def unique_edges(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not len(u):
        return u, v
    pairs = np.unique(np.stack([u, v], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def minhash_duplicates(texts: list[str], config: MinHashConfig) -> np.ndarray:
    """Boolean mask: True for documents that are near-duplicates of a lower-index document."""
    return ~components_keep_lowest(len(texts), *minhash_edges(texts, config))


def minhash_edges(texts: list[str], config: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """The verified duplicate edges (u < v) between documents."""
    signatures, flat, offsets = MinHasher(config).signatures_and_sets(texts, config.verify == "exact")
    bands, rows = config.bands_rows()
    u, v = lsh_edges(signatures, bands, rows, config.threshold if config.verify == "signature" else None)
    if config.verify == "exact" and len(u):
        keep = exact_jaccard_pairs(flat, offsets, u, v) >= config.threshold
        u, v = u[keep], v[keep]
    return u, v
