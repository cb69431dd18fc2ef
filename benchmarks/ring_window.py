"""Context parallel with sliding-window layers: kiln's neighbourhood exchange (K/V `window_hops`
steps both ways, dK/dV shares sent straight home: kiln/parallel/context_parallel.py) against the
full ring the same layer ran before (K/V once round, dK/dV accumulators travelling along), on
`--cp` gloo ranks of this machine.

Per case (sequence T, window W; batch --batch, --heads query / --kv-heads K/V heads of width
--head-dim, fp32), one attention layer's forward + backward through `ring_attention` with the
window, the two schedules taking turns going first:
- blocks and bytes one rank sends (counted at torch.distributed.batch_isend_irecv; exact),
- the slowest rank's wall time, median over --rounds (noisy on a shared machine: compute is the
  same for both schedules, since masked blocks are skipped either way; only the exchange differs),
- the largest difference between the two schedules' outputs and dQ/dK/dV (they sum the same
  blocks in another order; the benchmark fails above 1e-5).

    python benchmarks/ring_window.py [--cp 4] [--cases 4096w512,4096w1024] [--rounds 5]

Writes benchmarks/results/ring_window.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import print_table, run_ranks, write_results  # noqa: E402


def parse(case: str) -> tuple[int, int]:
    seq, window = case.split("w")
    return int(seq), int(window)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist

    from kiln.parallel import context_parallel
    from kiln.parallel.context_parallel import Ring, ring_attention, zigzag_positions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ring, sent = Ring(dist.group.WORLD), {"blocks": 0, "bytes": 0}
    send_batch = dist.batch_isend_irecv

    def counted(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["blocks"] += 1
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return send_batch(ops)

    dist.batch_isend_irecv = counted
    neighbourhood = context_parallel.window_hops
    schedules = {"neighbourhood": neighbourhood, "ring": lambda cp, chunk, window: None}
    rows = []
    for case in args.cases.split(","):
        seq, window = parse(case)
        g = torch.Generator().manual_seed(0)
        index = zigzag_positions(seq, world, rank)
        q = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)[:, :, index]
        k, v = (torch.randn(args.batch, args.kv_heads, seq, args.head_dim, generator=g)[:, :, index] for _ in "kv")
        dout = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)[:, :, index]
        times = {name: [] for name in schedules}
        results, counts = {}, {}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name in sorted(schedules, reverse=round_ % 2 == 1):  # either first by turns
                context_parallel.window_hops = schedules[name]
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                sent.update(blocks=0, bytes=0)
                dist.barrier()
                start = time.perf_counter()
                outputs = ring_attention(*inputs, ring, window=window)
                outputs.backward(dout)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
                results[name] = [outputs.detach(), *(t.grad for t in inputs)]
                counts[name] = dict(sent)
        context_parallel.window_hops = neighbourhood
        difference = max((a - b).abs().max().item() for a, b in zip(results["neighbourhood"], results["ring"]))
        rows.append({"case": case, "seq": seq, "window": window, "hops": neighbourhood(world, seq // (2 * world), window),
                     "max_difference": difference,
                     **{f"{name}_{key}": value for name in schedules for key, value in counts[name].items()},
                     **{f"{name}_s": statistics.median(times[name][1:]) for name in schedules}})
    dist.destroy_process_group()
    out.put((rank, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--cases", default="4096w512,4096w1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="ring_window")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        seq, window = parse(case)
        if seq % (2 * args.cp):
            raise SystemExit(f"--cases {case}: sequence {seq} is not divisible by 2 * --cp = {2 * args.cp}")
    rows = dict(run_ranks(_rank, args.cp, (args,), "ring_window"))[0]  # rank 0's counts; times are the slowest rank's
    for row in rows:
        if row["max_difference"] > 1e-5:
            raise SystemExit(f"{row['case']}: the schedules differ by {row['max_difference']:.2e} (> 1e-5)")
    print_table(["case", "hops", "blocks sent (ring -> kiln)", "MB sent", "time s (ring -> kiln)", "speedup"],
                [[r["case"], "ring" if r["hops"] is None else r["hops"], f"{r['ring_blocks']} -> {r['neighbourhood_blocks']}",
                  f"{r['ring_bytes'] / 1e6:.1f} -> {r['neighbourhood_bytes'] / 1e6:.1f}",
                  f"{r['ring_s']:.3f} -> {r['neighbourhood_s']:.3f}", f"{r['ring_s'] / r['neighbourhood_s']:.2f}x"]
                 for r in rows])
    command = "python benchmarks/ring_window.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, **vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
