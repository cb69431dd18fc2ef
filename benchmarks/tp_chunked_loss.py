"""Per-rank peak memory and time of the LM loss under tensor parallelism: the whole vocab-sharded
logits under torch's `loss_parallel` (train.loss='auto'/'full' with tp) vs kiln's vocab-parallel
chunked head + cross-entropy (train.loss='chunked', kiln/model/loss.py), on CPU/gloo.

`--tp` processes each hold the head's weight rows (ColwiseParallel, Shard(0), as
kiln/parallel/tensor_parallel.py `tp_plan` shards `output`) and their sequence shard of the final
hidden states (Shard(1), as sequence parallel hands them to the head), and run the loss forward and
backward: `parallel_lm_loss(head(hidden), targets)` vs `parallel_chunked_lm_loss(hidden,
head.weight, targets, chunk)` for each `--chunks` size. Measured on every rank, the largest reported:

- peak: the most bytes the loss's forward + backward held above what existed before it (the
  weight and hidden inputs), from torch.profiler's allocator events (profile_memory=True): an exact
  count of tensor bytes, independent of load; the weight gradient (V/tp x dim fp32) is included;
- time: median over `--rounds` interleaved rounds (each variant once per round) of the slowest
  rank's wall time; noisy on a shared machine, the load average is kept with each round;
- the loss of each variant (they must agree: rel 1e-5 is checked).

    python benchmarks/tp_chunked_loss.py [--vocab 128256] [--dim 128] [--tokens 4096]
        [--chunks 1024,4096] [--tp 2] [--rounds 3]

Writes benchmarks/results/tp_chunked_loss.json and prints a table.
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


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.profiler import ProfilerActivity, profile

    from kiln.parallel.functional import parallel_chunked_lm_loss, parallel_lm_loss

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        gen = torch.Generator().manual_seed(0)
        head = nn.Linear(args.dim, args.vocab, bias=False)
        with torch.no_grad():
            head.weight.normal_(0, 0.02, generator=gen)
        # tp_plan's head: vocab-sharded weight, logits left a vocab-sharded DTensor for loss_parallel.
        parallelize_module(head, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                       use_local_output=False))
        hidden_full = torch.randn(1, args.tokens, args.dim, generator=gen)
        seq = args.tokens // world
        targets = torch.randint(0, args.vocab, (1, args.tokens), generator=gen)

        def run(variant):
            hidden = hidden_full[:, rank * seq:(rank + 1) * seq].clone().requires_grad_()
            head.weight.grad = None
            if variant == "loss_parallel":
                loss = parallel_lm_loss(head(hidden), targets)
            else:
                loss = parallel_chunked_lm_loss(hidden, head.weight, targets, chunk=int(variant.split("=")[1]))
            loss.backward()
            return loss.item()

        variants = ["loss_parallel"] + [f"chunked chunk={c}" for c in args.chunks]
        result = {v: {"seconds": [], "load": []} for v in variants}
        for v in variants:  # memory: one profiled run each (the profiler slows the run; not timed)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                result[v]["loss"] = run(v)
            result[v]["peak_bytes"] = profiled_peak_bytes(prof)
        for _ in range(args.rounds):
            for v in variants:
                dist.barrier()
                t0 = time.perf_counter()
                run(v)
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                result[v]["seconds"].append(elapsed.item())
                result[v]["load"].append(os.getloadavg()[0])
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="tp_chunked_loss")
    args = p.parse_args()
    if args.tokens % args.tp:
        p.error(f"--tokens={args.tokens} must be a multiple of --tp={args.tp} (sequence parallel)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.tp, f"{tmp}/store", args, f"{tmp}/out"), nprocs=args.tp,
                           start_method="spawn")
        per_rank = [torch.load(f"{tmp}/out.{r}") for r in range(args.tp)]
    rows, table = {}, []
    base = per_rank[0]["loss_parallel"]
    for v in per_rank[0]:
        peak = max(r[v]["peak_bytes"] for r in per_rank)
        seconds = per_rank[0][v]["seconds"]
        loss = per_rank[0][v]["loss"]
        assert abs(loss - base["loss"]) <= 1e-5 * abs(base["loss"]), (v, loss, base["loss"])
        rows[v] = {"peak_bytes": peak, "peak_bytes_per_rank": [r[v]["peak_bytes"] for r in per_rank],
                   "seconds_rounds": seconds, "seconds_median": statistics.median(seconds),
                   "load_rounds": per_rank[0][v]["load"], "loss": loss}
    for v, r in rows.items():
        ratio_mem = r["peak_bytes"] / rows["loss_parallel"]["peak_bytes"]
        ratio_t = r["seconds_median"] / rows["loss_parallel"]["seconds_median"]
        r.update(peak_ratio=ratio_mem, time_ratio=ratio_t)
        table.append([v, r["peak_bytes"] / 2**20, ratio_mem, r["seconds_median"], ratio_t, r["loss"]])
    logits = args.tokens * -(-args.vocab // args.tp) * 4
    write_results(args.out, {"args": vars(args), "fp32_logits_bytes_per_rank": logits, "rows": rows})
    print(f"tp={args.tp}, vocab={args.vocab}, dim={args.dim}, tokens={args.tokens}: fp32 logits per rank "
          f"{logits / 2**20:.0f} MiB; load average {os.getloadavg()}")
    print_table(["loss", "peak MiB/rank", "x loss_parallel", "median s", "x loss_parallel", "loss"], table)


if __name__ == "__main__":
    main()
