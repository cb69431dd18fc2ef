"""Collective timeouts (kiln/parallel/timeouts.py): a stuck rank makes the others fail in one line
after parallel.train_timeout_s, while the first step and checkpoint saves keep the long init bound."""

import time

import pytest

from conftest import tiny_overrides
from ranks import run_ranks

TRAIN_S = 2.0  # the train bound; every deliberate delay below but the last is twice that
SLOW_S = 2 * TRAIN_S
STUCK_S = 25.0  # how long rank 1 stays stuck at most (it leaves as soon as rank 0 has failed)


def _stuck_rank(rank, world, run, overrides, failed_flag):
    """Rank 1 finishes step 1 SLOW_S late (after its collectives), rank 0 writes the step-3
    checkpoint's manifest SLOW_S late, and rank 1 is stuck in step 5. Returns (error type, line,
    when it was raised, when rank 1 got stuck)."""
    import os
    from pathlib import Path

    import kiln.checkpoint.manifest as manifest
    import kiln.train.trainer as trainer
    from kiln.config import load_config
    from kiln.parallel.timeouts import CollectiveTimeouts

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    stuck_at = [None]
    if rank == 1:
        step_done, train_step, calls = CollectiveTimeouts.step_done, trainer.train_step, [0]

        def slow_first_step_done(self, step):
            if step == 1:  # every rank but this one is past step 1 (before the bound drops)
                time.sleep(SLOW_S)
            step_done(self, step)

        def stuck_fifth_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 5:
                stuck_at[0] = time.time()
                while time.time() - stuck_at[0] < STUCK_S and not Path(failed_flag).exists():
                    time.sleep(0.1)
            return train_step(*args, **kwargs)

        CollectiveTimeouts.step_done = slow_first_step_done
        trainer.train_step = stuck_fifth_step
    else:
        write_manifest = manifest.write_manifest

        def slow_manifest(path, step):
            time.sleep(SLOW_S)  # rank 1 waits for the renamed step-3 directory meanwhile
            return write_manifest(path, step)

        manifest.write_manifest = slow_manifest
    try:
        trainer.train(load_config(None, overrides), run)
        return None, "", time.time(), stuck_at[0]
    except Exception as e:  # noqa: BLE001 - the test compares each rank's error
        if rank == 0:
            Path(failed_flag).touch()
        return type(e).__name__, str(e), time.time(), stuck_at[0]


def test_a_stuck_rank_fails_the_others_after_the_train_bound_not_before(tmp_path, text_file):
    overrides = tiny_overrides(text_file, **{
        "train.steps": 8, "train.eval_every": 0, "checkpoint.every": 3, "checkpoint.async_save": "false",
        "train.batch_size": 2, "parallel.dp_mode": "'ddp'", "train.device": "cpu",
        "parallel.init_timeout_s": 60, "parallel.train_timeout_s": TRAIN_S})
    (tmp_path / "launch").mkdir()
    results = run_ranks(_stuck_rank, 2, tmp_path / "launch", tmp_path / "run", overrides,
                        str(tmp_path / "rank0-failed"), timeout=240)
    (kind, line, raised_at, _), (_, _, _, stuck_at) = results
    from kiln import torch_compat

    if not torch_compat.gloo_timeouts_change():  # 2.6-2.8: the bound cannot drop; the run says so once
        import json

        rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        said = [r["message"] for r in rows if r["kind"] == "event" and "is not applied" in r.get("message", "")]
        assert kind is None and len(said) == 1 and "train_timeout_s=2 is not applied" in said[0], (kind, line, said)
        return
    assert kind == "CollectiveTimeout", (kind, line)
    # The slow step 1 and the slow manifest were waited for; the stuck step 5 was not.
    assert line.startswith("a collective after step 4 waited longer than parallel.train_timeout_s=2 s: rank 1 did "
                           "not time out with the others"), line
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "manifest.json").is_file()
    waited = raised_at - stuck_at
    assert TRAIN_S * 1.8 < waited < 2 * TRAIN_S + 10, waited  # the bound, the grace for the others, a loaded machine's slack


@pytest.mark.parametrize("message, expected", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete", True),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for "
     "300041 milliseconds before timing out.", True),
    ("Connection closed by peer [127.0.0.1]:27809", False),
    ("CUDA out of memory", False),
])
def test_explain_names_the_bound_in_force_and_the_last_step(message, expected):
    from kiln.parallel.timeouts import CollectiveTimeouts

    timeouts = CollectiveTimeouts(1800, 300)
    line = timeouts.explain(RuntimeError(message))
    assert (line is not None) == expected
    if expected:
        assert "before the first step" in str(line) and "parallel.init_timeout_s=1800 s" in str(line)
        timeouts.step_done(7)  # one process: the bound stays, the step is remembered
        timeouts.training = True
        assert "after step 7" in str(timeouts.explain(RuntimeError(message)))
        assert "parallel.train_timeout_s=300 s" in str(timeouts.explain(RuntimeError(message)))


def test_the_world_group_joins_with_the_init_bound(monkeypatch):
    import datetime

    import torch.distributed as dist

    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    seen = {}

    class Joined(Exception):
        """Raised in place of joining: the test stops at the call and reads its arguments."""

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise Joined

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    dims = ParallelDims.from_config(ParallelConfig(dp_mode="ddp"), world_size=2, rank=0, local_rank=0)
    with pytest.raises(Joined):
        dims.build_mesh("cpu", init_timeout_s=42)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=42)}


def test_nccl_flight_recorder_settings_leave_what_the_user_exported(tmp_path, monkeypatch):
    import os

    from kiln.parallel.timeouts import record_nccl_collectives

    names = ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    record_nccl_collectives(tmp_path / "off", 0)
    assert not (tmp_path / "off").exists() and not any(name in os.environ for name in names)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")  # the user's, under the older name
    record_nccl_collectives(tmp_path / "traces", 2000)
    assert (tmp_path / "traces").is_dir()
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == \
        f"{tmp_path / 'traces'}/rank_"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def _different_collectives(rank, world):
    """Each rank waits in a collective of its own group (2 s bound from creation, every release):
    both time out, and each finds the other timed out too."""
    import datetime

    import torch
    import torch.distributed as dist

    from kiln.parallel.timeouts import CollectiveTimeouts

    groups = [dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2)) for _ in range(2)]
    try:
        dist.all_reduce(torch.ones(1), group=groups[rank])
    except RuntimeError as e:
        timeouts = CollectiveTimeouts(1800, 2)
        timeouts.training, timeouts.last_step = True, 7
        return str(timeouts.explain(e))
    return "no timeout"


def test_when_every_rank_timed_out_the_line_says_they_wait_in_different_collectives(tmp_path):
    lines = run_ranks(_different_collectives, 2, tmp_path, timeout=120)
    for line in lines:
        assert line.startswith("a collective after step 7 waited longer than parallel.train_timeout_s=2 s: every rank "
                               "timed out waiting: they wait in different collectives"), line
