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
import subprocess
import sys

import pytest

from conftest import tiny_overrides
from ranks import continue_in_copy, kill_launcher, run_ranks, skip_where_this_torch_cannot, tag_env, train_runs

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
    if p.returncode:
        skip_where_this_torch_cannot(err)
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


def resume_overrides(nproc, mode) -> list[str]:
    """The layout a step-3 checkpoint continues in: `mode` over all `nproc` ranks."""
    return [f"train.batch_size={GLOBAL_BATCH // nproc}", f"parallel.dp_mode={mode!r}", "parallel.dp_replicate=1",
            "parallel.dp_shard=-1"]


# mode on 2 ranks -> the layout its step-3 checkpoint resumes in (nproc, dp_mode), or None. The
# pairs cover ZeRO-1's own save and load paths, a sharded -> replicated load and FSDP 2 -> 1;
# HSDP 4 -> FSDP 2 is below. The runs share two launches (4 ranks, then 2), run by the `runs`
# fixture; the torchrun + CLI path is the ddp run's (conftest) and the failing-rank test's.
LAYOUTS = {"ddp": None, "zero1": (2, "fsdp"), "zero2": (2, "zero1"), "fsdp": (1, "auto")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    """name -> run directory: each 2-rank mode, HSDP on 4 ranks, each step-3 continuation
    ("<mode> resumed") and one process at twice the learning rate ("doubled lr")."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("dp")
    out = {name: root / name for name in ["hsdp", "zero1", "zero2", "fsdp", "hsdp accum2", "ddp accum2", "batch8"]}
    (root / "ranks4").mkdir()
    hsdp = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}
    run_ranks(train_runs, 4, root / "ranks4", [
        (out["hsdp"], common(text_file, **{"train.batch_size": 1, **hsdp})),
        # 2 micro-batches of 1 per rank (a global batch of 8): the all-reduce across replicas in the last only
        (out["hsdp accum2"], common(text_file, **{"train.batch_size": 1, "train.grad_accum": 2, **hsdp}))],
        timeout=400)
    jobs = [(out[mode], common(text_file, **{"train.batch_size": GLOBAL_BATCH // 2, "parallel.dp_mode": repr(mode)}))
            for mode in ["zero1", "zero2", "fsdp"]]
    jobs.append((out["ddp accum2"], common(text_file, **{"train.batch_size": 1, "train.grad_accum": 2,
                                                         "parallel.dp_mode": "'ddp'"})))
    for mode, (nproc, next_mode) in [("zero1", LAYOUTS["zero1"]), ("zero2", LAYOUTS["zero2"]), ("hsdp", (2, "fsdp"))]:
        out[f"{mode} resumed"] = root / f"{mode}-resumed"
        jobs.append((out[f"{mode} resumed"], resume_overrides(nproc, next_mode), out[mode], 3))
    (root / "ranks2").mkdir()
    run_ranks(train_runs, 2, root / "ranks2", jobs, timeout=400)
    out["fsdp resumed"] = root / "fsdp-resumed"  # FSDP 2 -> 1: in this process
    continue_in_copy(out["fsdp"], 3, out["fsdp resumed"], resume_overrides(*LAYOUTS["fsdp"]))
    # Gradients summed over 2 ranks instead of averaged are twice too large; with SGD that is the
    # same run as one process at twice the learning rate.
    out["doubled lr"] = root / "doubled"
    train(load_config(None, common(text_file, **{"train.batch_size": GLOBAL_BATCH, "optim.lr": 0.2})), out["doubled lr"])
    train(load_config(None, common(text_file, **{"train.batch_size": 2 * GLOBAL_BATCH})), out["batch8"])
    return out


def assert_resumed(reference, run):
    """The copy's last run row resumed at step 3, and the rows it wrote (after that row) match."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, r in enumerate(rows) if r["kind"] == "run")
    assert rows[last]["resumed_from"] == 3
    got = {r["step"]: r["loss"] for r in rows[last:] if r["kind"] == "train"}
    assert sorted(got) == list(range(4, STEPS + 1))
    assert_same_losses(reference, got, range(4, STEPS + 1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_two_ranks_match_one_process_and_resume_in_another_layout(text_file, reference, mode, request):
    # ddp: the session's shared torchrun run (conftest), which ddp does not resume
    run = request.getfixturevalue("ddp2_torchrun_run") if mode == "ddp" else request.getfixturevalue("runs")[mode]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    run_row = next(r for r in rows if r["kind"] == "run")
    assert (run_row["dp_mode"], run_row["world_size"]) == (mode, 2)
    assert all("memory_mb_min" in r for r in rows if r["kind"] == "train")
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))
    if LAYOUTS[mode]:
        assert_resumed(reference, request.getfixturevalue("runs")[f"{mode} resumed"])


@pytest.mark.timeout(600)
def test_hsdp_on_four_ranks_matches_and_reshards_to_fsdp_on_two(runs, reference):
    run = runs["hsdp"]
    run_row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert (run_row["dp_mode"], run_row["dp_replicate"], run_row["dp_shard"]) == ("fsdp", 2, 2)
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))
    assert_resumed(reference, runs["hsdp resumed"])


@pytest.mark.timeout(600)
def test_grad_accum_reduces_across_replicas_once_a_step_and_matches_one_process(runs, reference):
    # DDP (no_sync on all but the last micro-batch) and HSDP (reduce-scatter every micro-batch,
    # the all-reduce across replicas in the last: data_parallel.sync_on_last_micro_batch) give the
    # losses of one process on the same global batch; tests/plan/test_collective_counts.py counts
    # the collectives (one all-reduce per step and bucket or unit).
    assert_same_losses(reference, losses(runs["ddp accum2"]), range(1, STEPS + 1))
    assert_same_losses(losses(runs["batch8"]), losses(runs["hsdp accum2"]), range(1, STEPS + 1))


def test_tolerance_catches_wrong_gradient_scaling(runs, reference):
    with pytest.raises(AssertionError):
        assert_same_losses(reference, losses(runs["doubled lr"]), range(1, STEPS + 1))


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
    # The launcher stops the other ranks once one has failed (SIGTERM after its next poll, 0.1 s
    # apart by default): on the one-GPU machine rank 1 failed first and rank 0 was stopped before
    # its line. Polling every 2 s leaves each rank the time to fail on its own.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--monitor-interval", "2", "-m", "kiln.cli", "train", "--run-dir", str(tmp_path / "run"),
                        *sets(common(text_file, **{"train.device": "'cuda:0'"}))],
                       capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    assert p.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] kiln train: error: train.device='cuda:0'" in p.stderr, p.stderr[-2000:]
