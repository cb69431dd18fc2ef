import numpy as np
import pytest

from kiln.data.cache import LRUPolicy, StaticPolicy, WindowCache, epoch_hit_rates, make_policy
from kiln.data.storage import ShardCache


def orders(n, epochs, seed=0):
    return [np.random.default_rng([seed, e]).permutation(n).tolist() for e in range(epochs)]


def test_static_policy_hits_the_resident_subset_every_epoch():
    rates = epoch_hit_rates(StaticPolicy(100), [1] * 200, orders(200, 3))
    assert rates == [0.0, 0.5, 0.5]  # cache / dataset, from the second epoch on


def test_static_beats_lru_by_half_again_on_data_twice_the_cache():
    n, sizes = 400, [1] * 400
    static = sum(epoch_hit_rates(StaticPolicy(n // 2), sizes, orders(n, 3)))
    lru = sum(epoch_hit_rates(LRUPolicy(n // 2), sizes, orders(n, 3)))
    assert static >= 1.5 * lru, (static, lru)


def test_lru_keeps_recent_files_within_capacity():
    p = LRUPolicy(3)
    for k in "abcd":
        p.admit(k, 1)
    assert not p.contains("a") and p.contains("b") and p.used == 3


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo", 10)


def test_shard_cache_static_policy_keeps_first_files_and_scratches_the_rest(tmp_path):
    cache = ShardCache(tmp_path, max_bytes=200, policy="static", scratch_files=1)
    for i in range(4):
        cache.path(f"u{i}").write_bytes(b"x" * 100)
        cache.admit(f"u{i}", 100)
    assert cache.lookup("u0") and cache.lookup("u1")  # resident for good
    assert cache.lookup("u3") and cache.lookup("u2") is None  # scratch keeps only the last one
    assert not cache.path("u2").exists() and cache.used_bytes == 200
    restarted = ShardCache(tmp_path, max_bytes=200, policy="static")
    assert restarted.lookup("u0") and restarted.lookup("u1")


def test_window_cache_bounds_slots_and_keeps_the_static_resident_set(tmp_path):
    lru = WindowCache(tmp_path, max_bytes=3 * 10, slot_bytes=10, policy="lru")
    for i in range(5):
        assert lru.put(i, bytes([i]) * 10)
    assert lru.get(0) is None and lru.get(4) == bytes([4]) * 10 and len(lru.where) == 3 and lru.evictions == 2
    assert not lru.put("big", b"x" * 11) and lru.get("big") is None  # longer than a slot: not cached
    static = WindowCache(tmp_path, max_bytes=2 * 10, slot_bytes=10, policy="static")
    kept = [static.put(i, bytes([i]) * (i + 1)) for i in range(4)]
    assert kept == [True, True, False, False]
    assert static.get(1) == b"\x01\x01" and static.get(3) is None  # items keep their own length
    assert (static.hits, static.misses) == (1, 1) and not list(tmp_path.iterdir())  # the slab is unlinked
