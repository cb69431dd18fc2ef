"""Which shard files stay in the bounded on-disk cache: LRU, or CoorDL's fixed resident subset.

Under random-order epochs over data larger than the cache, LRU (and the kernel's page cache,
which behaves like it) evicts files just before the next epoch asks for them again: the hits an
epoch gets depend on luck. CoorDL (Mohan et al., VLDB 2021, "MinIO") keeps whatever fills the cache
first and never evicts it, so every later epoch hits on exactly that resident subset: hit rate =
cache size / dataset size, the most any policy can guarantee without knowing the order.

The static policy only beats LRU when each cached item is read about once per epoch: under
window-level shuffling that is a single window, not a shard file (read hundreds of times per epoch,
so both policies keep a random half of the files and hit ~50%). Hence `WindowCache`: the items the
loader caches when the cache is smaller than the data are the byte ranges of single windows.

A policy only tracks keys and sizes; `ShardCache` owns whole files (downloaded by
kiln/data/storage.py) and
`WindowCache` owns window slots. A file the static policy does not keep is still written, into a
small scratch area of the last few such files (so a prefetched file survives until it is read),
and does not count as resident; a window it does not keep is handed to its reader from memory.
Hand-written here: both policies are a dozen lines over `collections.OrderedDict`; the window
slab is a `numpy.memmap` of fixed-size slots.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Hashable

import numpy as np

POLICIES = ("lru", "static")


class LRUPolicy:
    """Keep the most recently used items within `capacity` (bytes, or slots for unit sizes)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.sizes: OrderedDict = OrderedDict()
        self.used = 0  # a running total: admit is O(evictions), not O(items)

    def contains(self, key) -> bool:
        if key in self.sizes:
            self.sizes.move_to_end(key)
            return True
        return False

    def admit(self, key, size: int) -> tuple[bool, list]:
        """(whether `key` is kept, keys evicted to make room)."""
        self.used += size - self.sizes.get(key, 0)
        self.sizes[key] = size
        self.sizes.move_to_end(key)
        evicted = []
        while self.used > self.capacity and len(self.sizes) > 1:  # never the item just admitted
            old, old_size = self.sizes.popitem(last=False)
            self.used -= old_size
            evicted.append(old)
        return True, evicted

    def forget(self, key) -> None:
        self.used -= self.sizes.pop(key, 0)


class StaticPolicy(LRUPolicy):
    """CoorDL's MinIO: admit while there is room, then never evict; later items are not kept."""

    def contains(self, key) -> bool:
        return key in self.sizes

    def admit(self, key, size: int) -> tuple[bool, list]:
        if key in self.sizes or self.used + size <= self.capacity:
            self.used += size - self.sizes.get(key, 0)
            self.sizes[key] = size
            return True, []
        return False, []


def make_policy(name: str, capacity: int) -> LRUPolicy:
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: expected one of {POLICIES}")
    return StaticPolicy(capacity) if name == "static" else LRUPolicy(capacity)


class ShardCache:
    """A directory of downloaded files bounded to `max_bytes` by a policy (kiln/data/cache.py).

    "lru" evicts the least recently used file; "static" (CoorDL) keeps the files that filled the
    cache first for good and passes later ones through a scratch area of the last
    `scratch_files` of them. The file just admitted is never evicted (a single file larger than
    the bound still lands; `overflow_bytes` says by how much). An evicted file that is
    memory-mapped stays readable through its mapping (POSIX unlink semantics); the next read
    through `ShardStore.array` fetches it again. Files are keyed by a hash of their URL, so two
    datasets never collide in one cache directory. `hits`/`misses` count lookups.
    """

    def __init__(self, directory: str | Path, max_bytes: int, policy: str = "lru", scratch_files: int = 8):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.policy = make_policy(policy, self.max_bytes)
        self.scratch: OrderedDict[str, int] = OrderedDict()  # files the policy did not keep
        self.scratch_files = max(1, scratch_files)
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self.overflow_bytes = 0
        for f in sorted(self.dir.glob("*.cached"), key=lambda p: p.stat().st_mtime):  # survive restarts
            kept, evicted = self.policy.admit(f.stem, f.stat().st_size)
            for old in evicted + ([] if kept else [f.stem]):
                (self.dir / f"{old}.cached").unlink(missing_ok=True)

    @staticmethod
    def key(url: str) -> str:
        return hashlib.sha256(url.encode()).hexdigest()[:32]

    def path(self, url: str) -> Path:
        return self.dir / f"{self.key(url)}.cached"

    @property
    def used_bytes(self) -> int:
        """Bytes the policy keeps (the scratch area comes on top)."""
        return self.policy.used

    def lookup(self, url: str) -> Path | None:
        key = self.key(url)
        with self._lock:
            if self.policy.contains(key) or key in self.scratch:
                if self.path(url).is_file():
                    self.hits += 1
                    return self.path(url)
                self.policy.forget(key)  # removed behind our back
                self.scratch.pop(key, None)
            self.misses += 1
            return None

    def resize(self, max_bytes: int) -> None:
        """A new bound; files beyond it are evicted, oldest admitted (or least recently used) first."""
        with self._lock:
            self.max_bytes = self.policy.capacity = int(max_bytes)
            while self.policy.used > self.max_bytes and self.policy.sizes:
                old = next(iter(self.policy.sizes))
                self.policy.forget(old)
                (self.dir / f"{old}.cached").unlink(missing_ok=True)
                self.evictions += 1

    def admit(self, url: str, size: int) -> None:
        """Record a file just written at `path(url)` and evict what the policy says."""
        key = self.key(url)
        with self._lock:
            kept, evicted = self.policy.admit(key, size)
            if not kept:
                self.scratch[key] = size
                self.scratch.move_to_end(key)
                while len(self.scratch) > self.scratch_files:
                    evicted.append(self.scratch.popitem(last=False)[0])
            for old in evicted:
                (self.dir / f"{old}.cached").unlink(missing_ok=True)  # open mmaps stay valid (POSIX)
                self.evictions += 1
            self.overflow_bytes = max(0, self.policy.used - self.max_bytes)



