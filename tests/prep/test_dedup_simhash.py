import numpy as np
import pytest
from dedup_testdata import edit_words, random_docs

from kiln.prep.dedup.components import component_labels
from kiln.prep.dedup.simhash import (SimHashConfig, block_masks, fingerprints, near_pairs, popcount64,
                                          simhash_duplicates)
from kiln.errors import ConfigError


def flip_bits(x: np.uint64, n: int, rng: np.random.Generator) -> np.uint64:
    for b in rng.choice(64, n, replace=False):
        x ^= np.uint64(1) << np.uint64(b)
    return x


def test_blocks_partition_the_fingerprint():
    for k in (0, 3, 7):
        masks = block_masks(k)
        assert len(masks) == k + 1
        total = np.uint64(0)
        for m in masks:
            assert (total & m) == 0
            total |= m
        assert total == np.uint64(2**64 - 1)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_near_pairs_finds_pairs_within_k_and_none_beyond(k):
    rng = np.random.default_rng(k)
    base = rng.integers(0, 2**63, size=60, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    variants = [base]
    for d in range(1, k + 3):  # copies at every distance up to k + 2
        variants.append(np.array([flip_bits(x, d, rng) for x in base], dtype=np.uint64))
    fps = np.concatenate(variants)
    u, v = near_pairs(fps, k)
    dist = popcount64((fps[:, None] ^ fps[None, :]).ravel()).reshape(len(fps), len(fps))
    expected = set(zip(*np.nonzero(np.triu(dist <= k, 1))))
    assert set(zip(u.tolist(), v.tolist())) == {(int(a), int(b)) for a, b in expected}
    # exact copies are linked to their first carrier only: the same clusters, fewer edges
    with_copies = np.concatenate([fps, base[:5]])
    u, v = near_pairs(with_copies, k)
    dist = popcount64((with_copies[:, None] ^ with_copies[None, :]).ravel()).reshape(len(with_copies), -1)
    a, b = np.nonzero(np.triu(dist <= k, 1))
    assert np.array_equal(component_labels(len(with_copies), u, v), component_labels(len(with_copies), a, b))
    assert all(dist[x, y] <= k for x, y in zip(u, v))


def test_fingerprints_close_for_near_duplicates_far_for_others():
    docs = random_docs(40, words=300, seed=5)
    fps = fingerprints(docs + [edit_words(docs[0], 2)], SimHashConfig())
    near = popcount64(np.array([fps[0] ^ fps[-1]]))[0]
    others = popcount64(fps[1:40] ^ fps[0])
    assert near <= 12 < others.min()  # random pairs sit near 32 bits apart
    assert np.array_equal(fps, fingerprints(docs + [edit_words(docs[0], 2)], SimHashConfig(batch_bytes=500)))


def test_simhash_dedup_drops_planted_duplicates():
    docs = random_docs(50, words=300, seed=6)
    texts = docs + [docs[3].upper(), docs[7] + " ", edit_words(docs[9], 1)]
    dup = simhash_duplicates(texts, SimHashConfig(max_distance=4))
    assert dup[50:].all() and not dup[:50].any()


def test_config_errors():
    with pytest.raises(ConfigError, match="max_distance"):
        fingerprints(["a"], SimHashConfig(max_distance=40))
