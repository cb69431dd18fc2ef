import itertools
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import ConfigError, KilnError
from kiln.train.sweep import (Space, SweepPlan, grid_trials, parse_grid, parse_space, random_trials, rank,
                             run_sweep, sweep_page)
from kiln.train.trainer import TrainResult

from conftest import tiny_overrides


def tiny_set_args(text_file: Path) -> list[str]:
    out = []
    for o in tiny_overrides(text_file, **{"metrics.progress": "none", "train.eval_every": 3, "checkpoint.every": 3}):
        out += ["--set", o]
    return out


class Page(HTMLParser):
    def __init__(self, html):
        super().__init__()
        self.svgs, self.data, self._script = [], {}, None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs.append(a["id"])
        if tag == "script":
            self._script = [a["id"], ""]

    def handle_data(self, data):
        if self._script:
            self._script[1] += data

    def handle_endtag(self, tag):
        if tag == "script":
            self.data[self._script[0]] = json.loads(self._script[1])
            self._script = None


def test_parse_grid_and_space():
    assert parse_grid(["optim.lr=1e-3,3e-3", "optim.betas=[0.9,0.95],[0.9, 0.99]", "optim.name=adamw,lion"]) == {
        "optim.lr": ["1e-3", "3e-3"], "optim.betas": ["[0.9,0.95]", "[0.9, 0.99]"], "optim.name": ["adamw", "lion"]}
    assert grid_trials({"a.x": ["1", "2"], "b.y": ["3", "4"]}) == [
        {"a.x": "1", "b.y": "3"}, {"a.x": "1", "b.y": "4"}, {"a.x": "2", "b.y": "3"}, {"a.x": "2", "b.y": "4"}]
    spaces = parse_space(["optim.lr=1e-4:1e-1:log", "schedule.warmup_steps=0:50", "optim.weight_decay=0:0.2"])
    assert spaces["optim.lr"] == Space("optim.lr", 1e-4, 1e-1, True, False)
    assert spaces["schedule.warmup_steps"].integer and not spaces["optim.weight_decay"].integer


@pytest.mark.parametrize("flag, item, message", [
    ("grid", "lr=1,2", "section.key"), ("grid", "optim.lr=", "section.key"), ("grid", "optim.lr=1,,2", "empty value"),
    ("space", "optim.lr=1", "LO:HI"), ("space", "optim.lr=a:b", "numbers"), ("space", "optim.lr=2:1", "smaller"),
    ("space", "optim.lr=0:1:log", "LO > 0"), ("space", "optim.lr=1:2:lin", "LO:HI"),
])
def test_bad_specs_are_clear_errors(flag, item, message):
    with pytest.raises(ConfigError, match=message):
        (parse_grid if flag == "grid" else parse_space)([item])


def test_random_search_is_seeded_bounded_and_log_uniform():
    spaces = parse_space(["optim.lr=1e-4:1e-1:log", "schedule.warmup_steps=0:50"])
    trials = random_trials(spaces, 600, seed=5)
    assert trials == random_trials(spaces, 600, seed=5) and trials != random_trials(spaces, 600, seed=6)
    lrs = [float(t["optim.lr"]) for t in trials]
    warm = [int(t["schedule.warmup_steps"]) for t in trials]  # ints are written as ints
    assert all(1e-4 <= v <= 1e-1 for v in lrs) and all(0 <= w <= 50 for w in warm)
    decades = [sum(10 ** (k - 1) <= v < 10 ** k for v in lrs) for k in (-3, -2, -1)]
    assert all(150 < d < 250 for d in decades), decades  # log-uniform: about a third per decade
    assert len(set(warm)) > 40


def fake_train(outcomes: dict[str, object], calls: list):
    """A train() stand-in: by optim.lr, return a val loss, raise, or return NaN."""
    def train(cfg, run_dir):
        calls.append(Path(run_dir).name)
        outcome = outcomes[repr(cfg.optim.lr)]
        if isinstance(outcome, BaseException):
            raise outcome
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return TrainResult(Path(run_dir), cfg.train.steps, 2.0, outcome, outcome, "completed")
    return train


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path):
    plan = SweepPlan(None, ["train.eval_every=5"], grid_trials({"optim.lr": ["0.1", "0.2", "0.3", "0.4"]}), steps=10)
    calls = []
    outcomes = {"0.1": 3.0, "0.2": RuntimeError("boom"), "0.3": math.nan, "0.4": 2.5}
    records = run_sweep(plan, tmp_path / "s", train_fn=fake_train(outcomes, calls), log=lambda m: None)
    assert calls == ["trial-000", "trial-001", "trial-002", "trial-003"]
    assert [r["status"] for r in records] == ["completed", "failed", "diverged", "completed"]
    assert records[1]["error"] == "RuntimeError: boom"
    assert "boom" in (tmp_path / "s" / "trial-001" / "error.txt").read_text()  # the traceback is kept
    assert [r["trial"] for r in rank(records)] == ["trial-003", "trial-000", "trial-001", "trial-002"]
    saved = json.loads((tmp_path / "s" / "sweep.json").read_text())  # strict JSON: NaN became null
    assert saved["ranking"][:2] == ["trial-003", "trial-000"] and saved["trials"][2]["best_val_loss"] is None


