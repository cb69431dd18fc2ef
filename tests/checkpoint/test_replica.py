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

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)


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
@pytest.mark.parametrize("dp_mode", ["fsdp", "zero1"])
def test_torchrun_restart_recovers_from_peer_memory(tmp_path, text_file, dp_mode):
    """FSDP or ZeRO-1 (each rank's replica holding its share of the optimizer state, as boxes of the
    parameters) on 2 gloo ranks under torchrun --max-restarts 1: rank 1 is killed (and its host
    copy lost) after the step-8 replica; torchrun's elastic agent restarts both workers, which
    take rank 1's state from rank 0's peer copy and finish with the losses of an uninterrupted run."""
    if dp_mode == "fsdp":
        require_fsdp2_on_cpu()  # torch 2.6: the workers would stop at kiln's one-line refusal
    shm = tmp_path / "shm"
    run = tmp_path / "run"
    overrides = tiny_overrides(text_file, **{
        "train.steps": 16, "checkpoint.every": 4, "train.eval_every": 0, "metrics.progress": "'none'",
        "checkpoint.memory_replicas": "true", "checkpoint.replica_dir": repr(str(shm)),
        "parallel.dp_mode": repr(dp_mode),
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


class GatheringState:
    """A Stateful whose state_dict is a collective, as DiLoCo's split outer state is (its ranks
    all-gather their slices): every rank must call it, or the others wait."""

    def __init__(self, rank: int):
        self.slice = torch.full((2,), float(rank))

    def state_dict(self) -> dict:
        import torch.distributed as dist

        whole = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(whole, self.slice)
        return {"whole": torch.cat(whole)}

    def load_state_dict(self, state: dict) -> None:
        import torch.distributed as dist

        self.slice.copy_(state["whole"].view(-1, 2)[dist.get_rank()])


def _restore_with_one_copy_damaged(rank, world, shm, damage):
    import torch.distributed as dist

    from kiln.checkpoint.replica import MemoryReplicas

    replicas = MemoryReplicas(Path(shm) / "run", shm, rank=rank, world=world)
    state = {"outer": GatheringState(rank)}
    replicas.publish(4, {"outer": state["outer"].state_dict()})
    dist.barrier()
    if damage and rank == 1:  # its own copy no longer matches its checksum (the step still reads 4)
        (replicas.dir / "own-1.pt").write_bytes(b"garbage")
    dist.barrier()
    state["outer"].slice.zero_()
    got = replicas.restore(state, storage_step=None)
    return got and got[:2], state["outer"].slice.tolist()


@pytest.mark.timeout(120)
def test_restore_calls_every_state_dict_on_every_rank(tmp_path):
    """A replica one rank cannot read must not leave the other alone inside a collective state_dict:
    both fall back to storage (None) together; undamaged, both restore their slice."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ok = run_ranks(_restore_with_one_copy_damaged, 2, tmp_path / "a", str(tmp_path / "shm-a"), False, timeout=60)
    assert ok == [((4, "own memory"), [0.0, 0.0]), ((4, "own memory"), [1.0, 1.0])]
    damaged = run_ranks(_restore_with_one_copy_damaged, 2, tmp_path / "b", str(tmp_path / "shm-b"), True,
                        timeout=60)
    assert damaged == [(None, [0.0, 0.0]), (None, [0.0, 0.0])]