def epoch_hit_rates(policy: LRUPolicy, sizes: list[int], orders: list[list[int]]) -> list[float]:
    """Replay epochs of file accesses (one order of file indices per epoch) against `policy`;
    the share of each epoch's accesses that hit. What the benchmark and `ShardCache` tests use."""
    rates = []
    for order in orders:
        hits = 0
        for i in order:
            if policy.contains(str(i)):
                hits += 1
            else:
                policy.admit(str(i), sizes[i])
        rates.append(hits / max(1, len(order)))
    return rates


class WindowCache:
    """Byte ranges (windows) in fixed-size slots of one memory-mapped file, `max_bytes` at most.

    Items are keyed by anything hashable (the store uses (file name, first, last element)); an
    item longer than a slot is not cached. The policy counts slots (every item has size 1), so
    "static" keeps the first `slots` windows for good: every later epoch hits on exactly them.
    The slab file is unlinked as soon as it is mapped: it lives as long as this process's mapping
    (the kernel may page it out), never clobbers another process's slab in the same directory, and
    leaves nothing behind after a crash; the cache therefore starts cold in every process.
    `hits`/`misses` count `get` calls; `peek` (for prefetching) counts nothing.
    """

    def __init__(self, directory: str | Path, max_bytes: int, slot_bytes: int, policy: str = "lru"):
        self.slot_bytes = max(1, int(slot_bytes))
        self.slots = max(1, int(max_bytes) // self.slot_bytes)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"windows-{os.getpid()}-{threading.get_ident()}-{id(self)}.slab"
        self.slab = np.memmap(path, dtype=np.uint8, mode="w+", shape=(self.slots, self.slot_bytes))
        path.unlink()  # the mapping keeps the (sparse) file alive; nothing to clean up later
        self.policy = make_policy(policy, self.slots)
        self.where: dict[Hashable, tuple[int, int]] = {}  # key -> (slot, length in bytes)
        self.free: list[int] = []  # slots given back by evictions
        self.next_slot = 0  # slots above it were never used (no list of a billion free slots)
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def peek(self, key: Hashable) -> bool:
        with self._lock:
            return key in self.where

    def get(self, key: Hashable) -> bytes | None:
        """The item's bytes (a copy, taken under the lock so a concurrent eviction cannot tear it)."""
        with self._lock:
            found = self.where.get(key)
            if found is None:
                self.misses += 1
                return None
            self.policy.contains(key)  # LRU: mark it used
            self.hits += 1
            slot, length = found
            return self.slab[slot, :length].tobytes()

    def count_miss(self) -> None:
        """A read served by a fetch made for it (a prefetch) rather than by `get`."""
        with self._lock:
            self.misses += 1

    def put(self, key: Hashable, data: bytes) -> bool:
        """Offer an item to the policy; True when it is now resident."""
        if len(data) > self.slot_bytes:
            return False
        with self._lock:
            if key in self.where:
                return True
            kept, evicted = self.policy.admit(key, 1)
            for old in evicted:
                self.free.append(self.where.pop(old)[0])
                self.evictions += 1
            if not kept:
                return False
            if self.free:
                slot = self.free.pop()
            else:
                slot, self.next_slot = self.next_slot, self.next_slot + 1
            self.slab[slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.where[key] = (slot, len(data))
            return True

    def close(self) -> None:
        with self._lock:
            self.where.clear()
            self.slab = np.zeros((0, self.slot_bytes), np.uint8)  # drops the mapping (numpy has no close)
