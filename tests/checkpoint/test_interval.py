"""checkpoint.every = "auto": the Young/Daly interval from the measured blocking cost."""

import math

import pytest

from kiln.checkpoint import interval as interval_mod
from kiln.checkpoint.interval import PROBE_STEPS, CheckpointInterval, young_daly_seconds
from kiln.config import load_config
from kiln.errors import ConfigError

from ckpt_testlib import RUN, rows
from conftest import tiny_overrides


def test_young_daly_formula():
    assert young_daly_seconds(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))


def test_fixed_interval_is_a_step_multiple():
    plan = CheckpointInterval(5)
    assert [s for s in range(1, 21) if plan.due(s)] == [5, 10, 15, 20]
    assert plan.saved(5, 1.0) is None and not CheckpointInterval(0).due(10)


def test_auto_interval_follows_the_measured_cost(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(interval_mod.time, "perf_counter", lambda: clock[0])
    plan = CheckpointInterval("auto", mtbf_hours=1.0)
    assert not plan.due(PROBE_STEPS - 1) and plan.due(PROBE_STEPS)
    clock[0] = 10 * 0.1 + 2.0  # 10 steps of 0.1 s, then a 2 s blocking save
    line = plan.saved(PROBE_STEPS, 2.0)
    expected_s = math.sqrt(2 * 2.0 * 3600)  # 120 s
    assert plan.every == round(expected_s / 0.1) == 1200
    assert "every 1200 steps" in line and "expected lost work per failure ~60 s" in line
    # A cheaper save (async) makes the interval shorter: C = 0.5 * 0.02 + 0.5 * 2.0
    clock[0] += 1200 * 0.1 + 0.02
    plan.saved(PROBE_STEPS + 1200, 0.02)
    assert plan.every == round(math.sqrt(2 * 1.01 * 3600) / 0.1)
    assert plan.due(PROBE_STEPS + 1200 + plan.every) and not plan.due(PROBE_STEPS + 1200 + plan.every - 1)


def test_config_accepts_auto_only(text_file):
    cfg = load_config(None, tiny_overrides(text_file, **{"checkpoint.every": "'auto'", "checkpoint.mtbf_hours": 2}))
    assert cfg.checkpoint.every == "auto"
    with pytest.raises(ConfigError, match="checkpoint.every='sometimes'"):
        load_config(None, tiny_overrides(text_file, **{"checkpoint.every": "'sometimes'"}))
    with pytest.raises(ConfigError, match="mtbf_hours"):
        load_config(None, tiny_overrides(text_file, **{"checkpoint.mtbf_hours": 0}))


def test_trainer_logs_the_planned_interval(tmp_path, text_file):
    from kiln.train.trainer import train

    cfg = load_config(None, tiny_overrides(text_file, **{**RUN, "train.steps": PROBE_STEPS + 2,
                                                         "checkpoint.every": "'auto'"}))
    train(cfg, tmp_path / "run")
    assert PROBE_STEPS in [r["step"] for r in rows(tmp_path / "run", "checkpoint")]
    planned = [r for r in rows(tmp_path / "run", "event") if "Young/Daly" in r["message"]]
    assert planned and planned[0]["step"] == PROBE_STEPS  # the final save may re-plan (timing)
