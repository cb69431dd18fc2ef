"""kiln loader-bench: compute vs warm vs cold loading, the stall and the settings that remove it."""

import json

import pytest
from conftest import tiny_overrides

from kiln.cli import main
from kiln.config import load_config
from kiln.train import stall
from kiln.report.run_page import build_report


def test_recommendations_follow_the_measurements():
    cfg = load_config(None, [])
    cfg.data.prefetch, cfg.data.lookahead, cfg.data.fetch_workers, cfg.data.cache_gb = 1, 0, 1, 1.0
    # compute 10 ms/step, prep 2 ms, fetch 24 ms: 3 parallel fetches fit in the 8 ms left
    rec = stall.recommend(0.010, 0.002, 0.024, slowest_cold_s=0.045, data_bytes=4 << 30, cfg=cfg)
    assert rec["fetch_workers"] == 3 and rec["lookahead"] == 5 and rec["prefetch"] == 6
    assert rec["cache_gb"] == pytest.approx(4.4) and "note" not in rec
    # preprocessing slower than compute: said plainly, settings never lowered below the current ones
    rec = stall.recommend(0.001, 0.003, 0.0, slowest_cold_s=0.003, data_bytes=1 << 20, cfg=cfg)
    assert "preprocessing" in rec["note"] and rec["cache_gb"] == 1.0 and rec["fetch_workers"] == 1


def test_loader_bench_writes_report_and_chart(tmp_path, text_file, monkeypatch, capsys):
    dropped = []
    drop = stall.drop_page_cache
    monkeypatch.setattr(stall, "drop_page_cache", lambda paths: (dropped.extend(paths), drop(paths)))
    run_dir = tmp_path / "run"
    args = ["loader-bench"] + [a for o in tiny_overrides(text_file, **{"data.windows": '"packed_masked"'})
                               for a in ("--set", o)] + ["--run-dir", str(run_dir), "--steps", "3"]
    assert main(args) == 0
    report = json.loads((run_dir / "reports" / "loader-bench.json").read_text())
    assert report["storage"] == "local" and report["windows"] == "packed_masked"
    assert len(report["samples"]["compute_s"]) == 3 and len(report["samples"]["cold_batch_s"]) == 3
    assert report["compute_s_per_step"] > 0 and report["prep_s_per_step"] > 0
    assert 0.0 <= report["stall_fraction"] < 1.0
    assert report["fetch_stall_fraction"] + report["prep_stall_fraction"] == pytest.approx(report["stall_fraction"])
    assert dropped and all(p.name.endswith(".npy") for p in dropped)  # the shard files, not anything else
    for phase in ("cold", "warm"):  # the threaded loader feeding real steps
        live = report["live"][phase]
        assert len(live["step_s"]) == 3 and 0.0 <= live["stall_fraction"] < 1.0
        assert sum(live["wait_s"]) / sum(live["step_s"]) == pytest.approx(live["stall_fraction"])
    assert set(report["recommended"]) >= {"prefetch", "fetch_workers", "lookahead", "cache_gb"}
    assert "stall" in capsys.readouterr().out

    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3.0, "lr": 0.001}\n')
    html, _, warnings = build_report(run_dir)
    assert 'id="chart-loader-bench"' in html and "data.fetch_workers" in html and not warnings

    bad = dict(report, compute_s_per_step="NaN")  # a hostile or damaged report: a warning, no crash
    (run_dir / "reports" / "loader-bench.json").write_text(json.dumps(bad))
    html, _, warnings = build_report(run_dir)
    assert "chart-loader-bench" not in html and any("not a loader-bench report" in w for w in warnings)
