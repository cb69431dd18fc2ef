"""What a ZeRO-1 checkpoint save costs each rank: kiln's (each rank saves the boxes of the state it
steps, kiln/parallel/zero1_shards.py) against the consolidation torch's ZeroRedundancyOptimizer
offers (`consolidate_state_dict(to=r)` for every rank r in turn, each then handing DCP the whole
state, which DCP writes once: how kiln saved before).

N gloo processes build kiln's transformer (the trainer's param groups), wrap its AdamW in kiln's
`Zero1Optimizer`, take one step on the same batch (the state exists), then save through DCP,
alternating the two ways for --rounds rounds. Per rank and save:

- state bytes: the optimizer state tensors in the dict handed to DCP (kiln: local boxes only);
- peak bytes: the most tensor bytes allocated at once during the save, above its start (torch's
  profiler memory events, benchmarks/rank_measures.py `profiled_peak_bytes`): consolidation's
  broadcast buffers and copies of the other ranks' state;
- file bytes: the rank's own DCP data file;
- sent bytes: bytes the process wrote during the save (/proc/self/io wchar) less its file's;
- save s: wall time of the save (slowest rank; median over rounds).

Then each rank loads, both ways alternating for --rounds rounds, into a fresh ZeRO-1 optimizer:
kiln's (a template of this rank's boxes) and torch's (the whole consolidated state read on every
rank, ZeroRedundancyOptimizer.load_state_dict keeping its partition); per rank the bytes read
(/proc/self/io rchar), the peak tensor bytes and the time; each load must give back this rank's
state bit for bit (the benchmark fails otherwise).

    python benchmarks/zero1_checkpoint.py [--worlds 2,4] [--dim 384 --layers 6 --heads 6 --vocab 4096] [--rounds 3]

Writes benchmarks/results/zero1_checkpoint.json and prints a markdown table.
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
from rank_measures import profiled_peak_bytes, read_bytes, sent_bytes, state_bytes  # noqa: E402


def _consolidated_state(zero) -> dict:
    """The whole dense state on this rank (state and param groups, keyed by ZeRO's positions), as
    torch's ZeroRedundancyOptimizer consolidates it (every rank in turn: each must call for every
    destination)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    full = None
    for r in range(dist.get_world_size()):
        zero.dense.consolidate_state_dict(to=r)
        if r == dist.get_rank():
            full = ZeroRedundancyOptimizer.state_dict(zero.dense)  # torch's: the consolidated state
    return full


def _file_bytes(path: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in path.glob(f"__{rank}_*.distcp"))


