"""In-memory replicas: a restart takes its state from host memory (own or the peer rank's copy)
when it is as new as storage, with the same result as loading from storage."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.train.trainer import train

from ckpt_testlib import RUN, rows
from conftest import require_fsdp2_on_cpu, tiny_overrides


def _events(run, text):
    return [r["message"] for r in rows(run, "event") if text in r["message"]]


def test_single_process_resume_from_own_memory(tmp_path, text_file):
    extra = {**RUN, "train.steps": 8, "checkpoint.every": 4, "checkpoint.memory_replicas": "true",
             "checkpoint.replica_dir": repr(str(tmp_path / "shm"))}
    straight = tmp_path / "straight"
    train(load_config(None, tiny_overrides(text_file, **extra)), straight)
    paused = tmp_path / "paused"
    train(load_config(None, tiny_overrides(text_file, **extra)), paused, stop_at=4)
    train(load_config(paused / "config.toml"), paused, resume=True)
    assert _events(paused, "resumed step 4 from own memory")
    a = {r["step"]: r["loss"] for r in rows(straight, "train")}
    b = {r["step"]: r["loss"] for r in rows(paused, "train")}
    assert a == b
    assert not list((tmp_path / "shm").glob("*/*.pt"))  # a finished run frees its host memory
    # A corrupted replica falls back to storage.
    again = tmp_path / "again"
    train(load_config(None, tiny_overrides(text_file, **extra)), again, stop_at=4)
    [replica] = [f for f in (tmp_path / "shm").glob("*/own-0.pt") if f.stat().st_size]
    replica.write_bytes(b"garbage")
    train(load_config(again / "config.toml"), again, resume=True)
    assert _events(again, "resumed step 4 from storage")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _rank_pids(parent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of torchrun's worker processes."""
    out = {}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text().split()
            env = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[3]) == parent:
            for item in env:
                if item.startswith(b"LOCAL_RANK="):
                    out[int(item.split(b"=")[1])] = int(child.name)
    return out


@pytest.mark.timeout(300)
def test_torchrun_restart_recovers_from_peer_memory(tmp_path, text_file):
    """FSDP on 2 gloo ranks under torchrun --max-restarts 1: rank 1 is killed (and its host copy
    lost) after the step-8 replica; torchrun's elastic agent restarts both workers, which take rank
    1's state from rank 0's peer copy and finish with the losses of an uninterrupted run."""
    require_fsdp2_on_cpu()  # torch 2.6: the workers would stop at kiln's one-line refusal
    shm = tmp_path / "shm"
    run = tmp_path / "run"
    overrides = tiny_overrides(text_file, **{
        "train.steps": 16, "checkpoint.every": 4, "train.eval_every": 0, "metrics.progress": "'none'",
        "checkpoint.memory_replicas": "true", "checkpoint.replica_dir": repr(str(shm)),
        "metrics.peak_flops": 1e12, "train.device": "'cpu'"})  # 2 gloo ranks, also where a GPU is

    def torchrun(run_dir, restarts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"localhost:{_free_port()}", "-m", "kiln.cli", "train", "--run-dir", str(run_dir)]
        for o in overrides:
            cmd += ["--set", o]
        log = open(tmp_path / f"{run_dir.name}.log", "w")
        # Its own process group, so a failed test ends the agent and its workers together.
        return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True), log

    def end(agent, log):
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()

    agent, log = torchrun(run, restarts=1)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and agent.poll() is None:
            held = list(shm.glob("*/peer-of-1.json"))
            if held and '"step": 8' in held[0].read_text():
                break
            time.sleep(0.02)
        pids = _rank_pids(agent.pid)
        assert set(pids) == {0, 1}, "workers not found"
        os.kill(pids[1], signal.SIGKILL)
        for f in shm.glob("*/own-1.*"):  # rank 1's host memory is gone with it
            f.unlink()
        rc = agent.wait(timeout=150)
    finally:
        end(agent, log)
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    recovered = _events(run, "from peer memory for rank(s) 1")
    assert len(recovered) == 1 and int(recovered[0].split()[2]) >= 8, recovered
    straight, log = torchrun(tmp_path / "straight", restarts=0)
    try:
        assert straight.wait(timeout=120) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    finally:
        end(straight, log)
    expected = {r["step"]: r["loss"] for r in rows(tmp_path / "straight", "train")}
    got = {r["step"]: r["loss"] for r in rows(run, "train")}  # the restart re-logs steps after step 8
    assert sorted(got) == sorted(expected) and max(expected) == 16
    assert got == expected


def test_replica_dir_must_be_private(tmp_path):
    """tmpfs is shared by all local users: a replica directory others can write is ignored."""
    import torch

    from kiln.checkpoint.replica import MemoryReplicas

    replicas = MemoryReplicas(tmp_path / "run", tmp_path / "shm", rank=0, world=1)
    state = {"w": torch.arange(4.0)}
    replicas.publish(3, state)
    assert replicas._step_of("own-0") == 3
    replicas.dir.chmod(0o777)
    assert replicas._step_of("own-0") == -1 and replicas._read("own-0") is None
    assert replicas.restore({"w": torch.zeros(4)}, storage_step=None) is None
