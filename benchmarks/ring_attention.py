"""Context parallel's ring attention, one layer, on `--cp` gloo ranks of this machine: kiln as it
runs against each of the two things it does differently from a plain ring
(kiln/parallel/ring_attention.py, ring_blocks.py):
- "ring": the full ring a sliding-window layer ran before (K/V once round, dK/dV accumulators
  travelling along) instead of the window's neighbourhood (K/V `window_hops` steps both ways,
  dK/dV shares sent straight home); the same where the window reaches every rank (or none is set);
- "matmul": the plain fp32 matmul block kernel (what GPUs and attention dropout run) instead of
  torch's fused CPU flash-attention kernel.

Per case (sequence T, window W, 0 for none; batch --batch, --heads query / --kv-heads K/V heads of
width --head-dim, fp32), forward + backward through `ring_attention`, the three variants on the
same inputs, taking turns going first:
- blocks and bytes one rank sends (counted at torch.distributed.batch_isend_irecv; exact),
- the slowest rank's wall time, median over --rounds after a warm-up round (noisy on a shared
  machine),
- the most tensor bytes allocated and live at once on a rank during one call, its copies of the
  inputs and their gradients included (the profiler's allocator events; exact),
- the largest difference of each variant's outputs and dQ/dK/dV from kiln's (the benchmark fails
  above 1e-5: the same blocks, summed in another order or by another kernel).

    python benchmarks/ring_attention.py [--cp 4] [--cases 4096w0,4096w512,4096w1024] [--rounds 5]

Writes benchmarks/results/ring_attention.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import join_gloo, print_table, run_ranks, write_results  # noqa: E402
from rank_measures import profiled_peak_bytes  # noqa: E402

VARIANTS = ("kiln", "ring", "matmul")


def parse(case: str) -> tuple[int, int]:
    seq, window = case.split("w")
    return int(seq), int(window)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from kiln.parallel import ring_attention as ring_module
    from kiln.parallel import ring_blocks
    from kiln.parallel.context_parallel import zigzag_positions
    from kiln.parallel.ring_attention import Ring, ring_attention

    join_gloo(rank, world, port)
    ring, sent = Ring(dist.group.WORLD), {"blocks": 0, "bytes": 0}
    send_batch = dist.batch_isend_irecv

    def counted(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["blocks"] += 1
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return send_batch(ops)

    dist.batch_isend_irecv = counted
    hops, fused = ring_module.window_hops, ring_blocks.fused_kernel
    setups = {"kiln": (hops, fused), "ring": (lambda cp, chunk, window: None, fused),
              "matmul": (hops, lambda device, dropout: False)}
    rows = []
    for case in args.cases.split(","):
        seq, window = parse(case)
        g = torch.Generator().manual_seed(0)
        index = zigzag_positions(seq, world, rank)
        q = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)[:, :, index].contiguous()
        k, v = (torch.randn(args.batch, args.kv_heads, seq, args.head_dim, generator=g)[:, :, index].contiguous()
                for _ in "kv")
        dout = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)[:, :, index].contiguous()

        def call():
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            outputs = ring_attention(*inputs, ring, window=window)
            outputs.backward(dout)
            return [outputs.detach(), *(t.grad for t in inputs)]

        times = {name: [] for name in VARIANTS}
        results, counts, peaks = {}, {}, {}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name in VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]:  # each goes first by turns
                ring_module.window_hops, ring_blocks.fused_kernel = setups[name]
                sent.update(blocks=0, bytes=0)
                dist.barrier()
                start = time.perf_counter()
                results[name] = call()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
                counts[name] = dict(sent)
        for name in VARIANTS:
            ring_module.window_hops, ring_blocks.fused_kernel = setups[name]
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                call()
            peaks[name] = profiled_peak_bytes(prof)
        ring_module.window_hops, ring_blocks.fused_kernel = hops, fused
        difference = {name: max((a - b).abs().max().item() for a, b in zip(results[name], results["kiln"]))
                      for name in VARIANTS[1:]}
        rows.append({"case": case, "seq": seq, "window": window, "hops": hops(world, seq // (2 * world), window),
                     **{f"{name}_{key}": value for name in VARIANTS for key, value in counts[name].items()},
                     **{f"{name}_s": statistics.median(times[name][1:]) for name in VARIANTS},
                     **{f"{name}_peak_bytes": peaks[name] for name in VARIANTS},
                     **{f"{name}_max_difference": difference[name] for name in difference}})
    dist.destroy_process_group()
    out.put((rank, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--cases", default="4096w0,4096w512,4096w1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="ring_attention")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        seq, _ = parse(case)
        if seq % (2 * args.cp):
            raise SystemExit(f"--cases {case}: sequence {seq} is not divisible by 2 * --cp = {2 * args.cp}")
    target = importlib.import_module(Path(__file__).stem)._rank  # by module name: spawned ranks import it
    by_rank = dict(run_ranks(target, args.cp, (args,), "ring_attention"))
    rows = by_rank[0]  # counts and times (the slowest rank's) as rank 0 has them; peaks: the largest rank's
    for row, *others in zip(rows, *(by_rank[r] for r in range(1, args.cp))):
        for name in VARIANTS:
            row[f"{name}_peak_bytes"] = max(r[f"{name}_peak_bytes"] for r in (row, *others))
        for name in VARIANTS[1:]:
            if row[f"{name}_max_difference"] > 1e-5:
                raise SystemExit(f"{row['case']}: {name} differs from kiln by {row[f'{name}_max_difference']:.2e}")
    print_table(["case", "hops", "blocks sent ring / kiln", "MB sent ring / kiln", "s ring / matmul / kiln",
                 "peak MB matmul / kiln"],
                [[r["case"], "ring" if r["hops"] is None else r["hops"], f"{r['ring_blocks']} / {r['kiln_blocks']}",
                  f"{r['ring_bytes'] / 1e6:.1f} / {r['kiln_bytes'] / 1e6:.1f}",
                  f"{r['ring_s']:.3f} / {r['matmul_s']:.3f} / {r['kiln_s']:.3f}",
                  f"{r['matmul_peak_bytes'] / 1e6:.1f} / {r['kiln_peak_bytes'] / 1e6:.1f}"] for r in rows])
    command = "python benchmarks/ring_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, **vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
