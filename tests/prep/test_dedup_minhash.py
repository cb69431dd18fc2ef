import numpy as np
import pytest
from dedup_testdata import edit_words, random_docs

from kiln.prep.dedup.jaccard import exact_jaccard_pairs, shingle_sets
from kiln.prep.dedup.lsh_params import candidate_probability, format_s_curve, optimal_bands_rows, s_curve
from kiln.prep.dedup.minhash import MinHashConfig, MinHasher, lsh_edges, minhash_duplicates
from kiln.prep.dedup.minhash_stages import bands_for_worker, run_stages
from kiln.prep.dedup.shingles import shingle_hashes_of_texts, shingle_strings
from kiln.errors import ConfigError


def jaccard(a: str, b: str, kind: str = "word", n: int = 5) -> float:
    sa, sb = shingle_strings(a, kind, n), shingle_strings(b, kind, n)
    return len(sa & sb) / len(sa | sb)


def test_s_curve_matches_formula_and_is_printed():
    for s in (0.5, 0.8, 0.95):
        assert candidate_probability(s, 9, 13) == pytest.approx(1 - (1 - s**13) ** 9)
    curve = s_curve(9, 13)
    assert [s for s, _ in curve] == pytest.approx([0.5 + 0.05 * i for i in range(11)])
    probs = [p for _, p in curve]
    assert probs == sorted(probs) and probs[-1] == 1.0
    assert "9 bands x 13 rows" in format_s_curve(9, 13, 0.8) and "0.80" in format_s_curve(9, 13)


def test_optimal_bands_rows_balances_errors():
    b, r = optimal_bands_rows(0.8, 128)
    assert b * r <= 128 and (b, r) == (9, 13)  # the known optimum (same as datasketch's search)
    b5, r5 = optimal_bands_rows(0.5, 128)
    assert b5 > b and r5 < r  # a lower threshold needs more, shorter bands
    # weighting false negatives more moves the curve left (higher P(candidate) at the threshold)
    bn, rn = optimal_bands_rows(0.8, 128, fp_weight=0.1, fn_weight=0.9)
    assert candidate_probability(0.8, bn, rn) > candidate_probability(0.8, b, r)


def test_shingle_hashes_match_shingle_sets():
    texts = ["The cat sat on the mat today again", "x", "", "the  CAT sat on\tthe mat today again", "a b"]
    for kind, n in (("word", 3), ("char", 4)):
        hashes, docs = shingle_hashes_of_texts(texts, kind, n)
        assert np.all(np.diff(docs) >= 0)
        for i, text in enumerate(texts):
            assert len(set(hashes[docs == i].tolist())) == len(shingle_strings(text, kind, n))
        assert set(hashes[docs == 0].tolist()) == set(hashes[docs == 3].tolist())  # normalized


def test_signatures_deterministic_and_equal_to_naive_minhash():
    docs = random_docs(30, seed=1)
    config = MinHashConfig(num_perm=64, seed=7)
    sig = MinHasher(config).signatures(docs)
    assert np.array_equal(sig, MinHasher(MinHashConfig(num_perm=64, seed=7)).signatures(docs))
    assert not np.array_equal(sig, MinHasher(MinHashConfig(num_perm=64, seed=8)).signatures(docs))
    hasher = MinHasher(config)
    hashes, owners = shingle_hashes_of_texts(docs, "word", 5)
    x = (hashes >> np.uint64(32)).astype(np.uint32)
    for i in (0, 17):
        xi = x[owners == i]
        naive = np.array([(xi * a + b).min() for a, b in zip(hasher.a, hasher.b)], dtype=np.uint32)
        assert np.array_equal(sig[i], naive)
    # tiny chunks (documents split across chunks) give the same result
    assert np.array_equal(hasher.signatures_of_hashes(x, owners, len(docs), chunk_rows=7), sig)


def test_signature_agreement_estimates_jaccard():
    base = random_docs(1, words=400, seed=2)[0]
    config = MinHashConfig(num_perm=256)
    for edits in (5, 20, 60):
        other = edit_words(base, edits, seed=edits)
        sig = MinHasher(config).signatures([base, other])
        estimate = (sig[0] == sig[1]).mean()
        assert abs(estimate - jaccard(base, other)) < 0.1