def _rank(rank: int, world: int, port: int, args, root: str, out) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    build, model, zero = stepped_transformer(rank, world, port, args, zero1=True)
    rows = []
    for round_ in range(args.rounds):
        for way in ("kiln", "consolidated"):
            path = Path(root) / f"{way}-{round_}"
            dist.barrier()
            wchar = sent_bytes()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                t0 = time.perf_counter()
                if way == "kiln":
                    optim = get_state_dict(model, zero)[1]["state"]
                else:
                    optim = _consolidated_state(zero)["state"]
                dcp.save({"optim": optim}, checkpoint_id=str(path))
                seconds = time.perf_counter() - t0
            files = _file_bytes(path, rank)
            rows.append({"way": way, "round": round_, "rank": rank, "save_s": seconds,
                         "state_bytes": state_bytes(optim), "peak_bytes": profiled_peak_bytes(prof),
                         "file_bytes": files, "sent_bytes": sent_bytes() - wchar - files})
            del optim
    # Loading, both ways, into a fresh ZeRO-1 whose state then must be this rank's, bit for bit:
    # kiln's template asks DCP for this rank's boxes; torch's way reads the whole consolidated
    # state on every rank and keeps its partition (ZeroRedundancyOptimizer.load_state_dict).
    same = True
    for round_ in range(args.rounds):
        for way in ("kiln", "consolidated"):
            fresh_model, fresh = build()
            fresh_model.load_state_dict(model.state_dict())
            get_state_dict(fresh_model, fresh)  # DCP's zero-gradient step: the state exists (untimed)
            dist.barrier()
            read = read_bytes()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                t0 = time.perf_counter()
                if way == "kiln":
                    template = get_state_dict(fresh_model, fresh)[1]
                    dcp.load({"optim": template["state"]}, checkpoint_id=str(Path(root) / f"kiln-{round_}"))
                    set_state_dict(fresh_model, fresh, model_state_dict=fresh_model.state_dict(), optim_state_dict=template)
                else:
                    template = _consolidated_state(fresh)
                    dcp.load({"optim": template["state"]}, checkpoint_id=str(Path(root) / f"consolidated-{round_}"))
                    fresh.dense.load_state_dict(template)  # torch's ZeroRedundancyOptimizer.load_state_dict
                seconds = time.perf_counter() - t0
            rows.append({"way": way, "round": round_, "rank": rank, "load_s": seconds,
                         "load_peak_bytes": profiled_peak_bytes(prof), "read_bytes": read_bytes() - read})
            pieces = [[p for g in opt.dense.optim.param_groups for p in g["params"]] for opt in (zero, fresh)]
            same = same and all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for p, q in zip(*pieces)
                                for a, b in zip(zero.dense.optim.state[p].values(), fresh.dense.optim.state[q].values()))
            del template
    full_bytes = sum(p.numel() for p in model.parameters()) * 4 * 2  # AdamW's two fp32 moments
    out.put({"rank": rank, "rows": rows, "loaded_exactly": same, "full_state_bytes": full_bytes})
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args) -> dict:
    with tempfile.TemporaryDirectory() as root:
        # the rank's code by this file's module name, which the spawned ranks import from benchmarks/
        # on their sys.path (as a script this is __main__; the smoke test loads it under another name)
        target = importlib.import_module(Path(__file__).stem)._rank
        results = run_ranks(target, world, (args, root), "zero1_checkpoint")
    if not all(r["loaded_exactly"] for r in results):
        raise SystemExit("zero1_checkpoint: a checkpoint did not load back exactly")
    summary = {"world": world, "full_state_bytes": results[0]["full_state_bytes"]}
    for way in ("kiln", "consolidated"):
        saves = [row for r in results for row in r["rows"] if row["way"] == way and "save_s" in row]
        loads = [row for r in results for row in r["rows"] if row["way"] == way and "load_s" in row]
        summary[way] = {"file_bytes_all_ranks": sum(row["file_bytes"] for row in saves if row["round"] == 0)}
        for rows, seconds, sizes in ((saves, "save_s", ("state_bytes", "peak_bytes", "file_bytes", "sent_bytes")),
                                     (loads, "load_s", ("load_peak_bytes", "read_bytes"))):
            per_round = [max(row[seconds] for row in rows if row["round"] == k) for k in range(args.rounds)]
            summary[way].update({seconds: statistics.median(per_round), f"{seconds}_rounds": per_round,
                                 **{k: max(row[k] for row in rows) for k in sizes}})
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="zero1_checkpoint")
    args = ap.parse_args(argv)
    summaries = [measure(int(w), args) for w in args.worlds.split(",")]
    mb = 1 / 2**20
    fields = (("state_bytes", mb, 1), ("peak_bytes", mb, 1), ("sent_bytes", mb, 1), ("save_s", 1, 3),
              ("read_bytes", mb, 1), ("load_peak_bytes", mb, 1), ("load_s", 1, 3))
    table = [[s["world"], round(s["full_state_bytes"] * mb, 1)] + paired_cells(s["kiln"], s["consolidated"], fields)
             for s in summaries]
    print_table(["ranks", "state MiB", "save: held", "peak", "sent MiB", "s", "load: read MiB", "peak", "s"], table)
    print("(each cell: kiln / consolidated, per rank: the largest rank's bytes, the slowest rank's seconds)")
    write_sized_results("zero1_checkpoint.py", argv, args, worlds=summaries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
