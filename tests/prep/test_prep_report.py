from pathlib import Path

from kiln.prep.base import new_stats
from kiln.prep.pipeline import PrepConfig
from kiln.prep.readers import ReaderConfig
from kiln.prep.report import build_report, print_report, render_html


def make_report():
    read, flt = new_stats(), new_stats()
    read.update(docs_in=10, bytes_in=1000, docs_kept=9, bytes_kept=900, dropped={"read:bad_json": 1},
                dropped_bytes={"read:bad_json": 100})
    flt.update(docs_in=9, bytes_in=900, docs_kept=6, bytes_kept=700, dropped={"gopher:word_count": 3},
               dropped_bytes={"gopher:word_count": 200},
               examples={"gopher:word_count": [{"id": "a<b>", "text": "<script>alert('x')</script> & more"}]})
    hist = [0] * 41
    hist[8] = 10
    return build_report(PrepConfig(input=ReaderConfig(path="x")), ["read", "flt"], {"read": read, "flt": flt},
                        hist, hist, {}, {"shards": 1, "rejects": 1, "removed": 3, "resumed": False,
                                         "seconds": 1.0, "executor": "local", "workers": 1})


def test_funnel_and_reasons():
    report = make_report()
    assert [f["docs_kept"] for f in report["funnel"]] == [9, 6]
    assert report["totals"] == {"docs_in": 10, "bytes_in": 1000, "docs_out": 6, "bytes_out": 700}
    assert report["top_reasons"][0] == {"step": "flt", "reason": "gopher:word_count", "docs": 3, "bytes": 200}


def test_html_is_self_contained_and_escaped():
    page = render_html(make_report())
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in page
    assert "a&lt;b&gt;" in page and "<svg" in page
    assert "src=" not in page and "href=" not in page and "@import" not in page


def test_terminal_table(capsys):
    from rich.console import Console

    print_report(make_report(), Console(file=None, width=160))
    out = capsys.readouterr().out
    assert "gopher:word_count (3)" in out and "66.7" in out


def test_warning_when_nothing_survives():
    report = make_report()
    assert report["warnings"] == []
    cfg = PrepConfig(input=ReaderConfig(path="x"))
    stats = new_stats()
    stats.update(docs_in=3, dropped={"x": 3})
    empty = build_report(cfg, ["read"], {"read": stats}, [0] * 41, [0] * 41, {}, {})
    assert empty["warnings"] == ["no document survived the pipeline; see the removal reasons"]
