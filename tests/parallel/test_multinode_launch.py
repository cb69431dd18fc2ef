"""MULTI-NODE LAUNCH ON ONE MACHINE: two `torchrun --nnodes=2 --nproc-per-node=1` agents meet
through a c10d rendezvous on 127.0.0.1 (the launch docs/parallel.md gives for several nodes and
for Slurm) and run `kiln train` as one 2-rank job; its losses are those of the single-node
`torchrun --standalone --nproc-per-node=2` run, and only rank 0 writes metrics. (With c10d the
rendezvous, not `--node-rank`, numbers the nodes - torchrun ignores that flag then - so the test
does not assume which agent got rank 0.)

What this does not show: two hosts (the network, a rendezvous host other than the caller, a run
directory on shared storage); both "nodes" are processes here, sharing /tmp. Slurm is not run.

Every launcher runs in its own process group, killed whole when the test fails or times out.
Tolerance: the same layout on the same machine, so equal to the last bit.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from ranks import kill_launcher, tag_env
from test_data_parallel import ddp2_args, losses

TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(args, port, logs, timeout=TIMEOUT):
    """Start both agents, wait for both; returns each one's (stdout, stderr). Output goes to files:
    a pipe nobody reads could fill and stall one agent, and with it the other."""
    env, tag = tag_env({**os.environ, "OMP_NUM_THREADS": "1"})
    procs, files = [], []
    try:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=kiln-test", "--max-restarts=0", "-m", "kiln.cli", *args]
            files.append((open(logs / f"agent{node}.out", "w+"), open(logs / f"agent{node}.err", "w+")))
            procs.append(subprocess.Popen(cmd, stdout=files[-1][0], stderr=files[-1][1], env=env,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        outputs = []
        for node, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
            assert p.returncode == 0, f"agent {node}:\n{outputs[-1][1][-3000:]}"
        return outputs
    finally:
        for p in procs:  # nothing outlives the test: each launcher with its workers
            kill_launcher(p, tag)
        for out, err in files:
            out.close()
            err.close()


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_two_nodes_through_c10d_rendezvous_match_one_node(tmp_path, text_file, ddp2_torchrun_run):
    args = ddp2_args(text_file)
    one_node = ddp2_torchrun_run  # the single-node torchrun run of the same arguments (conftest)
    two_nodes = tmp_path / "two-nodes"
    outputs = launch_two_nodes(["train", "--run-dir", str(two_nodes), *args], free_port(), tmp_path)

    expected, got = losses(one_node), losses(two_nodes)
    assert sorted(got) == list(range(1, 7)) and got == expected
    rows = [json.loads(x) for x in (two_nodes / "metrics.jsonl").read_text().splitlines()]
    run_row = next(r for r in rows if r["kind"] == "run")
    assert (run_row["world_size"], run_row["dp_mode"]) == (2, "ddp")
    # Rank 0 alone writes rows: one row per step (a second writer would double them) and one
    # metrics file; one agent's worker (rank 0) prints the summary.
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 7))
    assert [p.name for p in two_nodes.glob("metrics*")] == ["metrics.jsonl"]
    assert sorted("done: 6 steps" in out for out, _ in outputs) == [False, True]
