"""Loss-spike recovery: restore the newest good checkpoint, skip the data around the spike, at most N times."""

import pytest

from kiln.checkpoint.spike import SpikeGuard
from kiln.config import load_config
from kiln.train import trainer as trainer_mod
from kiln.train.trainer import train

from ckpt_testlib import RUN, rows
from conftest import tiny_overrides


def test_zscore_detection():
    guard = SpikeGuard(zscore=4.0, window=5)
    for loss in (3.0, 3.1, 2.9, 3.0, 3.05):
        assert guard.observe(loss) is None
    assert guard.observe(3.1) is None  # within the noise
    z = guard.observe(9.0)
    assert z is not None and z > 4.0
    assert 9.0 not in guard.recent  # a spike does not widen the window it is judged by
    assert SpikeGuard(zscore=0.0, window=2).observe(1e9) is None  # off


def _spike_at(monkeypatch, calls: set[int], factor: float = 50.0):
    """Multiply the loss the trainer sees on the given train_step calls (1-based)."""
    real, count = trainer_mod.train_step, [0]

    def step(*args, **kwargs):
        count[0] += 1
        loss, grad_norm, stepped = real(*args, **kwargs)
        return (loss * factor if count[0] in calls else loss), grad_norm, stepped

    monkeypatch.setattr(trainer_mod, "train_step", step)


SPIKE = {**RUN, "train.steps": 14, "checkpoint.every": 4, "checkpoint.spike_zscore": 5.0,
         "checkpoint.spike_window": 5, "checkpoint.spike_max_recoveries": 1, "checkpoint.spike_skip_batches": 2}


def test_spike_restores_and_skips_the_batches(tmp_path, text_file, monkeypatch):
    _spike_at(monkeypatch, {10, 13})  # step 10, then (after the recovery) a second spike
    run = tmp_path / "run"
    result = train(load_config(None, tiny_overrides(text_file, **SPIKE)), run)
    assert result.steps_done == 14
    events = [r for r in rows(run, "event") if r.get("spike_recovery")]
    assert len(events) == 1  # max_recoveries=1: the second spike is trained through
    event = events[0]
    assert event["step"] == 10 and event["restored_step"] == 8
    batch = 4  # train.batch_size, one rank, grad_accum 1
    skipped = event["skipped_samples"]
    # Restored at step 8's position; skips steps 9-10's batches and 2 more.
    assert skipped["from_position"] == 8 * batch and skipped["to_position"] == (10 + 2) * batch
    assert "skipped samples" in event["message"] and event["restored_from"] == "storage"
    steps = [r["step"] for r in rows(run, "train")]
    assert steps == list(range(1, 11)) + list(range(9, 15))  # steps 9-10 are redone after the restore


def test_replayed_steps_use_new_data(tmp_path, text_file, monkeypatch):
    """Before the spike the run equals an uninterrupted one; the redone step 9 trains on the batches
    after the skipped range, so its loss differs from the uninterrupted run's step 9."""
    _spike_at(monkeypatch, {10})
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(text_file, **SPIKE)), run)
    monkeypatch.undo()
    plain = tmp_path / "plain"
    train(load_config(None, tiny_overrides(text_file, **SPIKE)), plain)
    first = {r["step"]: r["loss"] for r in rows(plain, "train")}
    recovered = [r for r in rows(run, "train")]
    redo = {r["step"]: r["loss"] for r in recovered[10:]}
    assert [first[s] for s in range(1, 10)] == [r["loss"] for r in recovered[:9]]
    assert redo[9] != pytest.approx(first[9], abs=0)  # different data after the restore


def test_spike_restores_from_memory_when_there_is_a_replica(tmp_path, text_file, monkeypatch):
    _spike_at(monkeypatch, {10})
    run = tmp_path / "run"
    extra = {**SPIKE, "checkpoint.memory_replicas": "true", "checkpoint.replica_dir": repr(str(tmp_path / "shm"))}
    assert train(load_config(None, tiny_overrides(text_file, **extra)), run).steps_done == 14
    [event] = [r for r in rows(run, "event") if r.get("spike_recovery")]
    assert event["restored_step"] == 8 and event["restored_from"] == "own memory"
