"""examples/slurm/kiln.sbatch, run as sbatch would run it but without Slurm: bash executes the
script with the SLURM_* environment of a 2-node allocation and fake `srun` / `scontrol` on PATH.
The fake srun starts one copy of its command per node, locally, each with its SLURM_PROCID /
SLURM_NODEID, and (like --kill-on-bad-exit) kills the others when one fails; the fake scontrol
expands any node list to 127.0.0.1 and localhost. Each "node" gets one CPU worker
(KILN_NPROC_PER_NODE=1, --set train.device=cpu), so the job is the 2-rank run of
test_multinode_launch.py and must give the single-node 2-process losses to the last bit (same
layout, same machine) - also when the job is paused at step 3 and submitted again (resume).

What this does not show: Slurm itself (sbatch's header parsing, srun's CPU/GPU binding), two
hosts, a network, NCCL, or storage shared between machines. The header is only checked for the
lines sbatch reads and their consistency.

The script runs in its own process group, killed whole (fake srun, torchrun agents) when the
test fails or times out, and so is every process carrying the job's tag in its environment: the
workers, which torchrun starts in sessions of their own.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ranks import kill_launcher, kill_tagged
from test_data_parallel import ddp2_args, losses

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "kiln.sbatch"
TIMEOUT = 240

FAKE_SRUN = r"""#!/bin/bash
# fake srun: log the call, then one copy of the command per node, here
call=$(printf '%q ' "$@")
printf '%s\n' "$call" >>"$FAKE_SLURM_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
NODE_NAMES=(127.0.0.1 localhost)  # as the fake scontrol lists them
declare -A node
for ((i = 0; i < SLURM_NNODES; i++)); do
    cmd=("$@")
    if ((i > 0)) && [[ -n ${FAKE_SLURM_NODE_LOCAL:-} ]]; then
        # a node-local directory: the other nodes do not have it (their copies name a missing path)
        cmd=("${@//"$FAKE_SLURM_NODE_LOCAL"//missing-on-node$i}")
    fi
    SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURMD_NODENAME=${NODE_NAMES[i]} "${cmd[@]}" &
    node[$!]=$i
done
# Poll rather than `wait -n`: bash may drop a job that ended while the next one was starting
# from its job table, and `wait -n` then answers 127 with no pid; `wait PID` keeps its status.
while ((${#node[@]})); do
    for pid in "${!node[@]}"; do
        kill -0 "$pid" 2>/dev/null && continue
        wait "$pid"; rc=$?
        if ((rc != 0)); then
            echo "srun: error: task ${node[$pid]} exited with $rc; killing the others" >&2
            unset "node[$pid]"
            for p in "${!node[@]}"; do kill -TERM "$p" 2>/dev/null; done
            wait; exit "$rc"
        fi
        unset "node[$pid]"
    done
    sleep 0.05
done
"""

FAKE_SCONTROL = r"""#!/bin/bash
# fake scontrol: only `show hostnames LIST`, with LIST named
[[ $1 == show && $2 == hostnames && -n $3 ]] || { echo "fake scontrol: unexpected: $*" >&2; exit 1; }
echo 127.0.0.1
sleep 0.2  # like a long node list: still writing after a reader of the first line has left
echo localhost
"""


def fake_slurm(tmp_path, job_id, **env):
    """The environment of a 2-node sbatch job whose batch script runs on its first node."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    # Nothing from a real job around the test (the suite may itself run under Slurm).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SRUN_", "KILN_"))}
    return {**inherited, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_LOG": str(tmp_path / "srun.log"),
            "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "kiln", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1", "SLURMD_NODENAME": "127.0.0.1",
            "SLURM_SUBMIT_DIR": str(tmp_path), "KILN_PYTHON": sys.executable, "KILN_NPROC_PER_NODE": "1", **env}


