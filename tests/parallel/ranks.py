"""Run a function on N gloo ranks in fresh processes and collect what each returns.

For tests of collectives on tiny models (no torchrun, no kiln CLI): `run_ranks(fn, n, tmp_path,
*args)` spawns n processes, each joins a gloo group through a file store in tmp_path, calls
fn(rank, n, *args), and pickles the result; a rank that fails or runs past `timeout` seconds
fails the test instead of hanging it (every process is killed).

For launcher tests (torchrun, the Slurm script): `tag_env(env)` marks every process started with
that environment, and `kill_launcher(p, tag)` kills the launcher's process group and then every
process still carrying the tag. torchrun starts each worker in a session of its own (torch's
SubprocessHandler), so a process-group kill alone leaves the workers running once their agent is gone.

Ranks start from a forkserver that has imported torch, torch.distributed and kiln's trainer once
per test session (`multiprocessing.set_forkserver_preload`): a rank forks from it instead of a fresh
interpreter importing them again (seconds per rank on a loaded 2-core machine, ~50 launches in the
suite). What spawn gave a rank is passed on: the parent's environment at the launch (set before fn and
its module are unpickled), sys.path and the working directory (multiprocessing's preparation data).

For a deliberate mistake in one job of a shared launch: `undo = patch_for_one_run(owner, name, value)`
sets owner.name and returns the function that puts the original back.

For several kiln runs in one launch instead of a `kiln train` launch each: `run_ranks(train_runs, n,
tmp, jobs)` runs kiln's trainer once per job on every rank, and `continue_in_copy(source, step, run,
overrides)` continues a run's step-`step` checkpoint in a copy of its run directory (also in one process).
"""

import os
import pickle
import signal
import subprocess
import time
import traceback
import uuid
from pathlib import Path

import multiprocessing

import torch.multiprocessing as mp

# imported once in the forkserver, before any rank forks (no threads started by importing them)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "kiln.train.trainer"]


def _worker(rank, n, store, out_dir, env, payload):
    # the launch's environment before fn's module is imported (the forkserver's is the session's first)
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    fn, args = pickle.loads(payload)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    try:
        result = fn(rank, n, *args)
        error = None
    except BaseException:  # noqa: BLE001 - reported to the parent as text
        result, error = None, traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump((result, error), f)
    os.replace(path + ".part", path)  # whole, or not there (the parent reads it once every rank's is)
    dist.destroy_process_group()


def run_ranks(fn, n, tmp_path, *args, timeout=120):
    out_dir = tmp_path / "ranks"
    out_dir.mkdir(exist_ok=True)
    for old in out_dir.glob("rank*.pkl"):  # an earlier launch's in the same directory
        old.unlink()
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver first starts
    payload = pickle.dumps((fn, args))
    ctx = mp.start_processes(_worker, args=(n, str(tmp_path / "store"), str(out_dir), dict(os.environ), payload),
                             nprocs=n, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    written = None  # when every rank's result was there
    def all_written() -> bool:
        return all((out_dir / f"rank{r}.pkl").exists() for r in range(n))

    try:
        while True:
            try:
                # grace_period: when one rank dies, the others get 10 s to finish on their own before
                # torch terminates them (a rank aborting in teardown must not cut off another's result)
                if ctx.join(timeout=1, grace_period=10):
                    break
            except mp.ProcessExitedException:
                # gloo's teardown can abort a process after its work is done ("terminate called
                # without an active exception", about 1 in 20 launches here): every result written
                # is a finished launch; a rank dying before writing its result is a failure
                if all_written():
                    break
                raise
            # torch 2.6's gloo sometimes never returns from destroy_process_group (seen in about 1 of
            # 5 2-rank launches): once every rank has written its result, the stragglers are killed
            if written is None and all_written():
                written = time.monotonic()
            if written is not None and time.monotonic() - written > 10:
                break
            assert time.monotonic() < deadline, f"ranks still running after {timeout} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(n):
        result, error = pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes())
        skip_where_this_torch_cannot(error)
        assert error is None, f"rank {rank} failed:\n{error}"
        results.append(result)
    return results


