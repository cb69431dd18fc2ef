"""The launcher cleanup the multi-process tests rely on: a worker that its launcher started in a
session of its own (as torchrun's SubprocessHandler does) dies with the launcher; a rank's process
that aborts after writing its result (gloo's teardown) does not fail a finished launch."""

import os
import subprocess
import sys
import time

import pytest

from ranks import kill_launcher, patch_for_one_run, tag_env

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


class _Base:
    @staticmethod
    def backward(x):
        return x

    def inherited(self):
        return "base"


class _Child(_Base):
    pass


def test_patch_for_one_run_restores_module_attributes_and_a_class_as_it_was():
    undo = patch_for_one_run(os.path, "sep", "!")
    assert os.path.sep == "!"
    undo()
    assert os.path.sep == "/"
    undo = patch_for_one_run(_Base, "backward", staticmethod(lambda x: -x))
    assert _Base.backward(2) == -2
    undo()
    assert isinstance(vars(_Base)["backward"], staticmethod) and _Base.backward(2) == 2
    undo = patch_for_one_run(_Child, "inherited", lambda self: "child")
    assert _Child().inherited() == "child"
    undo()
    assert "inherited" not in vars(_Child) and _Child().inherited() == "base"


def _abort_at_exit(rank, n):
    """Rank 1's process aborts after its result is written, in destroy_process_group, as gloo's
    teardown sometimes does, while rank 0 is still working (its result comes 2 s later). First a
    barrier: gloo may still be connecting its pairs when init returns, and a peer aborting then
    aborts rank 0 too ("connectFullMesh failed ... Connection closed by peer", once in CI)."""
    import os
    import time

    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()
    else:
        time.sleep(2)
    return rank * 10


def _abort_before_result(rank, n):
    import os

    if rank == 1:
        os.abort()
    return rank


def test_a_teardown_abort_after_every_result_is_a_finished_launch(tmp_path):
    from ranks import run_ranks

    assert run_ranks(_abort_at_exit, 2, tmp_path, timeout=60) == [0, 10]
    (tmp_path / "again").mkdir()
    with pytest.raises(Exception, match="process 1 terminated"):  # no result: a failure
        run_ranks(_abort_before_result, 2, tmp_path / "again", timeout=60)
