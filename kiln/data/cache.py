"""Which shard files stay in the bounded on-disk cache: LRU, or CoorDL's fixed resident subset.

Under random-order epochs over data larger than the cache, LRU (and the kernel's page cache,
which behaves like it) evicts files just before the next epoch asks for them again: the hits an
epoch gets depend on luck. CoorDL (Mohan et al., VLDB 2021, "MinIO") keeps whatever fills the cache
first and never evicts it, so every later epoch hits on exactly that resident subset: hit rate =
cache size / dataset size, the most any policy can guarantee without knowing the order.

A policy only tracks keys and sizes; `ShardCache` (kiln/data/storage.py) owns the files. A file the
static policy does not keep is still written, into a small scratch area of the last few such
files (so a prefetched file survives until it is read), and does not count as resident.
Hand-written here: both policies are a dozen lines over `collections.OrderedDict`.
"""

from __future__ import annotations

from collections import OrderedDict

POLICIES = ("lru", "static")


class LRUPolicy:
    """Keep the most recently used files within `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.sizes: OrderedDict[str, int] = OrderedDict()

    def contains(self, key: str) -> bool:
        if key in self.sizes:
            self.sizes.move_to_end(key)
            return True
        return False

    def admit(self, key: str, size: int) -> tuple[bool, list[str]]:
        """(whether `key` is kept, keys evicted to make room)."""
        self.sizes[key] = size
        self.sizes.move_to_end(key)
        used, evicted = sum(self.sizes.values()), []
        for old in list(self.sizes):
            if used <= self.capacity:
                break
            if old != key:
                used -= self.sizes.pop(old)
                evicted.append(old)
        return True, evicted

    def forget(self, key: str) -> None:
        self.sizes.pop(key, None)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())


class StaticPolicy(LRUPolicy):
    """CoorDL's MinIO: admit while there is room, then never evict; later files are not kept."""

    def contains(self, key: str) -> bool:
        return key in self.sizes

    def admit(self, key: str, size: int) -> tuple[bool, list[str]]:
        if key in self.sizes or self.used + size <= self.capacity:
            self.sizes[key] = size
            return True, []
        return False, []


def make_policy(name: str, capacity: int) -> LRUPolicy:
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: expected one of {POLICIES}")
    return StaticPolicy(capacity) if name == "static" else LRUPolicy(capacity)


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
