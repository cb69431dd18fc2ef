"""Run a function on N gloo ranks in fresh processes and collect what each returns.

For tests of collectives on tiny models (no torchrun, no kiln CLI): `run_ranks(fn, n, tmp_path,
*args)` spawns n processes, each joins a gloo group through a file store in tmp_path, calls
fn(rank, n, *args), and pickles the result; a rank that fails or runs past `timeout` seconds
fails the test instead of hanging it (every process is killed).
"""

import os
import pickle
import traceback

import torch.multiprocessing as mp


def _worker(rank, n, store, out_dir, fn, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    try:
        result = fn(rank, n, *args)
        error = None
    except BaseException:  # noqa: BLE001 - reported to the parent as text
        result, error = None, traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((result, error), f)
    dist.destroy_process_group()


def run_ranks(fn, n, tmp_path, *args, timeout=120):
    out_dir = tmp_path / "ranks"
    out_dir.mkdir(exist_ok=True)
    ctx = mp.start_processes(_worker, args=(n, str(tmp_path / "store"), str(out_dir), fn, args), nprocs=n,
                             join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, f"ranks still running after {timeout} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(n):
        result, error = pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes())
        assert error is None, f"rank {rank} failed:\n{error}"
        results.append(result)
    return results