def test_interrupted_sweep_resumes_and_skips_finished_trials(tmp_path):
    plan = SweepPlan(None, [], grid_trials({"optim.lr": ["0.1", "0.2", "0.3"]}), steps=10)
    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, tmp_path / "s", train_fn=fake_train({"0.1": 3.0, "0.2": KeyboardInterrupt()}, calls),
                  log=lambda m: None)
    saved = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["completed", "interrupted", "pending"]
    calls.clear()
    records = run_sweep(plan, tmp_path / "s", train_fn=fake_train({"0.2": 2.0, "0.3": 4.0}, calls), log=lambda m: None)
    assert calls == ["trial-001", "trial-002"]
    assert [r["status"] for r in records] == ["completed"] * 3
    other = SweepPlan(None, [], grid_trials({"optim.lr": ["0.5"]}), steps=10)
    with pytest.raises(KilnError, match="holds a different sweep"):
        run_sweep(other, tmp_path / "s", train_fn=fake_train({}, []), log=lambda m: None)


def test_an_edited_config_file_is_a_different_sweep(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("[train]\neval_every = 5\n")
    plan = SweepPlan(str(config), [], grid_trials({"optim.lr": ["0.1"]}), steps=10)
    run_sweep(plan, tmp_path / "s", train_fn=fake_train({"0.1": 3.0}, []), log=lambda m: None)
    config.write_text("[train]\neval_every = 2\n")
    with pytest.raises(KilnError, match="holds a different sweep"):
        run_sweep(plan, tmp_path / "s", train_fn=fake_train({"0.1": 3.0}, []), log=lambda m: None)


def test_bad_trial_config_fails_before_any_training(tmp_path):
    plan = SweepPlan(None, [], grid_trials({"optim.lr": ["0.1", "-1"]}), steps=10)
    with pytest.raises(ConfigError, match=r"trial-001 \(optim.lr=-1\): optim.lr=-1.0 must be > 0"):
        run_sweep(plan, tmp_path / "s", train_fn=fake_train({}, []))
    plan = SweepPlan(None, [], grid_trials({"optim.nope": ["1"]}), steps=10)
    with pytest.raises(ConfigError, match="unknown key optim.nope"):
        run_sweep(plan, tmp_path / "s", train_fn=fake_train({}, []))
    assert not (tmp_path / "s" / "trial-000").exists()


def test_sweep_page_plots_each_key():
    records = [{"trial": f"trial-{i:03d}", "status": "completed", "params": {"optim.lr": lr, "optim.name": name},
                "best_val_loss": loss} for i, (lr, name, loss) in
               enumerate([(1e-3, "adamw", 3.0), (1e-2, "adamw", 2.5), (1e-3, "lion", 3.2), (1e-2, "lion", 2.9)])]
    records.append({"trial": "trial-004", "status": "failed", "params": {"optim.lr": 1.0, "optim.name": "lion"},
                    "error": "boom <x>"})
    html = sweep_page("s", records, ["optim.lr", "optim.name"])
    page = Page(html)
    assert page.svgs == ["chart-sweep-0", "chart-sweep-1"]
    assert [t["best_val_loss"] for t in page.data["data-sweep"]["trials"]] == [3.0, 2.5, 3.2, 2.9, None]
    assert "boom &lt;x&gt;" in html and ">lion<" in html  # escaped note, categorical tick
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


@pytest.mark.timeout(240)
def test_cli_grid_sweep_with_the_real_trainer(tmp_path, text_file, capsys, monkeypatch):
    args = ["sweep", "--grid", "optim.lr=1e-2,1e-3", "model.vocab_size=0,10", "--steps", "6", "--name", "s",
            "--runs-dir", str(tmp_path), *tiny_set_args(text_file)]
    assert main(args) == 0
    out = capsys.readouterr().out
    sweep_dir = tmp_path / "s"
    saved = json.loads((sweep_dir / "sweep.json").read_text())
    by_trial = {t["trial"]: t for t in saved["trials"]}
    assert [t["status"] for t in saved["trials"]] == ["completed", "failed", "completed", "failed"]
    assert "vocab_size=10 is smaller" in by_trial["trial-001"]["error"]
    for name in ("trial-000", "trial-002"):
        rows = [json.loads(line) for line in (sweep_dir / name / "metrics.jsonl").read_text().splitlines()]
        val = [r["val_loss"] for r in rows if r["kind"] == "eval"]
        assert by_trial[name]["best_val_loss"] == min(val) and by_trial[name]["final_val_loss"] == val[-1]
        assert by_trial[name]["steps_done"] == 6 and by_trial[name]["tokens_per_s"] > 0
        assert not (sweep_dir / name / "data").exists()  # trials share the sweep's shards
    assert (sweep_dir / "data" / "meta.json").is_file()
    best = min(("trial-000", "trial-002"), key=lambda t: by_trial[t]["best_val_loss"])
    assert saved["ranking"][0] == best
    assert "trial-000" in out and "sweep.html" in out
    page = Page((sweep_dir / "sweep.html").read_text())
    assert page.svgs == ["chart-sweep-0", "chart-sweep-1"]

    # rerun: finished trials are skipped (train must not be called)
    def no_training(*a, **k):
        raise AssertionError("a finished trial was trained again")
    monkeypatch.setattr("kiln.train.trainer.train", no_training)
    assert main(args) == 0
    assert "skipped" in capsys.readouterr().out
    monkeypatch.undo()
    # --retry-failed reruns only the failed ones and keeps their old dirs aside
    assert main(args + ["--retry-failed"]) == 0
    assert len(list(sweep_dir.glob("trial-001.failed-*"))) == 1
    assert json.loads((sweep_dir / "sweep.json").read_text())["trials"][0] == saved["trials"][0]


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["sweep"]) == 2
    assert "nothing to sweep" in capsys.readouterr().err
    assert main(["sweep", "--grid", "optim.lr=1,2", "--random", "3"]) == 2
    assert main(["sweep", "--random", "3"]) == 2
    assert "--space" in capsys.readouterr().err
    assert main(["sweep", "--grid", "optim.lr=1", "--name", "a/b"]) == 2