def test_finds_planted_near_duplicates_and_keeps_unique():
    uniques = random_docs(60, seed=3)
    near = [edit_words(uniques[i], 2, seed=i) for i in range(10)]  # Jaccard ~0.9
    far = [edit_words(uniques[i], 40, seed=i) for i in range(10, 15)]  # Jaccard < 0.5
    texts = uniques + near + far
    assert all(jaccard(uniques[i], near[i]) > 0.88 for i in range(10))
    dup = minhash_duplicates(texts, MinHashConfig(threshold=0.8))
    assert dup[60:70].all()  # every planted near-duplicate goes
    assert not dup[:60].any() and not dup[70:].any()  # originals and distant edits stay


def test_chars_shingles_and_unverified_edges():
    texts = ["abcdefghij klmnop qrstuv wxyz " * 4, "abcdefghij klmnop qrstuv wxyz " * 4 + "!", "zzzz yyyy"]
    config = MinHashConfig(shingle="char", ngram=5, verify="none")
    assert minhash_duplicates(texts, config).tolist() == [False, True, False]
    sig = MinHasher(config).signatures(texts)
    u, v = lsh_edges(sig, *config.bands_rows())
    assert (u.tolist(), v.tolist()) == ([0], [1])


@pytest.mark.parametrize("verify", ["exact", "signature", "none"])
def test_sharded_stages_match_in_memory(tmp_path, verify):
    uniques = random_docs(40, seed=4)
    texts = uniques + [edit_words(uniques[i], 2, seed=i) for i in range(0, 40, 3)] + uniques[:3]
    texts += [edit_words(uniques[5], 12, seed=1)]  # Jaccard ~0.6: an LSH candidate at most
    config = MinHashConfig(verify=verify)
    expected = np.flatnonzero(minhash_duplicates(texts, config))
    cuts = [0, 13, 14, 30, len(texts)]  # uneven shards, one with a single document
    drops = run_stages([texts[a:b] for a, b in zip(cuts, cuts[1:])], config, tmp_path)
    got = np.concatenate([d + a for d, a in zip(drops, cuts)])
    assert np.array_equal(got, expected) and 17 <= len(expected) <= 18
    if verify != "none":
        assert len(expected) == 17
    assert sorted(sum((bands_for_worker(9, w, 4) for w in range(4)), [])) == list(range(9))


def test_exact_jaccard_of_pairs_matches_python_sets():
    docs = random_docs(6, words=120, seed=9)
    docs += [edit_words(docs[0], k, seed=k) for k in (1, 5, 20)] + ["", "one"]
    hashes, owners = shingle_hashes_of_texts(docs, "word", 5)
    flat, offsets = shingle_sets(hashes, owners, len(docs))
    u = np.array([0, 0, 0, 1, 9, 9, 10], dtype=np.int64)
    v = np.array([6, 7, 8, 2, 10, 9, 10], dtype=np.int64)
    got = exact_jaccard_pairs(flat, offsets, u, v, chunk=3)
    for (a, b), j in zip(zip(u, v), got):
        sa, sb = shingle_strings(docs[a], "word", 5), shingle_strings(docs[b], "word", 5)
        want = len(sa & sb) / len(sa | sb) if sa | sb else 1.0
        assert j == pytest.approx(want)


def test_exact_verification_removes_lsh_false_positives():
    base = random_docs(1, words=300, seed=21)[0]
    texts = [base] + [edit_words(base, k, seed=k) for k in (8, 10, 12, 14)]  # Jaccard ~0.6-0.75
    exact = minhash_duplicates(texts, MinHashConfig(verify="exact", threshold=0.8))
    loose = minhash_duplicates(texts, MinHashConfig(verify="none", threshold=0.8, bands=32, rows=2))
    assert not exact.any() and loose.any()


def test_config_errors_name_keys():
    with pytest.raises(ConfigError, match="minhash.bands"):
        MinHasher(MinHashConfig(bands=20, rows=20))
    with pytest.raises(ConfigError, match="minhash.shingle"):
        MinHasher(MinHashConfig(shingle="sentence"))
    with pytest.raises(ConfigError, match="minhash.verify"):
        MinHasher(MinHashConfig(verify="maybe"))
    with pytest.raises(ConfigError, match="threshold"):
        MinHasher(MinHashConfig(threshold=1.5))
