import pytest

from kiln.prep.dedup.suffix_array import SuffixArrayConfig, dedup_substrings, duplicate_mask, join_documents
from kiln.errors import ConfigError

SPAN = "This exact boilerplate sentence is repeated in several documents and must go. "


def test_keep_first_removes_later_copies_of_a_long_span():
    docs = ["Intro one. " + SPAN + "Outro one.", "Intro two. " + SPAN + "Outro two.", "Unique text only."]
    result = dedup_substrings(docs, SuffixArrayConfig(min_length=50, keep="first"))
    assert result.texts[0] == docs[0]  # the first occurrence stays
    # the repeated span is ". " + SPAN + "Outro " (the longest shared run), everything else stays
    assert result.texts[1] == "Intro twotwo."
    assert result.texts[2] == docs[2]
    assert result.removed_bytes[1] >= len(SPAN) - 2 and result.removed_bytes[0] == 0


def test_keep_none_removes_every_occurrence():
    docs = ["Intro one. " + SPAN + "Outro one.", "Intro two. " + SPAN + "Outro two."]
    result = dedup_substrings(docs, SuffixArrayConfig(min_length=50, keep="none"))
    assert result.texts == ["Intro oneone.", "Intro twotwo."]


def test_shorter_repeats_are_left_alone():
    short = "repeat me twice"  # 15 bytes, below k
    docs = [f"alpha {short} beta", f"gamma {short} delta", "abcabcabcabc"]
    result = dedup_substrings(docs, SuffixArrayConfig(min_length=20))
    assert result.texts == docs and result.removed_bytes == [0, 0, 0]


def test_matches_never_cross_document_boundaries():
    # "...HELLO" + sep + "WORLD..." repeats, but each side within a document is < k bytes
    docs = ["xxxx HELLO", "WORLD yyyy", "zz HELLO", "WORLD ww"]
    corpus, starts = join_documents([d.encode() for d in docs])
    assert not duplicate_mask(corpus, SuffixArrayConfig(min_length=8)).any()
    assert not duplicate_mask(corpus, SuffixArrayConfig(min_length=8, keep="none")).any()


def test_multibyte_characters_are_removed_whole():
    span = "héllo wörld — ünïcode ☃ text that repeats "
    docs = ["ab " + span + "cd", "ef " + span + "gh"]
    for keep in ("first", "none"):
        result = dedup_substrings(docs, SuffixArrayConfig(min_length=7, keep=keep))
        for text in result.texts:
            text.encode("utf-8")  # valid text, no half characters
        assert "ünïcode" not in result.texts[1]


def test_config_errors():
    with pytest.raises(ConfigError, match="keep"):
        dedup_substrings(["a"], SuffixArrayConfig(keep="some"))
    with pytest.raises(ConfigError, match="min_length"):
        dedup_substrings(["a"], SuffixArrayConfig(min_length=0))


@pytest.mark.parametrize("keep", ["first", "none"])
def test_mask_equals_brute_force_k_gram_definition(keep):
    import random

    rng = random.Random(3)
    pieces = ["abcab", "xyz", "abcabxyz", "q", "zz"]
    docs = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(12)]
    k = 6
    corpus, starts = join_documents([d.encode() for d in docs])
    mask = duplicate_mask(corpus, SuffixArrayConfig(min_length=k, keep=keep))
    data = bytes(corpus)
    windows: dict[bytes, list[int]] = {}
    for doc_start, doc in zip(starts.tolist(), docs):
        for q in range(doc_start, doc_start + len(doc) - k + 1):
            windows.setdefault(data[q:q + k], []).append(q)
    expected = [False] * len(data)
    for occurrences in windows.values():
        if len(occurrences) > 1:
            for q in occurrences[1:] if keep == "first" else occurrences:
                expected[q:q + k] = [True] * k
    assert mask.tolist() == expected
