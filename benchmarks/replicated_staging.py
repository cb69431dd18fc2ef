"""What an asynchronous checkpoint save holds in each rank's host memory, and how long it holds the
loop, when the training state is replicated over ranks: kiln's staging of only the tensors the rank
writes (kiln/checkpoint/staging.py `owned_state`: DCP's own write assignment, taken before the copy)
against staging the rank's whole state (DCP's stager, and kiln before).

N gloo processes build kiln's transformer with the trainer's AdamW (foreach), identical on every
rank, take one step on the same batch, then save model + optimizer through kiln's
CheckpointManager (async), alternating the two ways for --rounds rounds after one untimed save each
(each way keeps its own reused buffers, as the trainer's manager does). Layouts: ddp (parameters and
optimizer state replicated on every rank) and zero1 (parameters replicated, each rank its share of
the state: kiln's Zero1Optimizer). Per rank and save:

- staged bytes: the host copy the save wrote from (the largest rank's);
- held s: the time the save call held the loop (staging copy, and for kiln the plan exchange);
  slowest rank, median over rounds;
- total s: held plus the background write until the save finished (slowest rank, median).

Each way's checkpoint is then loaded into a fresh model and optimizer on every rank, which must get
back the saved state bit for bit (the benchmark fails otherwise).

    python benchmarks/replicated_staging.py [--worlds 2,4] [--modes ddp,zero1] [--rounds 3]

Writes benchmarks/results/replicated_staging.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln (also in the spawned ranks)
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import paired_cells, print_table, run_ranks, stepped_transformer, write_sized_results  # noqa: E402
from rank_measures import state_bytes  # noqa: E402

WAYS = ("owned", "whole")


def _rank(rank: int, world: int, port: int, args, mode: str, root: str, out) -> None:
    from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState

    build, model, optimizer = stepped_transformer(rank, world, port, args, zero1=mode == "zero1")
    managers = {way: CheckpointManager(Path(root) / way, keep_last=1, is_main=rank == 0, async_save=True)
                for way in WAYS}
    managers["whole"]._staging.group = None  # stage the whole state (kiln before; DCP's stager)
    states = {"app": ModelOptimizerState(model, optimizer)}
    rows = []
    for round_ in range(-1, args.rounds):  # round -1: the untimed first save of each (allocates the buffers)
        for way in WAYS:
            dist.barrier()
            t0 = time.perf_counter()
            managers[way].save(round_ + 2, states)
            held = time.perf_counter() - t0
            results = managers[way].wait()
            total = time.perf_counter() - t0
            assert results and all(r.ok for r in results), [r.error for r in results]
            if round_ >= 0:
                rows.append({"way": way, "round": round_, "held_s": held, "total_s": total,
                             "staged_bytes": managers[way]._staging.nbytes})
    same = True
    for way in WAYS:
        fresh_model, fresh = build()
        fresh_states = {"app": ModelOptimizerState(fresh_model, fresh)}
        managers[way].load(fresh_states)
        saved, loaded = states["app"].state_dict(), fresh_states["app"].state_dict()
        same = same and _equal(saved, loaded)
    for m in managers.values():
        m.close()
    out.put({"rank": rank, "rows": rows, "loaded_exactly": same, "state_bytes": state_bytes(states["app"].state_dict())})
    dist.barrier()
    dist.destroy_process_group()


def _equal(a, b) -> bool:
    from kiln.parallel.zero1_shards import is_sharded, local_tensors

    if is_sharded(a):
        return is_sharded(b) and all(torch.equal(x, y) for x, y in zip(local_tensors(a), local_tensors(b)))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def measure(world: int, mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as root:
        # the rank's code by this file's module name, which the spawned ranks import from benchmarks/
        target = importlib.import_module(Path(__file__).stem)._rank
        results = run_ranks(target, world, (args, mode, root), "replicated_staging")
    if not all(r["loaded_exactly"] for r in results):
        raise SystemExit("replicated_staging: a checkpoint did not load back exactly")
    summary = {"world": world, "mode": mode, "state_bytes": max(r["state_bytes"] for r in results)}
    for way in WAYS:
        rows = [row for r in results for row in r["rows"] if row["way"] == way]
        summary[way] = {"staged_bytes": max(row["staged_bytes"] for row in rows)}
        for key in ("held_s", "total_s"):
            per_round = [max(row[key] for row in rows if row["round"] == k) for k in range(args.rounds)]
            summary[way].update({key: statistics.median(per_round), f"{key}_rounds": per_round})
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--modes", default="ddp,zero1")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="replicated_staging")
    args = ap.parse_args(argv)
    summaries = [measure(int(w), mode, args) for mode in args.modes.split(",") for w in args.worlds.split(",")]
    mb = 1 / 2**20
    fields = (("staged_bytes", mb, 1), ("held_s", 1, 3), ("total_s", 1, 3))
    table = [[s["mode"], s["world"], round(s["state_bytes"] * mb, 1)] + paired_cells(s["owned"], s["whole"], fields)
             for s in summaries]
    print_table(["layout", "ranks", "state MiB per rank", "staged MiB", "held s", "total s"], table)
    print("(each cell: kiln's owned staging / the whole state; the largest rank's bytes, the slowest rank's seconds)")
    write_sized_results("replicated_staging.py", argv, args, results=summaries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
