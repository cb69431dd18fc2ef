"""Per-rank peak memory and step time of kiln's activation-checkpointing settings on CPU/gloo:
`none`, `full`, `selective` (every other block) and `op` (every block keeps its matmul and
attention outputs, kiln/parallel/parallelize.py keep_compute_op_outputs), at tp 1 and --tp, each
beside the planner's peak (kiln/plan/memory.py rank_memory, eager, fp32, less the parameters:
`predicted_peak`; benchmarks/plan_validation.py checks it against these results).

Each rank builds the model with kiln's `build_model` (the layout's parallelize: TP + SP, then the
checkpoint wrappers) and runs forward + backward of one micro-batch:
- peak: the most bytes live at once above what existed before (the parameters; the previous
  run's gradients are freed before the region, as a training step starts without them), from
  torch.profiler's allocator events (benchmarks/rank_measures.py profiled_peak_bytes), the median
  of --profile-runs runs: one process gives the same bytes every run; under tp the peak moves by a
  few MiB from run to run (gloo's own buffers, and when the asynchronous collectives' outputs are
  freed); it includes the fp32 logits of the full loss and their gradients, which no setting changes;
- time: median over --rounds interleaved rounds (each setting once per round) of the slowest rank;
  noisy on a shared machine (the load average is kept with each round);
- the loss and grad norm of every setting must equal `none`'s (rel 1e-5: checkpointing changes no value).

    python benchmarks/activation_checkpointing.py [--dim 256] [--layers 6] [--seq 1024] [--batch 2]
        [--tp 2] [--rounds 3]

Writes benchmarks/results/activation_checkpointing.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402
from rank_measures import profiled_peak_bytes  # noqa: E402

SETTINGS = ("none", "full", "selective", "op")


def overrides(args: argparse.Namespace, tp: int, ac: str) -> list[str]:
    return [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
            f"model.vocab_size={args.vocab}", f"model.max_seq_len={args.seq}", f"data.seq_len={args.seq}",
            f"train.batch_size={args.batch}", "train.dtype=fp32", f"parallel.tp={tp}",
            f"train.activation_checkpointing={ac}"]


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kiln.config import load_config
    from kiln.parallel.dims import ParallelDims
    from kiln.train.trainer import build_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
        models = {}
        for ac in SETTINGS:
            cfg = load_config(None, overrides(args, world, ac))
            dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                            seq_len=args.seq)
            if world > 1 and dims.mesh is None:
                dims.build_mesh("cpu")
            torch.manual_seed(0)
            models[ac] = build_model(cfg, dims, torch.device("cpu"))

        def clear(ac):
            for p in models[ac].parameters():
                p.grad = None

        def run(ac):
            model = models[ac]
            clear(ac)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            return loss.item(), norm.item()

        result = {ac: {"seconds": [], "load": []} for ac in SETTINGS}
        for ac in SETTINGS:  # memory: profiled runs (the profiler slows the run; not timed)
            run(ac)  # warm-up: first-call allocations (e.g. RoPE tables) stay out of the peak
            peaks = []
            for _ in range(args.profile_runs):
                clear(ac)  # the last run's gradients freed outside the region: a step starts without them
                if world > 1:
                    dist.barrier()
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    result[ac]["loss"], result[ac]["grad_norm"] = run(ac)
                peaks.append(profiled_peak_bytes(prof))
            result[ac]["peak_bytes"], result[ac]["peak_bytes_runs"] = statistics.median(peaks), peaks
        for _ in range(args.rounds):
            for ac in SETTINGS:
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                run(ac)
                elapsed = torch.tensor(time.perf_counter() - t0)
                if world > 1:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                result[ac]["seconds"].append(elapsed.item())
                result[ac]["load"].append(os.getloadavg()[0])
        torch.save(result, f"{out}.{rank}")
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(args: argparse.Namespace, tp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(tp, f"{tmp}/store", args, f"{tmp}/out"), nprocs=tp, start_method="spawn")
        per_rank = [torch.load(f"{tmp}/out.{r}") for r in range(tp)]
    return per_rank


def predicted_peak(args: argparse.Namespace, tp: int, ac: str) -> float:
    """rank_memory's peak for this run less what exists before it (the parameters) and what the
    run does not have (optimizer state, DDP's buckets: one process per tp group, no optimizer)."""
    from kiln.config import load_config
    from kiln.plan.memory import Layout, ModelShape, rank_memory

    cfg = load_config(None, overrides(args, tp, ac))
    shape = ModelShape.from_config(cfg.model, cfg.model.vocab_size)
    layout = Layout(tp=tp, dp_mode="ddp", micro_batch=args.batch, precision="fp32", ac=ac)
    mem = rank_memory(shape, layout, args.seq)
    return mem.total - mem.parameters - mem.optimizer - mem.comm_buffers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile-runs", type=int, default=3, help="profiled runs per setting; the median peak is kept")
    p.add_argument("--out", default="activation_checkpointing")
    args = p.parse_args()
    if args.seq % args.tp:
        p.error(f"--seq={args.seq} must be a multiple of --tp={args.tp} (sequence parallel)")
    rows, table = {}, []
    for tp in sorted({1, args.tp}):
        per_rank = measure(args, tp)
        base = per_rank[0]["none"]
        for ac in SETTINGS:
            r0 = per_rank[0][ac]
            for key in ("loss", "grad_norm"):  # checkpointing changes no value
                assert abs(r0[key] - base[key]) <= 1e-5 * abs(base[key]), (tp, ac, key, r0[key], base[key])
            peak = max(r[ac]["peak_bytes"] for r in per_rank)
            row = {"tp": tp, "ac": ac, "peak_bytes": peak, "peak_bytes_per_rank": [r[ac]["peak_bytes"] for r in per_rank],
                   "peak_bytes_runs": [r[ac]["peak_bytes_runs"] for r in per_rank],
                   "seconds_rounds": r0["seconds"], "seconds_median": statistics.median(r0["seconds"]),
                   "load_rounds": r0["load"], "loss": r0["loss"], "grad_norm": r0["grad_norm"],
                   "predicted_peak_bytes": predicted_peak(args, tp, ac)}
            rows[f"tp{tp} {ac}"] = row
        for ac in SETTINGS:
            row, none = rows[f"tp{tp} {ac}"], rows[f"tp{tp} none"]
            row.update(peak_ratio=row["peak_bytes"] / none["peak_bytes"],
                       time_ratio=row["seconds_median"] / none["seconds_median"])
            table.append([tp, ac, row["peak_bytes"] / 2**20, row["peak_ratio"],
                          row["predicted_peak_bytes"] / 2**20, row["seconds_median"], row["time_ratio"]])
    write_results(args.out, {"args": vars(args), "rows": rows})
    print(f"dim={args.dim}, layers={args.layers}, heads={args.heads}, vocab={args.vocab}, seq={args.seq}, "
          f"batch={args.batch}, fp32; load average {os.getloadavg()}")
    print_table(["tp", "ac", "peak MiB/rank", "x none", "planner peak MiB", "median s", "x none"], table)


if __name__ == "__main__":
    main()