# What kiln refuses on an older torch, by the signs of the refusal (or of torch's own failure) in a
# rank's error: (signs, the kiln/torch_compat.py probe that says this torch can (called with the
# keywords given), what is skipped). The first entry whose signs match decides.
OLDER_TORCH_REFUSALS = [
    # 2.6: FSDP2 records events on a CPU stream, which has none (kiln's refusal, or a test's own fully_shard)
    (("on CPU needs a torch whose FSDP2 runs there", "'Stream' object has no attribute 'record_event'"),
     ("fsdp_runs_on_cpu", {}), "FSDP2 does not run on CPU"),
    # 2.7: gloo sums FSDP2's averages; FSDP2 is made to sum and divide, but not HSDP (kiln's refusal)
    (("cannot be told to sum instead over dp_replicate",), ("fsdp_can_force_sum", {"hsdp": True}),
     "HSDP cannot average over gloo"),
    (("this FSDP2 cannot be told to sum instead",), ("fsdp_can_force_sum", {}), "FSDP2 cannot average over gloo"),
    # 2.7: FSDP2 cannot shard a tp shard whose first dimension does not split over its ranks
    (("this FSDP2 cannot shard a tensor parallel shard unevenly",), ("fsdp_shards_tp_unevenly", {}),
     "FSDP2 cannot shard tensor parallel shards unevenly"),
    # before 2.9: FSDP2 cannot shard experts already split over ep and tp (2-D DTensors)
    (("which this torch's FSDP2 cannot shard again",), ("fsdp_shards_2d_dtensors", {}),
     "FSDP2 cannot shard experts split over ep and tp"),
]


def skip_where_this_torch_cannot(error: str | None) -> None:
    """Skip the test where a rank's error is one of OLDER_TORCH_REFUSALS and this torch cannot do
    it, so an older torch reports what it cannot test rather than failing; on a torch that can,
    the same error is a failure like any other."""
    import pytest

    from kiln import torch_compat

    for signs, (probe, keywords), what in OLDER_TORCH_REFUSALS:
        if error and any(sign in error for sign in signs):
            if not getattr(torch_compat, probe)(**keywords):
                import torch

                pytest.skip(f"{what} under torch {torch.__version__} (kiln refuses it there)")
            return


def patch_for_one_run(owner, name: str, replacement):
    """Set `owner.name = replacement` (a module function or a class attribute swapped for a
    deliberate mistake while one job runs) and return the undo. A class's own attribute is restored
    as it was stored (a staticmethod stays one); one it inherited is removed again."""
    own = vars(owner) if isinstance(owner, type) else None
    had_own = own is None or name in own
    saved = getattr(owner, name) if own is None else own.get(name)
    setattr(owner, name, replacement)

    def undo():
        if had_own:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)

    return undo


def continue_in_copy(source, step: int, run, overrides: list[str]):
    """Copy run directory `source` to `run` without its checkpoints after `step` and train on from
    there as `kiln train <run>/config.toml --resume --set <overrides>` does. In a launch, call it
    on every rank (rank 0 copies)."""
    import shutil

    import torch.distributed as dist

    from kiln.config import load_config
    from kiln.train.trainer import train

    def later_checkpoints(folder, names):
        return [x for x in names if x.startswith("step-") and x[5:].isdigit() and int(x[5:]) > step]

    distributed = dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        shutil.copytree(source, run, ignore=later_checkpoints)
    if distributed:
        dist.barrier()
    train(load_config(Path(run) / "config.toml", overrides), run, resume=True)
    if distributed:
        dist.barrier()


def train_runs(rank, world, jobs):
    """For run_ranks: kiln's trainer once per job on every rank, as under torchrun. A job is (run,
    overrides) for a fresh run, or (run, overrides, source, step) to continue_in_copy."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    for run, overrides, *source in jobs:
        if source:
            continue_in_copy(source[0], source[1], run, overrides)
        else:
            train(load_config(None, overrides), run)


def tag_env(env: dict) -> tuple[dict, str]:
    """A copy of env whose processes (and their children, which inherit it) kill_tagged can find."""
    tag = uuid.uuid4().hex
    return {**env, "TEST_JOB_TAG": tag}, tag


def kill_tagged(tag: str) -> None:
    """SIGKILL every process started with TEST_JOB_TAG=tag in its environment, until none is left."""
    needle = f"TEST_JOB_TAG={tag}".encode()
    for _ in range(10):
        found = False
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
                    found = True
            except (OSError, ProcessLookupError):  # gone meanwhile, or not ours
                pass
        if not found:
            return
        time.sleep(0.2)


def kill_launcher(p: subprocess.Popen, tag: str | None = None) -> None:
    """Nothing outlives a test: a launcher still running (or failed) is killed with its whole process
    group (start it with start_new_session=True), then every process carrying `tag` (tag_env)."""
    if p.poll() is None or p.returncode != 0:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    if tag is not None:
        kill_tagged(tag)
