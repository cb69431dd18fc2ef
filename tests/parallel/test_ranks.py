"""The launcher cleanup the multi-process tests rely on: a worker that its launcher started in a
session of its own (as torchrun's SubprocessHandler does) dies with the launcher."""

import os
import subprocess
import sys
import time

from ranks import kill_launcher, tag_env

LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_launcher_kills_workers_in_their_own_session():
    env, tag = tag_env(dict(os.environ))
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    worker = int(p.stdout.readline())
    try:
        assert alive(worker)
        kill_launcher(p)  # the process group alone: the worker is in another session
        assert alive(worker), "the worker was in the launcher's process group after all"
        kill_launcher(p, tag)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        kill_launcher(p, tag)
        p.stdout.close()