def test_grids_get_lines_and_exact_ticks_random_searches_get_points():
    from kiln.train.sweep import is_grid, sweep_chart

    def rec(i, lr, wd, loss):
        return {"trial": f"t{i}", "status": "completed", "params": {"optim.lr": lr, "optim.weight_decay": wd},
                "best_val_loss": loss}
    grid = [rec(i, lr, wd, 3.0 + i) for i, (lr, wd) in enumerate(itertools.product([1e-3, 1e-2], [0.0, 0.1]))]
    keys = ["optim.lr", "optim.weight_decay"]
    assert is_grid(grid, keys)
    chart = sweep_chart(grid, keys, "optim.lr", 0, True)
    assert [s.name for s in chart.series] == ["optim.weight_decay=0.0", "optim.weight_decay=0.1"]
    assert chart.log_x and [t for t, _ in chart.x_ticks] == [1e-3, 1e-2]
    rand = [rec(0, 1e-3, 0.05, 3.0), rec(1, 2e-3, 0.05, 2.0), rec(2, 5e-2, 0.07, 2.5)]
    assert not is_grid(rand, keys)
    chart = sweep_chart(rand, keys, "optim.lr", 0, False)
    assert len(chart.series) == 1 and chart.series[0].style == "points" and chart.x_ticks is None
    assert chart.series[0].xs == [1e-3, 2e-3, 5e-2] and chart.series[0].ys == [3.0, 2.0, 2.5]


def test_a_diverged_trial_is_told_by_its_type_not_its_message(tmp_path):
    from kiln.errors import KilnError, TrainingDiverged

    plan = SweepPlan(None, ["train.eval_every=5"], grid_trials({"optim.lr": ["0.1", "0.2"]}), steps=10)
    outcomes = {"0.1": TrainingDiverged("stopped: 5 non-finite steps in a row"),
                "0.2": KilnError("data.source: non-finite text?")}
    records = run_sweep(plan, tmp_path / "s", train_fn=fake_train(outcomes, []), log=lambda m: None)
    assert [r["status"] for r in records] == ["diverged", "failed"]
