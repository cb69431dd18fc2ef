from kiln.prep.base import Doc, StepContext
from kiln.prep.quality import (C4Filter, C4Config, GopherQuality, GopherQualityConfig, GopherRepetition,
                                    dup_ngram_char_frac, top_ngram_char_frac)

PROSE = ("The history of the river valley is long and full of change. Farmers settled there early, and they "
         "built small villages with wooden houses along the banks. Over the centuries the villages grew into "
         "towns that traded grain, wool and timber with the coast. Floods came often, so people learned to "
         "build on higher ground and to store food for the wet months. Today the valley is known for its "
         "orchards, its quiet roads, and the old stone bridge that still carries traffic across the water.")


def gopher_reason(text, **kw):
    return GopherQuality(GopherQualityConfig(**kw)).reason(Doc("d", text))


def test_gopher_keeps_ordinary_prose():
    assert gopher_reason(PROSE) is None
    assert GopherRepetition().reason(Doc("d", PROSE)) is None


def test_gopher_word_count_bounds():
    assert gopher_reason("the cat and the dog") == "gopher:word_count"
    assert gopher_reason(PROSE, max_words=20) == "gopher:word_count"


def test_gopher_mean_word_length():
    long_words = " ".join(["the", "and"] + ["incomprehensibilities"] * 60)
    assert gopher_reason(long_words) == "gopher:mean_word_length"
    short_words = " ".join(["the", "and"] + ["a", "b"] * 40)
    assert gopher_reason(short_words) == "gopher:mean_word_length"


def test_gopher_symbols_bullets_ellipsis_alpha_stopwords():
    assert gopher_reason(PROSE + " #tag" * 12) == "gopher:hash_ratio"
    assert gopher_reason(PROSE + " wait..." * 12) == "gopher:ellipsis_ratio"
    bullets = "\n".join(f"- item number {i} of the list with words" for i in range(20))
    assert gopher_reason(bullets) == "gopher:bullet_lines"
    trailing = "\n".join(f"and then the story went on and on {i}..." for i in range(10))
    assert gopher_reason(trailing, max_symbol_word_ratio=1.0) == "gopher:ellipsis_lines"
    numbers = "the and " + " ".join(str(1000 + i) for i in range(60))
    assert gopher_reason(numbers) == "gopher:alpha_words"
    no_stop = " ".join(["quick brown foxes jumped over lazy dogs"] * 10)
    assert gopher_reason(no_stop) == "gopher:stop_words"


def test_repetition_lines_paragraphs_and_ngrams():
    rep = GopherRepetition()
    dup_lines = "\n".join(["the same line again"] * 5 + [f"unique line {i}" for i in range(5)])
    assert rep.reason(Doc("d", dup_lines)) in ("gopher_rep:dup_line_frac", "gopher_rep:dup_line_char_frac")
    dup_paras = "\n\n".join([PROSE, PROSE, "short different paragraph"])
    assert rep.reason(Doc("d", dup_paras)).startswith("gopher_rep:dup_para")
    spam = PROSE + " " + "buy now " * 60
    assert rep.reason(Doc("d", spam)) == "gopher_rep:top_2gram"


def test_ngram_fractions():
    words = "a b c d e a b c d e".split()
    assert dup_ngram_char_frac(words, 5) == 0.5  # the second "a b c d e" repeats the first
    assert dup_ngram_char_frac("a b c d e f g h i j".split(), 5) == 0.0
    assert top_ngram_char_frac("x y x y x y".split(), 2) == 1.0
    assert top_ngram_char_frac("p q r s".split(), 2) == 0.0


def run_c4(text, **kw):
    ctx = StepContext()
    out = list(C4Filter(C4Config(**kw)).run(iter([Doc("d", text)]), ctx))
    return out, ctx.stats.get("c4", {})


def test_c4_line_cleaning_and_page_rules():
    page = ("This is the first good sentence here.\nMenu Home About\nAnother proper sentence follows now!\n"
            "Please enable javascript to view this page.\nA third one is here too.\nIs this the fourth one?\n"
            "And finally the fifth sentence.")
    out, stats = run_c4(page)
    assert len(out) == 1
    assert "Menu Home" not in out[0].text and "javascript" not in out[0].text
    assert stats["modified"]["c4:lines_removed"] == 2
    _, stats = run_c4("Lorem ipsum dolor sit amet. " * 10)
    assert stats["dropped"] == {"c4:lorem_ipsum": 1}
    _, stats = run_c4("function f() { return 1; } is code here.")
    assert stats["dropped"] == {"c4:curly_brace": 1}
    _, stats = run_c4("Only one sentence is here.")
    assert stats["dropped"] == {"c4:too_few_sentences": 1}
    _, stats = run_c4("no punctuation at all\nnor here")
    assert stats["dropped"] == {"c4:no_lines_left": 1}


def _reference_dup_frac(words, n):
    seen, covered = set(), [False] * len(words)
    for i in range(len(words) - n + 1):
        gram = tuple(words[i:i + n])
        if gram in seen:
            covered[i:i + n] = [True] * n
        seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered) if c) / sum(map(len, words))


def _reference_top_frac(words, n):
    """None when several n-grams tie for most frequent (then either may be reported)."""
    from collections import Counter

    ranked = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1)).most_common(2)
    (gram, count), runner_up = ranked[0], ranked[1][1] if len(ranked) > 1 else 0
    if count == runner_up:
        return None
    return 0.0 if count < 2 else sum(map(len, gram)) * count / sum(map(len, words))


def test_vectorised_ngram_stats_match_reference():
    import random

    rng = random.Random(1)
    checked_top = 0
    for trial in range(40):
        vocab = ["a", "bb", "ccc", "dddd", "the", "of"][: rng.randint(2, 6)]
        words = [rng.choice(vocab) for _ in range(rng.randint(12, 80))]
        for n in (2, 3, 5, 8):
            assert abs(dup_ngram_char_frac(words, n) - _reference_dup_frac(words, n)) < 1e-12
            ref = _reference_top_frac(words, n)
            if ref is not None:
                checked_top += 1
                assert abs(top_ngram_char_frac(words, n) - ref) < 1e-12
    assert checked_top > 20


def test_no_letter_word_regex_matches_isalpha_definition():
    import random

    from kiln.prep.quality import _NO_LETTER_WORD

    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab1_-.é©ж \n\t3") for _ in range(30))
        expected = sum(1 for w in text.split() if not any(ch.isalpha() for ch in w))
        assert len(_NO_LETTER_WORD.findall(text)) == expected, repr(text)
