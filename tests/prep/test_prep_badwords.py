import pytest

from kiln.errors import ConfigError
from kiln.prep.base import Doc, StepContext
from kiln.prep.pipeline import config_from_dict
from kiln.prep.quality import C4BadWords, C4BadWordsConfig


@pytest.fixture()
def lists(tmp_path):
    en = tmp_path / "en"
    en.write_text("# comment\nbadword\ntwo words\n", encoding="utf-8")
    fr = tmp_path / "fr"
    fr.write_text("gros mot\n", encoding="utf-8")
    return {"en": str(en), "fr": str(fr)}


def run(step, docs):
    ctx = StepContext()
    kept = list(step.run(iter(docs), ctx))
    return [d.id for d in kept], ctx.stats[step.name]


def test_drops_whole_words_per_language(lists):
    step = C4BadWords(C4BadWordsConfig(words_files=lists))
    docs = [Doc("1", "A clean text."), Doc("2", "Contains a BadWord here."), Doc("3", "badwordsmith is fine"),
            Doc("4", "say two words now"), Doc("5", "un gros mot", {"language": "fr"}),
            Doc("6", "badword in French text is fine", {"language": "fr"}), Doc("7", "badword", {"language": "de"})]
    kept, stats = run(step, docs)
    assert kept == ["1", "3", "6", "7"]
    assert stats["dropped"] == {"c4_badwords:en": 2, "c4_badwords:fr": 1}
    assert stats["info"] == {"no_list:de": 1}
    strict = C4BadWords(C4BadWordsConfig(words_files=lists, drop_unlisted_languages=True))
    assert run(strict, [Doc("7", "x", {"language": "de"})])[1]["dropped"] == {"c4_badwords:no_list:de": 1}


def test_bad_lists_are_one_clear_error(tmp_path, lists):
    with pytest.raises(ConfigError, match="words_files is empty"):
        C4BadWords().setup(StepContext())
    with pytest.raises(ConfigError, match="words_files.en.*missing"):
        C4BadWords(C4BadWordsConfig(words_files={"en": str(tmp_path / "missing")})).setup(StepContext())
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="cannot read"):
        C4BadWords(C4BadWordsConfig(words_files={"en": str(binary)})).setup(StepContext())
    # a non-string path (an fd number would open stdin) is refused by the config check
    with pytest.raises(ConfigError, match="words_files.en must be a file path"):
        config_from_dict({"input": {"path": "x"}, "step": [{"type": "c4_badwords", "words_files": {"en": 0}}]}).validate()