def sbatch(args, env, logs, timeout=TIMEOUT):
    """Run the script as the batch step; returns (returncode, stdout, stderr)."""
    tag = uuid.uuid4().hex
    with open(logs / "job.out", "w+") as out, open(logs / "job.err", "w+") as err:
        p = subprocess.Popen(["bash", str(SCRIPT), *args], stdout=out, stderr=err, env={**env, "TEST_JOB_TAG": tag},
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            kill_launcher(p)  # the script, the fake srun's copies and the torchrun agents
            kill_tagged(tag)  # and the workers, each in its own session
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read()


def header(text):
    """The #SBATCH options sbatch reads: those before the first command line."""
    options = {}
    for line in text.splitlines()[1:]:
        if line.strip() and not line.lstrip().startswith("#"):
            break
        if m := re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line):
            options[m.group(1)] = m.group(2)
    return options


def test_script_parses_and_its_header_asks_for_one_task_per_node():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert text.startswith("#!/bin/bash\n")
    opts = header(text)
    # Every #SBATCH line is in the header (sbatch ignores any after the first command).
    assert len(opts) == len(re.findall(r"^#SBATCH", text, re.M))
    assert opts["ntasks-per-node"] == "1" and int(opts["nodes"]) >= 2
    assert "ntasks" not in opts or int(opts["ntasks"]) == int(opts["nodes"])
    assert int(opts["gpus-per-node"]) >= 1 and int(opts["cpus-per-task"]) >= 1
    # The body takes sizes from Slurm, not from the header it could drift from.
    body = text[text.index("set -euo pipefail"):]
    assert not re.search(r"--(nnodes|nproc-per-node)[= ]\d", body) and '--nnodes="$SLURM_NNODES"' in body
    assert '--rdzv-id="$SLURM_JOB_ID"' in body and "--rdzv-backend=c10d" in body


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_JOB_ID": ""}, "not inside a Slurm job"),
    ({"KILN_NPROC_PER_NODE": ""}, "workers per node unknown"),
    ({"SLURM_NTASKS": "4"}, "4 tasks on 2 nodes"),
    ({"SLURMD_NODENAME": "node2"}, "set KILN_RDZV_PORT to a port free on 127.0.0.1"),
    ({"KILN_RDZV_PORT": "http"}, "KILN_RDZV_PORT='http' is not a port number"),
    ({"KILN_RDZV_PORT": "08"}, "KILN_RDZV_PORT='08' is not a port number"),
    ({"KILN_RDZV_PORT": "65536"}, "KILN_RDZV_PORT='65536' is not a port number"),
    ({"SLURM_NNODES": "3", "SLURM_NTASKS": "3"}, "gave 2 hosts for SLURM_NNODES=3"),
])
def test_bad_settings_fail_before_any_step_in_one_line(tmp_path, env, expected):
    rc, _, err = sbatch([], fake_slurm(tmp_path, 7, **env), tmp_path, timeout=60)
    assert rc == 2 and err.startswith("kiln.sbatch: error:") and expected in err and err.count("\n") == 1
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [["--run-dir", "x"], ["--set", "train.steps=3", "--run-dir=x"],
                                  ["--resume", "runs/x"], ["--resume=runs/x"]])
def test_a_run_directory_in_the_arguments_is_refused(tmp_path, args):
    rc, _, err = sbatch(args, fake_slurm(tmp_path, 7), tmp_path, timeout=60)
    assert rc == 2 and "names a run directory: set KILN_RUN_DIR instead" in err and err.count("\n") == 1
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "runs").exists()


RECORDING_PYTHON = """#!/bin/bash
# stands in for the Python that runs torchrun: records each node's launch (the port probe still runs)
[[ $1 == -c ]] && exec "$REAL_PYTHON" "$@"
line=$(printf '%q ' "$SLURM_NODEID" "$OMP_NUM_THREADS" "$@")
printf '%s\n' "$line" >>"$FAKE_SLURM_LOG.launched"  # one write: the nodes append side by side
"""


