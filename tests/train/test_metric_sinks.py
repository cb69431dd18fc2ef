"""TensorBoard and W&B (offline) get the same numbers as metrics.jsonl."""

import json

import pytest

from kiln.config import load_config
from kiln.train.trainer import train

from conftest import tiny_overrides


def _rows(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_tensorboard_scalars_equal_metrics_rows(tmp_path, text_file):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    train(load_config(None, tiny_overrides(text_file, **{"train.steps": 6, "train.eval_every": 3,
                                                       "metrics.tensorboard": "true"})), run)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in _rows(run, "train")}, rel=1e-6)
    val = {e.step: e.value for e in acc.Scalars("eval/val_loss")}
    assert val == pytest.approx({r["step"]: r["val_loss"] for r in _rows(run, "eval")}, rel=1e-6)


def test_wandb_offline_run_gets_the_rows(tmp_path, text_file, monkeypatch):
    """A real offline W&B run: every train and eval row's numbers are logged at its step (recorded
    on their way into wandb's own Run.log), and the offline run is written."""
    wandb = pytest.importorskip("wandb")
    logged, real_log = [], wandb.sdk.wandb_run.Run.log

    def spy(self, data, step=None, **kw):
        logged.append((step, dict(data)))
        return real_log(self, data, step=step, **kw)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    run = tmp_path / "wb"
    train(load_config(None, tiny_overrides(text_file, **{"train.steps": 4, "train.eval_every": 2,
                                                       "metrics.wandb": "true"})), run)
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    train_logged = {step: d["train/loss"] for step, d in logged if "train/loss" in d}
    assert train_logged == {r["step"]: r["loss"] for r in _rows(run, "train")}
    eval_logged = {step: d["eval/val_loss"] for step, d in logged if "eval/val_loss" in d}
    assert eval_logged == {r["step"]: r["val_loss"] for r in _rows(run, "eval")}
