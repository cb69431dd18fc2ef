"""Bloom filter for streaming exact dedup with a fixed memory budget.

For capacity n and false-positive rate p: m = -n ln p / (ln 2)^2 bits and k = (m / n) ln 2 hash
functions, i.e. 1.44 log2(1/p) bits per item (p = 0.001: 14.4 bits = 1.8 bytes per document,
whatever its size). The k bit positions come from one xxh3-128 by double hashing,
g_i = h1 + i * h2 mod m (Kirsch & Mitzenmacher 2006). A false positive drops a unique unit as a
"duplicate" with probability ~p, as long as no more than `capacity` items were added.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.prep.dedup.exact import first_occurrences
from kiln.errors import ConfigError


def bloom_size(capacity: int, fp_rate: float) -> tuple[int, int]:
    """(bits m, hash count k) for a capacity and target false-positive rate."""
    if capacity < 1:
        raise ConfigError(f"bloom capacity={capacity} must be >= 1")
    if not 0.0 < fp_rate < 1.0:
        raise ConfigError(f"bloom fp_rate={fp_rate} must be in (0, 1)")
    m = math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2)
    k = max(1, round(m / capacity * math.log(2)))
    return m, k


class BloomFilter:
    def __init__(self, capacity: int, fp_rate: float = 0.001):
        self.capacity, self.fp_rate = capacity, fp_rate
        self.m, self.k = bloom_size(capacity, fp_rate)
        self.bits = np.zeros((self.m + 7) // 8, dtype=np.uint8)
        self.count = 0

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def _positions(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """(len(h1), k) bit positions by double hashing (h2 forced odd so steps never stall)."""
        m = np.uint64(self.m)
        i = np.arange(self.k, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return ((h1 % m)[:, None] + i * ((h2 | np.uint64(1)) % m)[:, None]) % m

    def _test(self, pos: np.ndarray) -> np.ndarray:
        return ((self.bits[pos >> np.uint64(3)] >> (pos & np.uint64(7)).astype(np.uint8)) & 1).all(axis=1)

    def _set(self, pos: np.ndarray) -> None:
        flat = pos.ravel()
        np.bitwise_or.at(self.bits, flat >> np.uint64(3), (np.uint8(1) << (flat & np.uint64(7)).astype(np.uint8)))

    def contains(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        return self._test(self._positions(np.asarray(h1, np.uint64), np.asarray(h2, np.uint64)))

    def add_new(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """Insert keys (two uint64 halves of a 128-bit hash) in order; True where a key was new.

        Repeats inside the batch are found exactly (a later copy is not new); keys present in
        the filter before the call are 'not new' (up to the false-positive rate).
        """
        h1, h2 = np.asarray(h1, np.uint64), np.asarray(h2, np.uint64)
        first = first_occurrences(h1, h2)
        pos = self._positions(h1, h2)
        new = first & ~self._test(pos)
        self._set(pos[new])
        self.count += int(new.sum())
        return new

    def add_new_one(self, h: int) -> bool:
        """`add_new` for one 128-bit integer hash."""
        return bool(self.add_new(np.array([h >> 64], np.uint64), np.array([h & 0xFFFFFFFFFFFFFFFF], np.uint64))[0])
