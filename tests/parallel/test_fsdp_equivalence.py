"""Data parallel (FSDP2 on gloo, 2 processes) == one process, and checkpoints reshard across them."""

import json
import os
import subprocess
import sys

import pytest

from conftest import tiny_overrides


def run_kiln(args, nproc=1, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(29500 + os.getpid() % 1000), "-m", "kiln.cli"]
    else:
        cmd = [sys.executable, "-m", "kiln.cli"]
    p = subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


@pytest.mark.timeout(600)
def test_fsdp_matches_single_process_and_reshards(tmp_path, text_file):
    common = tiny_overrides(text_file, **{"train.steps": 8, "train.eval_every": 0, "checkpoint.every": 4,
                                          "checkpoint.keep_last": 5})
    single = tmp_path / "single"
    run_kiln(["train", "--run-dir", str(single), *sets(common + ["train.batch_size=4"])])
    fsdp = tmp_path / "fsdp"
    run_kiln(["train", "--run-dir", str(fsdp), *sets(common + ["train.batch_size=2"]), "--stop-at", "4"], nproc=2)
    a, b = losses(single), losses(fsdp)
    assert sorted(b) == [1, 2, 3, 4]
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    # The 2-rank sharded checkpoint resumes in one process (DCP reshards; the loader's global
    # position continues on the same samples), and the curve continues as the single run's.
    cfg = fsdp / "config.toml"
    run_kiln(["train", str(cfg), "--run-dir", str(fsdp), "--set", "train.batch_size=4", "--resume", str(fsdp)])
    b = losses(fsdp)
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
