import pytest

from kiln.errors import ConfigError
from kiln.prep.base import Doc, StepContext
from kiln.prep.fineweb import FineWebQuality, FineWebQualityConfig, duplicated_line_chars
from kiln.prep.pipeline import config_from_dict

GOOD_LINE = "This is a perfectly ordinary sentence of a reasonable length for the web."


def reason(text, **kw):
    return FineWebQuality(FineWebQualityConfig(**kw)).reason(Doc("d", text))


def test_published_defaults():
    c = FineWebQualityConfig()
    assert (c.line_punct_thr, c.short_line_thr, c.short_line_length, c.char_duplicates_ratio,
            c.new_line_ratio) == (0.12, 0.67, 30, 0.01, 0.3)


def test_good_document_kept():
    text = "\n".join(f"{GOOD_LINE} Number {i} of the series goes on." for i in range(10))
    assert reason(text) is None


def test_each_rule_has_its_reason():
    assert reason("") == "fineweb:empty" and reason(" \n \n") == "fineweb:empty"
    no_punct = "\n".join(f"a heading without a final stop number {i} here" for i in range(10))
    assert reason(no_punct) == "fineweb:line_punct_ratio"
    assert reason(no_punct, line_punct_exclude_zero=True) is None  # nothing ends with a stop: kept
    short = "\n".join(["Short line."] * 0 + [f"Item {i}." for i in range(8)] + [GOOD_LINE, GOOD_LINE + " x."])
    assert reason(short) == "fineweb:short_line_ratio"
    dup = "\n".join([f"{GOOD_LINE} Unique tail {i}." for i in range(20)] + [GOOD_LINE] * 2)
    assert reason(dup) == "fineweb:char_dup_ratio"
    assert reason(dup, char_duplicates_ratio=0.1) is None
    listy = "\n".join(f"Entry {i} has a longer description that ends." for i in range(10))
    # 8 words and 1 newline per line: 9/80 = 0.11 newlines per word; a list of two-word lines is not
    assert reason(listy) is None
    spaced = "\n\n\n".join(f"Entry {i} has a longer description that ends." for i in range(10))
    assert reason(spaced) == "fineweb:list_ratio"  # 27 newlines / 80 words = 0.34 > 0.3


def test_duplicated_line_chars_counts_repeats_only():
    assert duplicated_line_chars(["ab", "cde", "ab", "ab"]) == 4
    assert duplicated_line_chars([]) == 0


def test_step_counts_reasons_and_config():
    step = FineWebQuality()
    ctx = StepContext()
    docs = [Doc("1", "\n".join([GOOD_LINE] * 3)), Doc("2", "\n".join(f"{GOOD_LINE} {i}." for i in range(5)))]
    kept = list(step.run(iter(docs), ctx))
    assert [d.id for d in kept] == ["2"]
    assert ctx.stats["fineweb_quality"]["dropped"] == {"fineweb:char_dup_ratio": 1}
    cfg = config_from_dict({"step": [{"type": "fineweb_quality", "short_line_length": 40}]})
    assert cfg.steps[0].config.short_line_length == 40
    with pytest.raises(ConfigError, match="line_punct_thr"):
        config_from_dict({"input": {"path": "x"}, "step": [{"type": "fineweb_quality", "line_punct_thr": 2.0}]}).validate()
