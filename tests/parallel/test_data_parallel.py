"""Every data-parallel mode (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP) on gloo gives the per-step losses
of one process on the same global batch, and its checkpoint continues in another layout.

Tolerance: fp32, relative 1e-5 per step (observed: equal up to the order of the gradient
reduction, < 2e-7). The optimizer is SGD with momentum and no clipping, so a gradient that is
scaled wrongly (summed instead of averaged over ranks) changes the next loss: AdamW would hide
it (it is invariant to gradient scale). `test_tolerance_catches_wrong_gradient_scaling` shows the
check fails for exactly that error.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import tiny_overrides
from ranks import kill_launcher, tag_env

STEPS = 6
REL = 1e-5
GLOBAL_BATCH = 4


def run_kiln(args, nproc=1, timeout=240):
    """`kiln` in one process or under torchrun (--standalone picks a free port). The launcher
    runs in its own process group, killed whole on timeout or failure, so no rank outlives it."""
    env, tag = tag_env({**os.environ, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "kiln.cli"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "kiln.cli"]
    p = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_launcher(p, tag)
    assert p.returncode == 0, err[-3000:]
    return out, err


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}  # a resumed step's last row wins


def sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


def assert_same_losses(expected, got, steps):
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=REL), f"step {step}: {got[step]} != {expected[step]}"


def common(text_file, **extra):
    return tiny_overrides(text_file, **{"train.steps": STEPS, "train.eval_every": 0, "checkpoint.every": 3,
                                        "checkpoint.keep_last": 5, "optim.name": "sgd", "optim.lr": 0.1,
                                        "train.clip_grad_norm": 0,
                                        # gloo on CPU also where GPUs are visible (fewer GPUs than ranks is refused)
                                        "train.device": "cpu", **extra})


def ddp2_args(text_file) -> list[str]:
    """DDP on 2 ranks of 2 sequences (the global batch): the run of conftest's ddp2_torchrun_run."""
    return sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH // 2, "parallel.dp_mode": "'ddp'"}))


@pytest.fixture(scope="module")
def reference(dp_reference):
    return dp_reference  # one process, the global batch: one launch per session (conftest)


def resume_from_step_3(run, nproc, batch_size, mode):
    """Drop the later checkpoint and continue from step 3 in another layout."""
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    run_kiln(["train", str(run / "config.toml"), "--run-dir", str(run), "--resume",
              *sets([f"train.batch_size={batch_size}", f"parallel.dp_mode={mode!r}", "parallel.dp_replicate=1",
                     "parallel.dp_shard=-1"])], nproc=nproc)


# mode on 2 ranks -> the layout its step-3 checkpoint resumes in (nproc, dp_mode), or None. The
# pairs cover ZeRO-1's own save and load paths, a sharded -> replicated load and FSDP 2 -> 1;
# HSDP 4 -> FSDP 2 is below. (Every resume is a process start: kept few for the 2-core budget.)
LAYOUTS = {"ddp": None, "zero1": (2, "fsdp"), "zero2": (2, "zero1"), "fsdp": (1, "auto")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_two_ranks_match_one_process_and_resume_in_another_layout(tmp_path, text_file, reference, mode, request):
    if mode == "ddp":  # the session's shared torchrun run (conftest), which ddp does not resume
        run = request.getfixturevalue("ddp2_torchrun_run")
    else:
        run = tmp_path / mode
        run_kiln(["train", "--run-dir", str(run),
                  *sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH // 2, "parallel.dp_mode": repr(mode)}))],
                 nproc=2)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    run_row = next(r for r in rows if r["kind"] == "run")
    assert (run_row["dp_mode"], run_row["world_size"]) == (mode, 2)
    assert all("memory_mb_min" in r for r in rows if r["kind"] == "train")
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))

    if LAYOUTS[mode]:
        nproc, next_mode = LAYOUTS[mode]
        resume_from_step_3(run, nproc, GLOBAL_BATCH // nproc, next_mode)
        assert_same_losses(reference, losses(run), range(4, STEPS + 1))


@pytest.mark.timeout(600)
def test_hsdp_on_four_ranks_matches_and_reshards_to_fsdp_on_two(tmp_path, text_file, reference):
    run = tmp_path / "hsdp"
    run_kiln(["train", "--run-dir", str(run),
              *sets(common(text_file, **{"train.batch_size": 1, "parallel.dp_replicate": 2,
                                         "parallel.dp_shard": 2}))], nproc=4)
    run_row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert (run_row["dp_mode"], run_row["dp_replicate"], run_row["dp_shard"]) == ("fsdp", 2, 2)
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))
    resume_from_step_3(run, 2, GLOBAL_BATCH // 2, "fsdp")
    assert_same_losses(reference, losses(run), range(4, STEPS + 1))


def test_tolerance_catches_wrong_gradient_scaling(tmp_path, text_file, reference):
    # Gradients summed over 2 ranks instead of averaged are twice too large; with SGD that is the
    # same run as one process at twice the learning rate.
    run = tmp_path / "doubled"
    run_kiln(["train", "--run-dir", str(run),
              *sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH, "optim.lr": 0.2}))])
    with pytest.raises(AssertionError):
        assert_same_losses(reference, losses(run), range(1, STEPS + 1))


def test_impossible_layout_fails_before_any_work_naming_the_key(tmp_path, text_file, monkeypatch, capsys):
    from kiln.cli import main

    run = tmp_path / "bad"
    for key, value in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--run-dir", str(run), *sets(common(text_file, **{"parallel.dp_replicate": 2}))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 0] kiln train: error:"), lines
    assert "parallel.dp_replicate" in lines[0] and "world size 3" in lines[0], lines
    assert not run.exists()  # nothing was written


def test_every_failing_rank_reports_with_its_rank(tmp_path, text_file):
    # An error every rank meets (here: ranks pinned to one GPU id) is one line per rank, each
    # naming its rank, and the launcher exits non-zero instead of hanging.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "kiln.cli", "train", "--run-dir", str(tmp_path / "run"),
                        *sets(common(text_file, **{"train.device": "'cuda:0'"}))],
                       capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    assert p.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] kiln train: error: train.device='cuda:0'" in p.stderr, p.stderr[-2000:]
