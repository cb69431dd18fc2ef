"""The `language` step: offline identification (py3langid's shipped model), keep list, scores."""

import pytest

pytest.importorskip("py3langid")

from kiln.prep.base import Doc, StepContext  # noqa: E402
from kiln.prep.language import LanguageConfig, LanguageStep, identify_language  # noqa: E402

# A small multilingual sample written for these tests (no downloads, no ../shared).
SAMPLES = {
    "en": "The weather was cold this morning, so we stayed inside and read books by the fire.",
    "fr": "Il faisait froid ce matin, alors nous sommes restés à la maison pour lire des livres.",
    "de": "Heute Morgen war es kalt, deshalb sind wir zu Hause geblieben und haben Bücher gelesen.",
    "es": "Esta mañana hacía frío, así que nos quedamos en casa leyendo libros junto al fuego.",
    "it": "Stamattina faceva freddo, quindi siamo rimasti a casa a leggere libri vicino al fuoco.",
    "ru": "Сегодня утром было холодно, поэтому мы остались дома и читали книги у камина.",
}


def test_identifies_each_sample():
    for lang, text in SAMPLES.items():
        got, score = identify_language(text)
        assert got == lang, (lang, got, score)
        assert 0.0 <= score <= 1.0


def test_keep_list_metadata_and_reasons():
    step = LanguageStep(LanguageConfig(keep=["en", "fr"], min_score=0.5))
    docs = [Doc(lang, text, {"url": "u"}) for lang, text in SAMPLES.items()]
    docs += [Doc("empty", ""), Doc("digits", "1234 5678 !!! ??? 42"), Doc("short", "ok")]
    ctx = StepContext()
    kept = list(step.run(iter(docs), ctx))
    assert [d.id for d in kept] == ["en", "fr"]
    assert kept[0].meta["language"] == "en" and kept[0].meta["url"] == "u"
    assert 0.5 <= kept[0].meta["language_score"] <= 1.0
    dropped = ctx.stats["language"]["dropped"]
    assert dropped == {"language:de": 1, "language:es": 1, "language:it": 1, "language:ru": 1,
                       "language:undetectable": 3}


def test_empty_keep_labels_everything_and_min_score_drops():
    ctx = StepContext()
    kept = list(LanguageStep(LanguageConfig(keep=[])).run(iter(Doc(k, v) for k, v in SAMPLES.items()), ctx))
    assert {d.id: d.meta["language"] for d in kept} == {k: k for k in SAMPLES}
    mixed = Doc("mixed", "The cat sleeps. Le chat dort. Die Katze schläft. El gato duerme.")
    _, score = identify_language(mixed.text)
    ctx = StepContext()
    strict = LanguageStep(LanguageConfig(keep=[], min_score=min(1.0, score + 1e-3)))
    assert list(strict.run(iter([mixed]), ctx)) == []
    assert ctx.stats["language"]["dropped"] == {"language:low_score": 1}
