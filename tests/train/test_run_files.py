"""A failed `kiln train` never changes the run directory it was pointed at (through the CLI)."""

from pathlib import Path

import pytest

from kiln.checkpoint.manager import CheckpointManager
from kiln.cli import main as kiln_main
from kiln.train import trainer as trainer_mod

from conftest import tiny_overrides


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run except the token-shard cache, by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and "data" not in p.relative_to(run).parts}


@pytest.fixture
def trained_run(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    assert kiln_main(["train", "--run-dir", str(run), *_sets(tiny_overrides(text_file, **{"train.steps": 6}))]) == 0
    capsys.readouterr()
    before = _snapshot(run)
    assert "config.toml" in before and "checkpoints/step-6/config.toml" in before
    return run, before


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_resume_with_a_conflicting_model_setting_fails_in_one_line_and_writes_nothing(trained_run, text_file, capsys):
    run, before = trained_run
    assert kiln_main(["train", "--resume", str(run), "--set", "model.dim=64"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("kiln train: error: model.dim=64 conflicts with") and "model.dim=32" in line
    assert _snapshot(run) == before
    # A fresh start pointed at the same directory continues it, so it is checked the same way.
    args = ["train", "--run-dir", str(run), *_sets(tiny_overrides(text_file, **{"train.steps": 6}))]
    assert kiln_main(args + ["--set", "data.tokenizer=bpe"]) == 2
    assert "data.tokenizer='bpe' conflicts with" in _one_error_line(capsys)
    assert _snapshot(run) == before
    # Settings that shape neither weights nor data may change; the run still resumes afterwards.
    assert kiln_main(["train", "--resume", str(run), "--set", "train.steps=8", "--set", "model.dropout=0.1"]) == 0
    assert "done: 8 steps" in capsys.readouterr().out
    assert (run / "checkpoints" / "step-8").is_dir()


def test_a_resume_that_fails_while_loading_leaves_config_and_checkpoints(trained_run, monkeypatch):
    run, before = trained_run

    def broken_load(self, states, step=None):
        raise RuntimeError("checkpoint load failed")

    monkeypatch.setattr(CheckpointManager, "load", broken_load)
    with pytest.raises(RuntimeError, match="checkpoint load failed"):
        kiln_main(["train", "--resume", str(run), "--set", "train.steps=8"])
    assert _snapshot(run) == before


def test_a_fresh_start_that_fails_midway_leaves_the_earlier_run_unchanged(tmp_path, text_file, monkeypatch, capsys):
    run = tmp_path / "run"
    no_checkpoints = {"train.steps": 3, "checkpoint.every": 0, "checkpoint.save_final": "false"}
    assert kiln_main(["train", "--run-dir", str(run), *_sets(tiny_overrides(text_file, **no_checkpoints))]) == 0
    before = _snapshot(run)
    assert {"config.toml", "tokenizer.json", "metrics.jsonl"} <= set(before)

    def broken_optimizer(*args, **kwargs):
        raise RuntimeError("optimizer could not be built")

    monkeypatch.setattr(trainer_mod, "build_optimizer", broken_optimizer)
    with pytest.raises(RuntimeError, match="optimizer could not be built"):
        kiln_main(["train", "--run-dir", str(run),
                   *_sets(tiny_overrides(text_file, **{**no_checkpoints, "model.dim": 64}))])
    assert _snapshot(run) == before  # config.toml, tokenizer.json and metrics.jsonl (not moved aside)


def test_a_damaged_saved_config_is_a_one_line_error(trained_run, capsys):
    run, _ = trained_run
    (run / "checkpoints" / "step-6" / "config.toml").write_text("[model]\ndim = 'not a number'\n")
    assert kiln_main(["train", "--resume", str(run)]) == 2
    line = _one_error_line(capsys)
    assert "step-6/config.toml" in line and "model.dim" in line
