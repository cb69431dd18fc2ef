"""The issue's search check over the recorded gloo measurements (benchmarks/results/
plan_validation.json, written by benchmarks/plan_validation.py): at every process count, the
plan `kiln plan`'s search ranks first must have been run and be no slower than the fastest
layout actually run."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan_validation.json"


def _rows():
    return json.loads(RESULTS.read_text())["best_plan"]


def test_results_cover_two_and_four_processes():
    assert sorted(r["world"] for r in _rows()) == [2, 4]


@pytest.mark.xfail(strict=True, reason="not met yet: the time model ranks zero2/fsdp ahead of the measured "
                                       "fastest layout (benchmarks/README.md, Planner accuracy)")
@pytest.mark.parametrize("world", [2, 4])
def test_search_best_plan_never_worse_than_best_run(world):
    row = next(r for r in _rows() if r["world"] == world)
    assert row["plan_measured_s"] is not None, f"{row['plan']} was not among the layouts run"
    assert row["plan_measured_s"] <= row["best_measured_s"], (
        f"{world} processes: the search's {row['plan']} measured {row['plan_measured_s']:.2f} s, "
        f"{row['best_measured']} {row['best_measured_s']:.2f} s")


def test_recorded_peak_memory_with_activations_within_ten_percent():
    rows = json.loads(RESULTS.read_text())["rows"]
    assert len(rows) >= 8
    for r in rows:
        assert r["measured_peak_bytes"] > r["measured_bytes"], f"{r['layout']}: peak lacks activations"
        assert abs(r["peak_error"]) <= 0.10, f"{r['layout']}: peak memory off by {r['peak_error']:+.1%}"
