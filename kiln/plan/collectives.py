"""Timed collectives for calibrating a cluster's links (`kiln plan --time-collectives N` or
`--collectives FILE.json`), fitted by kiln/plan/calibrate.py `fit_link`.

`time_collectives` spawns `ranks` processes on this machine (torch.multiprocessing, a file store
in a temporary directory; gloo on CPU, NCCL with one GPU per process), and times torch's own
all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast at each size, plus a
tensor copy on every rank at once (the memory bandwidth FSDP2's buffer copies and the optimizer
step run at): the median of `reps` calls after a warm-up, each call started together (a barrier)
and the slowest rank's time kept, as a step waits for its slowest rank. Nothing here is a
hand-written collective. `read_collectives` reads such samples back from JSON (a list of
{"op", "ranks", "bytes", "seconds"}, or a dict holding one under "collectives", as
benchmarks/parallel_memory.py writes), checking every field.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from kiln.errors import KilnError
from kiln.plan.calibrate import CollectiveSample

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "copy")
DEFAULT_SIZES = (2**14, 2**18, 2**22, 2**24)  # bytes of the full (unsharded) tensor


def _worker(rank: int, ranks: int, backend: str, store: str, out_dir: str, sizes: tuple[int, ...],
            reps: int) -> None:
    import torch
    import torch.distributed as dist

    from kiln.torch_compat import all_gather_single, reduce_scatter_single

    error = None
    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ranks)
        rows = []
        for nbytes in sizes:
            full = torch.ones(nbytes // 4, device=device)
            shard = torch.ones(nbytes // 4 // ranks, device=device)
            target = torch.empty_like(full)
            calls = {"all_reduce": lambda: dist.all_reduce(full),
                     "all_gather": lambda: all_gather_single(full, shard),
                     "reduce_scatter": lambda: reduce_scatter_single(shard, full),
                     "broadcast": lambda: dist.broadcast(full, src=0),
                     "copy": lambda: target.copy_(full)}
            for op, call in calls.items():
                call()  # warm-up: connections and buffers
                times = []
                for _ in range(reps):
                    dist.barrier()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    call()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                rows.append({"op": op, "ranks": ranks, "bytes": nbytes, "seconds": statistics.median(times)})
        gathered = [None] * ranks
        dist.all_gather_object(gathered, rows)
        dist.destroy_process_group()
        result = [max((g[i] for g in gathered), key=lambda r: r["seconds"]) for i in range(len(rows))]
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line
        result, error = None, f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((result, error), f)


def time_collectives(ranks: int, backend: str = "gloo", sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 5,
                     timeout: float = 300.0) -> list[CollectiveSample]:
    """Timed collectives over `ranks` processes of this machine (see the module docstring)."""
    import torch
    import torch.multiprocessing as mp

    if ranks < 2:
        raise KilnError(f"timing collectives needs 2 or more processes, got {ranks}")
    if backend not in ("gloo", "nccl"):
        raise KilnError(f"collective backend {backend!r}: expected gloo or nccl")
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        raise KilnError(f"nccl over {ranks} processes needs {ranks} GPUs; this machine has "
                        f"{torch.cuda.device_count()} (use --collective-backend gloo)")
    if any(s < 4 * ranks or s % (4 * ranks) for s in sizes):
        raise KilnError(f"collective sizes {list(sizes)} must be multiples of 4 x {ranks} bytes")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(ranks, backend, os.path.join(tmp, "store"), tmp, tuple(sizes), reps),
                                 nprocs=ranks, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise KilnError(f"timing collectives over {ranks} {backend} processes took over {timeout:.0f} s")
        except mp.ProcessRaisedException as e:
            raise KilnError(f"timing collectives failed: {str(e).strip().splitlines()[-1]}") from None
        except mp.ProcessExitedException as e:
            raise KilnError(f"timing collectives: a process exited ({e})") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        result, error = pickle.loads(Path(tmp, "rank0.pkl").read_bytes())
    if error:
        raise KilnError(f"timing collectives over {ranks} {backend} processes failed: {error}")
    return [CollectiveSample(r["op"], r["ranks"], r["bytes"], r["seconds"]) for r in result]


def samples_json(samples: list[CollectiveSample]) -> str:
    return json.dumps([{"op": s.op, "ranks": s.ranks, "bytes": s.nbytes, "seconds": s.seconds} for s in samples],
                      indent=1) + "\n"


def read_collectives(path: str | Path) -> list[CollectiveSample]:
    """Timed collectives from a JSON file; a KilnError naming the file, entry and key otherwise."""
    from kiln.io import read_text_file

    path = Path(path)
    try:
        data = json.loads(read_text_file(path, error=KilnError, missing=f"collectives file {path} not found"))
    except json.JSONDecodeError as e:
        raise KilnError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):
        data = data.get("collectives")
    if not isinstance(data, list) or not data:
        raise KilnError(f"{path}: expected a non-empty list of timed collectives (or a dict with one under "
                        f"'collectives'), each {{\"op\", \"ranks\", \"bytes\", \"seconds\"}}")
    out = []
    for i, row in enumerate(data):
        where = f"{path}: collectives[{i}]"
        if not isinstance(row, dict):
            raise KilnError(f"{where}: expected a table with op, ranks, bytes, seconds")
        if row.get("op") not in OPS:
            raise KilnError(f"{where}: op {row.get('op')!r}: expected one of {', '.join(OPS)}")
        for key, low in (("ranks", 1), ("bytes", 1), ("seconds", 0)):
            v = row.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low or \
                    (key == "seconds" and v == 0):
                raise KilnError(f"{where}: {key} {v!r}: expected a {'positive ' if key == 'seconds' else ''}number"
                                f"{f' >= {low}' if key != 'seconds' else ''}")
        if row["op"] != "copy" and row["ranks"] < 2:
            raise KilnError(f"{where}: a {row['op']} over {row['ranks']} rank times no link; expected ranks >= 2")
        out.append(CollectiveSample(row["op"], int(row["ranks"]), float(row["bytes"]), float(row["seconds"])))
    return out
