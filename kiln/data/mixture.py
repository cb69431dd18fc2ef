"""A weighted mixture of several window sources, sampled deterministically, with exact resume.

The mixture is one endless stream of sample positions 0, 1, 2, ... Positions come in blocks of
`block` samples; block b gives source s exactly round(weight_s * block) of its slots (largest
remainder rounding, so the counts add up to `block`), in an order shuffled by (seed, b). The j-th
sample a source receives overall is window `perm_e[j mod n_s]` of that source, where `perm_e` is
the source's own permutation for its epoch e = j // n_s. So the sample at any position is a pure
function of (seed, position) - computed from per-block counts, never from what was read before -
and the Loader's global position is all the state there is: resuming, also with a different
number of data-parallel ranks, continues on exactly the next sample.

Weights may change with a schedule `[(from_position, weights), ...]` (positions count samples of
all ranks together); a change takes effect at the first block that starts at or after it.
`realized(position)` gives how many samples and tokens each source has contributed before that
position: the realized mix, exact, for the metrics.

Hand-written here: the block assignment and prefix sums (numpy); the windows themselves are
`TokenWindows` (kiln/data/loader.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.errors import ConfigError


def block_counts(weights: Sequence[float], block: int) -> np.ndarray:
    """Slots per source in one block: weights * block, rounded by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    short = block - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class MixtureWindows:
    """Windows drawn from `sources` (TokenWindows with one seq_len) by weight; see the module doc.

    Use it where a Loader takes windows: the Loader reads positions in order (`ordered = True`),
    so the mixture's own deterministic shuffle is the sampler.
    """

    ordered = True

    def __init__(self, sources: Sequence, weights: Sequence[float], *, seed: int, block: int = 1024,
                 schedule: Sequence[tuple[int, Sequence[float]]] = (), names: Sequence[str] | None = None):
        if not sources:
            raise ConfigError("a data mixture needs at least one source")
        self.sources, self.seed, self.block = list(sources), seed, int(block)
        self.names = list(names) if names else [f"source{i}" for i in range(len(self.sources))]
        if len({s.seq_len for s in self.sources}) != 1:
            raise ConfigError("all mixture sources must use the same seq_len")
        self.seq_len = self.sources[0].seq_len
        self.schedule = [(0, self._check(weights, "weights"))]
        for at, w in sorted(schedule, key=lambda e: e[0]):
            if at < 0:
                raise ConfigError(f"mixture schedule: position {at} must be >= 0")
            self.schedule.append((int(at), self._check(w, f"schedule weights at {at}")))
        self._cum = np.zeros((1, len(self.sources)), dtype=np.int64)  # samples per source before block b
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _check(self, weights: Sequence[float], what: str) -> np.ndarray:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(self.sources),) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ConfigError(f"mixture {what}: expected {len(self.sources)} finite weights >= 0 with a "
                              f"positive sum, got {list(weights)}")
        return w

    # windows across all sources (the Loader checks a global batch is not larger)
    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def remote(self) -> bool:
        return any(s.remote for s in self.sources)

    def weights_at(self, block: int) -> np.ndarray:
        start = block * self.block
        return [w for at, w in self.schedule if at <= start][-1]

    def _counts(self, block: int) -> np.ndarray:
        return block_counts(self.weights_at(block), self.block)

    def _before(self, block: int) -> np.ndarray:
        """Samples each source received in blocks 0..block-1 (prefix sums, grown on demand)."""
        while len(self._cum) <= block:
            b = len(self._cum) - 1
            self._cum = np.vstack([self._cum, self._cum[-1] + self._counts(b)])
        return self._cum[block]

    def _assignment(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot of the block, rank of that slot among its source's slots)."""
        counts = self._counts(block)
        slots = np.repeat(np.arange(len(self.sources)), counts)
        slots = slots[np.random.default_rng([self.seed, 7, block]).permutation(self.block)]
        rank = np.empty(self.block, dtype=np.int64)
        for s in range(len(self.sources)):
            mine = slots == s
            rank[mine] = np.arange(int(mine.sum()))
        return slots, rank

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window index within it) of each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        src, win = np.empty_like(positions), np.empty_like(positions)
        for block in np.unique(positions // self.block).tolist():
            sel = positions // self.block == block
            slots, rank = self._assignment(block)
            offset = positions[sel] - block * self.block
            s, j = slots[offset], self._before(block)[slots[offset]] + rank[offset]
            src[sel] = s
            for k in np.unique(s).tolist():
                n = len(self.sources[k])
                jk = j[s == k]
                win[np.flatnonzero(sel)[s == k]] = [self._perm(k, int(q // n))[int(q % n)] for q in jk]
        return src, win

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sources):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, source, epoch]).permutation(len(self.sources[source]))
        return self._perms[key]

    def _from_sources(self, positions: np.ndarray, read) -> np.ndarray:
        """(len(positions), seq_len + 1): `read(source, its window indices)` for each source's rows."""
        src, win = self._locate(positions)
        out = np.empty((len(src), self.seq_len + 1), dtype=np.int64)
        for k in np.unique(src).tolist():
            out[src == k] = read(self.sources[k], win[src == k])
        return out

    def gather(self, positions: np.ndarray) -> np.ndarray:
        return self._from_sources(positions, lambda source, windows: source.gather(windows))

    @property
    def carries_doc_ids(self) -> bool:
        """Whether the sources carry document ids (TokenWindows(..., doc_ids=True)): the Loader
        then yields them (`gather_doc_ids`)."""
        return all(s.carries_doc_ids for s in self.sources)

    def gather_doc_ids(self, positions: np.ndarray) -> np.ndarray:
        """Each window token's document within its window, from the window's own source."""
        return self._from_sources(positions, lambda source, windows: source.gather_doc_ids(windows))

    def prefetch(self, positions: np.ndarray) -> None:
        src, win = self._locate(positions)
        for k in np.unique(src).tolist():
            self.sources[k].prefetch(win[src == k])

    def realized(self, position: int) -> dict[str, dict[str, int]]:
        """Samples and tokens each source contributed to positions 0..position-1."""
        block, rest = divmod(int(position), self.block)
        n = self._before(block).copy()
        if rest:
            slots, _ = self._assignment(block)
            n += np.bincount(slots[:rest], minlength=len(self.sources))
        return {name: {"samples": int(c), "tokens": int(c) * self.seq_len} for name, c in zip(self.names, n)}
