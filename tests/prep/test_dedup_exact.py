import math

import numpy as np
import pytest

from kiln.prep.dedup.bloom import BloomFilter, bloom_size
from kiln.prep.dedup.exact import ExactConfig, ExactDeduper, content_hash, first_occurrences, split_units
from kiln.errors import ConfigError


def test_document_mode_drops_normalized_duplicates_keeps_first():
    d = ExactDeduper()
    assert d.process("Hello   World\n") == ("Hello   World\n", 0)
    assert d.process("hello world") == (None, 1)  # case and whitespace do not matter
    assert d.process("hello world!") == ("hello world!", 0)
    assert content_hash("A  b") == content_hash("a b") != content_hash("a bc")


def test_paragraph_mode_removes_repeated_paragraphs_across_documents():
    d = ExactDeduper(ExactConfig(unit="paragraph", min_unit_chars=5))
    boiler = "Subscribe to our newsletter for more stories."
    a = f"First story begins here.\n\n{boiler}\n\nok"
    b = f"Second story, different.\n\n{boiler}\n\nok"
    assert d.process(a) == (a, 0)
    text, removed = d.process(b)
    assert removed == 1 and boiler not in text and "Second story" in text
    assert text.endswith("ok")  # "ok" is shorter than min_unit_chars: exempt, never removed
    assert d.process(boiler) == (None, 1)  # nothing left: the whole document goes


def test_line_mode_and_split_units_roundtrip():
    text = "line one is here\nline two is here\r\nline one is here\n"
    assert "".join(split_units(text, "line")) == text
    assert "".join(split_units("a\n\n b\n \n\nc", "paragraph")) == "a\n\n b\n \n\nc"
    d = ExactDeduper(ExactConfig(unit="line", min_unit_chars=0))
    assert d.process(text) == ("line one is here\nline two is here\r\n", 1)


def test_first_occurrences_marks_later_copies():
    hi = np.array([1, 2, 1, 3, 2], dtype=np.uint64)
    lo = np.array([5, 5, 5, 5, 6], dtype=np.uint64)
    assert first_occurrences(hi, lo).tolist() == [True, True, False, True, True]


def test_bloom_size_follows_formulas():
    m, k = bloom_size(1_000_000, 0.01)
    assert m == math.ceil(-1_000_000 * math.log(0.01) / math.log(2) ** 2)
    assert k == round(m / 1_000_000 * math.log(2)) == 7
    with pytest.raises(ConfigError, match="fp_rate"):
        bloom_size(10, 1.5)


@pytest.mark.parametrize("fp_rate", [0.01, 0.001])
def test_bloom_false_positive_rate_close_to_configured(fp_rate):
    rng = np.random.default_rng(0)
    n = 20_000
    bloom = BloomFilter(n, fp_rate)
    members = rng.integers(0, 2**63, size=(2, n), dtype=np.uint64)
    assert bloom.add_new(members[0], members[1]).all()
    assert bloom.contains(members[0], members[1]).all()  # no false negatives
    others = rng.integers(0, 2**63, size=(2, 200_000), dtype=np.uint64)
    rate = bloom.contains(others[0], others[1]).mean()
    assert 0.5 * fp_rate < rate < 1.5 * fp_rate


def test_bloom_add_new_sees_repeats_inside_a_batch_and_across_batches():
    bloom = BloomFilter(1000, 0.001)
    h1 = np.array([1, 2, 1, 3], dtype=np.uint64)
    h2 = np.array([9, 9, 9, 9], dtype=np.uint64)
    assert bloom.add_new(h1, h2).tolist() == [True, True, False, True]
    assert bloom.add_new(h1[:2], h2[:2]).tolist() == [False, False]
    assert bloom.add_new_one((7 << 64) | 8) and not bloom.add_new_one((7 << 64) | 8)


def test_bad_config_names_key():
    with pytest.raises(ConfigError, match="exact.unit"):
        ExactDeduper(ExactConfig(unit="sentence"))
