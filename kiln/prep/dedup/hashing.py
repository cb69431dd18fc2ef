"""Text normalization and vectorized 64-bit hashing shared by the dedup methods.

Per-item `xxhash` calls cost a Python call each (~0.3 us); MinHash and SimHash hash hundreds of
shingles per document, so they hash whole batches of text with numpy instead: a polynomial
prefix hash over the bytes gives any substring's hash in O(1), and the murmur3 finalizer
(`fmix64`) spreads its bits. Single keys (documents, paragraphs) use xxhash directly.
"""

from __future__ import annotations

import numpy as np
import xxhash

U64 = np.uint64
# Odd 64-bit constants (from xxhash/murmur): multipliers that make n-gram hashes position-aware.
MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                0x27D4EB2F165667C5, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xD6E8FEB86659FD93],
               dtype=np.uint64)
_BASE = U64(0x100000001B3)  # FNV prime: odd, so invertible mod 2**64
_BASE_INV = U64(pow(0x100000001B3, -1, 2**64))
_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 10, 11, 12, 13, 32]] = True


def normalize_text(text: str) -> str:
    """Case-folded, whitespace-collapsed text: what 'the same content' means for dedup."""
    return " ".join(text.lower().split())


def xxh128(text: str) -> int:
    return xxhash.xxh3_128_intdigest(text.encode("utf-8", errors="surrogatepass"))


def xxh64(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", errors="surrogatepass"))


def fmix64(h: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer, in place on a uint64 array (returned for chaining)."""
    with np.errstate(over="ignore"):
        h ^= h >> U64(33)
        h *= U64(0xFF51AFD7ED558CCD)
        h ^= h >> U64(33)
        h *= U64(0xC4CEB9FE1A85EC53)
        h ^= h >> U64(33)
    return h


def mix_multiplier(j: int) -> np.uint64:
    """The j-th position multiplier for n-gram hashes (any n: derived beyond the table)."""
    if j < len(MIX):
        return MIX[j]
    return U64((int(MIX[j % len(MIX)]) * (2 * j + 1)) % 2**64 | 1)


_powers_cache: list[np.ndarray] = [np.ones(1, np.uint64), np.ones(1, np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(BASE^i, BASE^-i) for i = 0..n, mod 2**64; cached and grown by doubling."""
    if len(_powers_cache[0]) <= n:
        size = max(n + 1, 2 * len(_powers_cache[0]))
        with np.errstate(over="ignore"):
            for k, base in enumerate((_BASE, _BASE_INV)):
                p = np.full(size, base, dtype=np.uint64)
                p[0] = 1
                _powers_cache[k] = np.cumprod(p, out=p)
    return _powers_cache[0], _powers_cache[1]


class ByteBatch:
    """Normalized texts of a batch joined into one byte buffer with prefix hashes.

    `starts[i]:ends[i]` are document i's bytes in `buf`; `substring_hash(s, e)` hashes any
    spans [s, e) (vectorized) so that equal byte strings get equal hashes wherever they sit.
    Texts are lower-cased; `collapse_spaces` also turns whitespace runs into one space (needed
    for byte shingles; word shingles split on any whitespace anyway).
    """

    def __init__(self, texts: list[str], collapse_spaces: bool = True):
        norm = normalize_text if collapse_spaces else str.lower
        encoded = [norm(t).encode("utf-8", errors="surrogatepass") for t in texts]
        lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
        self.starts = np.zeros(len(encoded), dtype=np.int64)
        if len(encoded) > 1:
            np.cumsum(lengths[:-1] + 1, out=self.starts[1:])  # +1: the "\n" separator
        self.ends = self.starts + lengths
        self.buf = np.frombuffer(b"\n".join(encoded), dtype=np.uint8)
        n = len(self.buf)
        power, inv_power = _powers(n)
        self.power = power
        with np.errstate(over="ignore"):
            # prefix[i] = sum_{j<i} (b_j + 1) * BASE^-j  (mod 2**64)
            self.prefix = np.zeros(n + 1, dtype=np.uint64)
            terms = self.buf.astype(np.uint64)
            terms += np.uint64(1)
            terms *= inv_power[:n]
            np.cumsum(terms, out=self.prefix[1:])

    def substring_hash(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """uint64 hashes of the byte spans [s, e) (arrays of equal length), bits well mixed."""
        with np.errstate(over="ignore"):
            h = (self.prefix[e] - self.prefix[s]) * self.power[s]
            h += (e - s).astype(np.uint64) * MIX[7]  # length-aware
        return fmix64(h)

    def words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, doc index) of every whitespace-separated word, in order."""
        space = _SPACE[self.buf]
        if len(space) == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        word = ~space
        edge = np.diff(word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
        w_start = np.flatnonzero(edge == 1)
        w_end = np.flatnonzero(edge == -1)
        doc = np.searchsorted(self.starts, w_start, side="right") - 1
        return w_start, w_end, doc
