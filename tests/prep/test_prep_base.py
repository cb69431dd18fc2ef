from dataclasses import dataclass

import pytest

from kiln.prep.base import (Doc, Filter, GlobalStep, STEP_TYPES, StepContext, merge_stats,
                                 new_stats, register, text_bytes)


@dataclass
class _MinLen:
    min_chars: int = 3


class _Short(Filter):
    type = "test_short"
    Config = _MinLen

    def reason(self, doc):
        return "short" if len(doc.text) < self.config.min_chars else None


def test_filter_counts_drops_and_examples():
    ctx = StepContext(max_examples=1)
    step = _Short()
    docs = [Doc("a", "hi"), Doc("b", "hello"), Doc("c", "é")]
    kept = list(step.run(iter(docs), ctx))
    assert [d.id for d in kept] == ["b"]
    stats = ctx.stats["test_short"]
    assert stats["dropped"] == {"short": 2}
    assert stats["dropped_bytes"] == {"short": 2 + 2}  # "é" is two UTF-8 bytes
    assert stats["examples"]["short"] == [{"id": "a", "text": "hi"}]


def test_merge_sums_counters_and_caps_examples():
    a = {"s": new_stats()}
    a["s"]["docs_in"] = 2
    a["s"]["dropped"] = {"x": 1}
    a["s"]["examples"] = {"x": [{"id": "1", "text": "t"}]}
    b = {"s": new_stats(), "t": new_stats()}
    b["s"]["docs_in"] = 3
    b["s"]["dropped"] = {"x": 2, "y": 1}
    b["s"]["examples"] = {"x": [{"id": "2", "text": "u"}, {"id": "3", "text": "v"}]}
    merged = merge_stats(a, b, max_examples=2)
    assert merged["s"]["docs_in"] == 5
    assert merged["s"]["dropped"] == {"x": 3, "y": 1}
    assert [e["id"] for e in merged["s"]["examples"]["x"]] == ["1", "2"]
    assert "t" in merged


def test_register_requires_type_and_dataclass_config():
    class NoType(Filter):
        pass

    with pytest.raises(TypeError):
        register(NoType)
    register(_Short)
    assert STEP_TYPES["test_short"] is _Short
    del STEP_TYPES["test_short"]


def test_global_step_stages_are_abstract():
    step = GlobalStep()
    with pytest.raises(NotImplementedError):
        step.index(iter([]), StepContext())
    assert text_bytes("ab") == 2
