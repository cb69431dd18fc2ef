"""The issue's checks over the recorded gloo measurements (benchmarks/results/plan_validation.json,
written by benchmarks/plan_validation.py from benchmarks/results/parallel_memory.json).

Tolerance rule (benchmarks/README.md, "Planner accuracy"): a measured step time is the median of
interleaved rounds, and its spread is (max - min) / median over those rounds. "The search's best
plan is never worse than the best run" holds when plan_s <= best_s * (1 + t), t = the larger of
the two layouts' spreads, recomputed here from the rows; two layouts must be predicted in their
measured order when their measured gap exceeds their combined spread (the sum of the two)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan_validation.json"


def _data():
    return json.loads(RESULTS.read_text())


def _spread(name):
    return next(r["step_spread"] for r in _data()["rows"] if r["layout"] == name)


def test_results_cover_two_and_four_processes():
    assert sorted(r["world"] for r in _data()["best_plan"]) == [2, 4]


@pytest.mark.parametrize("world", [2, 4])
def test_search_best_plan_never_worse_than_best_run_within_the_measured_spread(world):
    row = next(r for r in _data()["best_plan"] if r["world"] == world)
    assert row["plan_measured"] is not None, f"{row['plan']} was not among the layouts run"
    tol = max(_spread(row["plan_measured"]), _spread(row["best_measured"]))
    assert row["tolerance"] == pytest.approx(tol)  # the tolerance is the spread, nothing added
    assert row["plan_measured_s"] <= row["best_measured_s"] * (1 + tol), (
        f"{world} processes: the search's {row['plan']} measured {row['plan_measured_s']:.3f} s, "
        f"{row['best_measured']} {row['best_measured_s']:.3f} s (spread {tol:.0%})")


@pytest.mark.xfail(strict=True, reason="98 of 105 pairs: pp_1f1b x4 measured 5% faster than ddp x4, 7% faster "
                   "than zero1 x4, 5% faster than diloco_ddp x4 and 21% faster than zero2 x4, pp_gpipe x4 17% faster "
                   "than zero2 x4 (spreads 1-3%), predicted 10%, 8% and 12% slower and level (-0%, -0%): every "
                   "pipeline send and receive, and the step's norm all-reduce and loss broadcast over the stages "
                   "(profiled and counted since 29 Nov), pays the launch cost fitted mostly to FSDP's waited-on "
                   "collectives, and micro-batch 1 sits low on the efficiency curve; not yet modelled apart. cp x4 "
                   "measured 9% faster than zero1_tp x4 and 27% faster than ddp_tp x4, predicted level (-0%, -1%): "
                   "cp x4 predicted 20% above its measured step, ddp_tp x4 9% below")
def test_layouts_apart_by_more_than_their_spread_are_predicted_in_measured_order():
    data = _data()
    for pair in data["ordering"]:
        assert pair["measured_gap"] > _spread(pair["faster"]) + _spread(pair["slower"])
    wrong = [p for p in data["ordering"] if p["predicted_gap"] <= 0]
    assert not wrong, [f"{p['faster']} < {p['slower']}: measured {p['measured_gap']:+.0%}, predicted "
                       f"{p['predicted_gap']:+.0%}" for p in wrong]


def test_step_time_within_target_for_eight_layouts_leave_one_out():
    rows = _data()["rows"]
    within = [r["layout"] for r in rows if abs(r["time_error"]) <= 0.25]
    assert len(within) >= 8, {r["layout"]: f"{r['time_error']:+.0%}" for r in rows}


def test_recorded_peak_memory_with_activations_within_ten_percent():
    rows = [r for r in _data()["rows"] if "peak_error" in r]  # the data-parallel layouts
    assert len(rows) >= 8
    for r in rows:
        assert r["measured_peak_bytes"] > r["measured_bytes"], f"{r['layout']}: peak lacks activations"
        assert abs(r["peak_error"]) <= 0.10, f"{r['layout']}: peak memory off by {r['peak_error']:+.1%}"


def test_recorded_model_parallel_state_is_exact():
    """tp, cp, every pipeline schedule and ddp/zero1 x tp: the fullest rank's parameters and
    optimizer state at rest as predicted (exact tensor bytes; zero1's whole-tensor partition)."""
    rows = [r for r in _data()["rows"] if "rest_error" in r]
    assert len(rows) >= 14 and {"tp x4", "pp_zbv_zero_bubble x2", "zero1_tp x4"} <= {r["layout"] for r in rows}
    for r in rows:
        assert abs(r["rest_error"]) <= 0.005, f"{r['layout']}: parameters + optimizer off by {r['rest_error']:+.2%}"


def test_the_misordered_pairs_are_the_ones_the_xfail_names():
    """The strict xfail above names this one; a change that fixes or breaks another pair must
    update its reason (and benchmarks/README.md, "Planner accuracy")."""
    wrong = {(p["faster"], p["slower"]) for p in _data()["ordering"] if p["predicted_gap"] <= 0}
    assert wrong == {("pp_1f1b x4", "ddp x4"), ("pp_1f1b x4", "zero1 x4"), ("pp_1f1b x4", "diloco_ddp x4"),
                     ("pp_1f1b x4", "zero2 x4"), ("pp_gpipe x4", "zero2 x4"),
                     ("cp x4", "zero1_tp x4"), ("cp x4", "ddp_tp x4")}


def test_the_diloco_rows_are_validated():
    """DiLoCo with every rank a replica (x2) and with DDP over 2 ranks inside each of 2 replicas
    (x4): state at rest exact (the anchor and momentum split by the replica's ranks), step time
    within the target."""
    rows = {r["layout"]: r for r in _data()["rows"]}
    for name in ("diloco x2", "diloco_ddp x4"):
        assert rows[name]["memory_error"] == pytest.approx(0, abs=1e-3) and abs(rows[name]["time_error"]) <= 0.25


def test_the_tp_replica_rows_are_validated():
    """ddp x tp and zero1 x tp (2 replicas of tp=2 at 4 processes) are predicted; a row whose rounds
    spread over the 25% target is left out of the fit, not out of the check."""
    rows = {r["layout"]: r for r in _data()["rows"]}
    for name in ("ddp_tp x4", "zero1_tp x4"):
        assert rows[name]["predicted_step_s"] > 0 and rows[name]["measured_step_s"] > 0
    assert abs(rows["ddp_tp x4"]["time_error"]) <= 0.25


def test_recorded_checkpointing_peaks_within_target_and_in_measured_order():
    """Every activation-checkpointing setting at tp 1 and 2 (benchmarks/activation_checkpointing.py's
    exact peaks): the planner's eager peak within 15%, and every pair of settings whose measured
    peaks are more than 10% apart predicted in that order."""
    ac = _data()["checkpointing"]
    assert {(r["tp"], r["ac"]) for r in ac["rows"]} == {(tp, s) for tp in (1, 2) for s in ("none", "full", "selective", "op")}
    for r in ac["rows"]:
        assert abs(r["error"]) <= ac["target"] == 0.15, f"{r['case']}: peak off by {r['error']:+.1%}"
    assert len(ac["ordering"]) >= 8 and all(o["measured_gap"] > ac["order_gap"] for o in ac["ordering"])
    wrong = [f"{o['larger']} > {o['smaller']}: predicted {o['predicted_gap']:+.0%}" for o in ac["ordering"] if not o["ok"]]
    assert not wrong, wrong
