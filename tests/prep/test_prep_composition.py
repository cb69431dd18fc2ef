import json

import pytest

from kiln.prep.base import new_stats
from kiln.prep.composition import MAX_VALUES, OTHER, CompositionCounter, composition_table, length_bucket, url_host


def test_url_host_never_raises():
    assert url_host({"url": "https://Example.COM./a?b"}) == "example.com"
    assert url_host({"url": "example.org/path"}) == "example.org"
    assert url_host({}) == "(no url)"
    assert url_host({"url": ""}) == "(empty url)" and url_host({"url": "  "}) == "(empty url)"
    assert url_host({"url": 42}) == "(empty url)"
    assert url_host({"url": "http://[::1"}) == "(bad url)"
    assert url_host({"url": "http://"}) == "(bad url)"


def test_length_buckets():
    assert [length_bucket(n) for n in (0, 255, 256, 4096, 1 << 40)] == [
        "<256 B", "<256 B", "256 B-1 KiB", "4-16 KiB", ">=64 KiB"]


def test_counter_caps_values_and_table_sums():
    stats = new_stats()
    counter = CompositionCounter(stats, "in")
    for i in range(MAX_VALUES + 10):
        counter.add({"source": "a.jsonl", "url": f"http://h{i}.com/"}, 10)
    assert stats["comp_docs_in"]["host=" + OTHER] == 10
    assert stats["comp_docs_in"]["source=a.jsonl"] == MAX_VALUES + 10
    table = composition_table(stats, top=5)
    assert len(table["host"]) == 6 and table["host"][-1]["value"] == OTHER
    assert sum(r["docs_in"] for r in table["host"]) == MAX_VALUES + 10
    assert table["language"] == [{"value": "(unknown)", "docs_in": MAX_VALUES + 10, "bytes_in": 10 * (MAX_VALUES + 10),
                                  "docs_kept": 0, "bytes_kept": 0}]


def test_pipeline_report_has_composition_per_step(tmp_path):
    pytest.importorskip("py3langid")
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    raw = tmp_path / "raw"
    raw.mkdir()
    en = "The weather was cold this morning, so we stayed inside and read books by the fire all day long."
    fr = "Il faisait froid ce matin, alors nous sommes restés à la maison pour lire des livres toute la journée."
    records = [{"text": en + f" Story {i}.", "url": f"https://news.example.com/{i}"} for i in range(6)]
    records += [{"text": fr + f" Numéro {i}.", "url": "https://exemple.fr/x"} for i in range(3)]
    records += [{"text": en + " No url here.", "url": ""}, {"text": "1234 5678", "url": "http://["}]
    (raw / "web.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    cfg = tmp_path / "prep.toml"
    cfg.write_text(f'[input]\npath = "{raw}"\n[output]\ndir = "{tmp_path / "out"}"\n[tokenize]\nenabled = false\n'
                   '[run]\nworkers = 1\nprogress = "none"\n[[step]]\ntype = "language"\nkeep = ["en"]\nmin_score = 0.5\n')
    report = run_prep(load_prep_config(cfg))
    comp = report["composition"]["language"]
    hosts = {r["value"]: (r["docs_in"], r["docs_kept"]) for r in comp["host"]}
    assert hosts == {"news.example.com": (6, 6), "exemple.fr": (3, 0), "(empty url)": (1, 1), "(bad url)": (1, 0)}
    langs = {r["value"]: (r["docs_in"], r["docs_kept"]) for r in comp["language"]}
    assert langs == {"(unknown)": (11, 0), "en": (0, 7)}  # labelled by the step itself
    assert comp["source"][0]["value"] == "web.jsonl"
    assert not any(k.startswith("comp_") for s in report["steps"].values() for k in s)
    page = (tmp_path / "out" / "prep_report.html").read_text(encoding="utf-8")
    assert "Composition" in page and "news.example.com" in page
