"""metrics.profile_every: torch.profiler traces of every N-th training step (kiln/train/profiling.py)."""

import gzip
import json
import sys
from pathlib import Path

from conftest import tiny_overrides

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parallel"))
from ranks import run_ranks, train_runs  # noqa: E402


def rows(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_every_nth_step_is_traced_on_the_training_step_count_across_a_resume(tmp_path, text_file):
    from kiln.config import load_config
    from kiln.train.trainer import train

    run = tmp_path / "run"
    overrides = tiny_overrides(text_file, **{"train.steps": 7, "train.eval_every": 0, "checkpoint.every": 0,
                                             "metrics.profile_every": 3, "metrics.profile_memory": "true"})
    train(load_config(None, overrides), run, stop_at=4)
    train(load_config(run / "config.toml", []), run, resume=True)  # steps 5-7: its profiler starts at 4
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["step-3", "step-6"]
    for step in (3, 6):
        folder = run / "profile" / f"step-{step}"
        names = trace_names(folder / "rank-0.trace.json.gz")
        assert {"aten::mm", "[memory]"} <= names, sorted(names)[:20]
        assert "aten::mm" in (folder / "rank-0.top.txt").read_text()
    profiled = rows(run, "profile")
    assert [r["step"] for r in profiled] == [3, 6]
    for r in profiled:
        assert r["step_ms"] > 0 and r["time"] == "cpu" and r["trace"] == f"profile/step-{r['step']}"
        assert len(r["top"]) == 5 and all(ms >= 0 for _, ms in r["top"])
        assert not any(name.startswith("ProfilerStep") for name, _ in r["top"])


def test_every_step_traced_and_the_window_after_the_last_step_dropped(tmp_path, text_file):
    """profile_every = 1: the profiler opens a window for the step after the last one, which never
    runs; closing must not save it over the last step's trace."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(text_file, **{"train.steps": 3, "train.eval_every": 0,
                                                         "checkpoint.every": 0, "metrics.profile_every": 1})), run)
    assert [r["step"] for r in rows(run, "profile")] == [1, 2, 3]
    assert "aten::mm" in trace_names(run / "profile" / "step-3" / "rank-0.trace.json.gz")


def test_two_ranks_each_write_a_trace_and_the_collectives_are_counted(tmp_path, text_file):
    run = tmp_path / "run"
    overrides = tiny_overrides(text_file, **{"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 0,
                                             "checkpoint.save_final": "false", "train.batch_size": 2,
                                             "parallel.dp_mode": "'ddp'", "train.device": "cpu",
                                             "metrics.profile_every": 2})
    (tmp_path / "launch").mkdir()
    run_ranks(train_runs, 2, tmp_path / "launch", [(run, overrides)], timeout=240)
    folder = run / "profile" / "step-2"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank-0.top.txt", "rank-0.trace.json.gz", "rank-1.top.txt", "rank-1.trace.json.gz"]
    (row,) = rows(run, "profile")
    assert row["step"] == 2 and row["collective_ms"] > 0, row  # DDP's gradient all-reduce, at least


def test_off_by_default_nothing_is_profiled(tmp_path):
    import torch

    from kiln.config import MetricsConfig
    from kiln.train.profiling import StepProfiler

    profiler = StepProfiler(MetricsConfig().profile_every, False, tmp_path, 0, 0, torch.device("cpu"), print)
    profiler.step_done(1)
    profiler.close(1)
    assert profiler._prof is None and not (tmp_path / "profile").exists()


def test_memory_snapshots_on_a_gpu_are_recorded_and_written_beside_the_trace(tmp_path, monkeypatch):
    """CUDA's allocator history (metrics.profile_memory on a GPU): started with the profiler, dumped
    with each recorded step, stopped at the end. torch.cuda.memory's calls are stood in for here (no
    GPU); what they write on a GPU is torch's."""
    import torch

    from kiln.train.profiling import SNAPSHOT_ENTRIES, StepProfiler

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot"))
    profiler = StepProfiler(2, True, tmp_path, 0, 3, torch.device("cuda"), lambda row: calls.append(row["kind"]))
    for step in (1, 2, 3):
        torch.ones(64, 64) @ torch.ones(64, 64)
        profiler.step_done(step)
    profiler.close(3)
    assert calls[0] == ("record", (), {"max_entries": SNAPSHOT_ENTRIES}) and calls[-1] == ("record", (), {"enabled": None})
    assert "profile" in calls  # the step-2 row
    assert (tmp_path / "profile" / "step-2" / "rank-3.memory.pickle").read_bytes() == b"snapshot"
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step-2"]