@pytest.mark.parametrize("gpus, nproc, threads", [({"SLURM_GPUS_ON_NODE": "8"}, 8, 8),
                                                  ({"SLURM_GPUS_PER_NODE": "h100:4"}, 4, 16),
                                                  ({"KILN_NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}, 2, 32)])
def test_launch_line_per_node_from_the_slurm_environment(tmp_path, gpus, nproc, threads):
    """Without training: each node's torchrun command, from the GPUs Slurm reports, and the
    script's arguments (a bare --resume, a value with a space) reaching kiln unchanged."""
    python = tmp_path / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    run_dir = tmp_path / "shared" / "exp"
    env = fake_slurm(tmp_path, 9, KILN_PYTHON=str(python), REAL_PYTHON=sys.executable, SLURM_CPUS_PER_TASK="64",
                     KILN_RUN_DIR=str(run_dir), KILN_CONFIG="my.toml", **{"KILN_NPROC_PER_NODE": "", **gpus})
    env.pop("OMP_NUM_THREADS", None)
    args = ["--resume", "--set", "model.name='a b'", "--stop-at", "2"]
    rc, _, err = sbatch(args, env, tmp_path, timeout=60)
    assert rc == 0, err
    srun_calls = (tmp_path / "srun.log").read_text().splitlines()
    assert srun_calls[-1].startswith("--nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=64 ")
    launched = sorted((tmp_path / "srun.log.launched").read_text().splitlines())
    assert [line.split()[:2] for line in launched] == [["0", str(threads)], ["1", str(threads)]]
    port = re.search(r"rendezvous 127.0.0.1:(\d+)", err).group(1)
    for node, line in enumerate(launched):  # the first node (the rendezvous host) serves the store
        assert shlex.split(line)[2:] == [
            "-m", "torch.distributed.run", f"--rdzv-conf=is_host={int(node == 0)}",
            "--nnodes=2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=9", "--max-restarts=3",
            "-m", "kiln.cli", "train", "my.toml", "--run-dir", str(run_dir), *args]


def test_run_dir_every_node_cannot_see_fails_before_training(tmp_path):
    env = fake_slurm(tmp_path, 8, FAKE_SLURM_NODE_LOCAL=str(tmp_path / "runs"))
    rc, _, err = sbatch([], env, tmp_path, timeout=60)
    assert rc == 2, err
    assert "does not see /missing-on-node1/kiln/.kiln-sbatch-8: KILN_RUN_DIR must be on storage every node" in err
    assert len((tmp_path / "srun.log").read_text().splitlines()) == 1  # no training step
    assert not list((tmp_path / "runs" / "kiln").iterdir())  # the check leaves nothing behind


@pytest.mark.timeout(3 * TIMEOUT + 60)
def test_two_node_job_matches_one_node_and_resumes_when_submitted_again(tmp_path, text_file, ddp2_torchrun_run):
    args = ddp2_args(text_file)
    expected = losses(ddp2_torchrun_run)  # the single-node torchrun run of the same arguments (conftest)

    run_dir = tmp_path / "shared" / "exp"
    # The first job stops after step 3 (as a time limit would, after a checkpoint); the second,
    # another job id, continues it from that checkpoint with the same command.
    outs = []
    for job_id, extra in ((101, ["--stop-at", "3"]), (102, [])):
        env = fake_slurm(tmp_path, job_id, KILN_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
        rc, out, err = sbatch([*args, *extra], env, tmp_path)
        assert rc == 0, err[-3000:]
        outs.append(out)
        assert f"job {job_id}: 2 nodes x 1 workers, rendezvous 127.0.0.1:" in err
        launch = (tmp_path / "srun.log").read_text().splitlines()[-1]
        assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d" in launch and f"--rdzv-id={job_id}" in launch
    assert "paused at step 3" in outs[0] and "done: 6 steps" in outs[1]

    assert losses(run_dir) == expected and sorted(expected) == list(range(1, 7))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    runs = [r for r in rows if r["kind"] == "run"]
    assert [(r["world_size"], r["resumed_from"]) for r in runs] == [(2, None), (2, 3)]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # rank 0 alone writes
    assert not list(run_dir.glob(".kiln-sbatch-*"))
