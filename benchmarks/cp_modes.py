"""Context parallel's two ways across the cp ranks, one attention layer on `--cp` gloo ranks of
this machine: ring attention (`parallel.cp_mode = "ring"`, kiln/parallel/ring_attention.py)
against Ulysses' all-to-alls (`"ulysses"`, kiln/parallel/ulysses.py), and with `--hybrid U`
Ulysses over U consecutive ranks with the ring across the groups (`parallel.ulysses_degree`), and
with `--ulysses-rounds R` Ulysses with its heads in R rounds, each round's all-to-all in flight
while the round before attends (`parallel.ulysses_rounds`), each on its own slices of the same
sequences (compared on the ring's).

Per case (sequence T, K/V heads; batch --batch, --heads query heads of width --head-dim, fp32,
causal), forward + backward, the two modes on the same inputs, taking turns going first:
- bytes one rank sends: the ring's counted at torch.distributed.batch_isend_irecv; Ulysses' at each
  all-to-all's call, (C-1)/C of its input leaving the rank, and its backward's all-to-all (the
  same sizes the other way) counted as the same again;
- the slowest rank's wall time, median over --rounds after a warm-up round (noisy on a shared
  machine), of forward + backward and of the forward alone (up to the output's first use);
- the most tensor bytes allocated and live at once on a rank during one call, its copies of the
  inputs and their gradients included (the profiler's allocator events);
- the largest difference of Ulysses' (and the hybrid's) output and dQ/dK/dV from the ring's (the
  benchmark fails above 1e-5).

    python benchmarks/cp_modes.py [--cp 4] [--cases 4096k8,4096k2] [--rounds 5] [--hybrid 2]
                                  [--ulysses-rounds 2]

Writes benchmarks/results/cp_modes.json and prints a table.
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

MODES = ("ring", "ulysses")


def parse(case: str) -> tuple[int, int]:
    seq, kv_heads = case.split("k")
    return int(seq), int(kv_heads)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from kiln.parallel import ulysses as ulysses_module
    from kiln.parallel.context_parallel import hybrid_groups, hybrid_positions, zigzag_positions
    from kiln.parallel.ring_attention import Ring, ring_attention
    from kiln.parallel.ulysses import Ulysses

    join_gloo(rank, world, port)
    ring, sent = Ring(dist.group.WORLD), {"bytes": 0}
    send_batch, all_to_all = dist.batch_isend_irecv, ulysses_module.funcol.all_to_all_single_autograd

    def counted_sends(ops):
        sent["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return send_batch(ops)

    def counted_all_to_all(tensor, *rest):  # forward here, its backward mirror counted alike
        ranks = tensor.shape[0]  # dim 0: one slice per rank of the group (kiln/parallel/ulysses.py)
        sent["bytes"] += 2 * tensor.numel() * tensor.element_size() * (ranks - 1) // ranks
        return all_to_all(tensor, *rest)

    dist.batch_isend_irecv = counted_sends
    ulysses_module.funcol.all_to_all_single_autograd = counted_all_to_all
    ulysses = Ulysses(dist.group.WORLD, world)
    attend = {"ring": lambda q, k, v: ring_attention(q, k, v, ring), "ulysses": ulysses.attention}
    positions = {mode: zigzag_positions for mode in attend}
    modes = MODES
    if args.hybrid:  # Ulysses over --hybrid consecutive ranks, the ring across the groups
        from torch.distributed.device_mesh import DeviceMesh

        heads, across = hybrid_groups(DeviceMesh("cpu", list(range(world)), mesh_dim_names=("cp",)), args.hybrid)
        attend["hybrid"] = Ulysses(heads, args.hybrid, Ring(across)).attention
        positions["hybrid"] = lambda seq, cp, r: hybrid_positions(seq, cp, args.hybrid, r)
        modes = MODES + ("hybrid",)
    if args.ulysses_rounds > 1:  # Ulysses over all ranks, its heads in rounds
        attend["rounds"] = Ulysses(dist.group.WORLD, world, rounds=args.ulysses_rounds).attention
        positions["rounds"] = zigzag_positions
        modes = modes + ("rounds",)
    rows = []
    for case in args.cases.split(","):
        seq, kv_heads = parse(case)
        g = torch.Generator().manual_seed(0)
        sequences = [torch.randn(args.batch, h, seq, args.head_dim, generator=g)
                     for h in (args.heads, kv_heads, kv_heads, args.heads)]  # q, k, v, the output's gradient

        def call(mode):
            index = positions[mode](seq, world, rank)
            q, k, v, dout = (t[:, :, index].contiguous() for t in sequences)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            outputs = attend[mode](*inputs) * 1  # its first use: a lazy all-to-all result waited for
            forward_s = time.perf_counter() - start
            outputs.backward(dout)
            return [outputs.detach(), *(t.grad for t in inputs)], forward_s

        def whole(mode, tensors):
            """`tensors` of every rank put together at their positions: whole sequences to compare."""
            index = positions[mode](seq, world, rank)
            indices = [torch.empty_like(index) for _ in range(world)]
            dist.all_gather(indices, index)
            out = []
            for t in tensors:
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous())
                full = torch.empty(*t.shape[:2], seq, t.shape[3])
                full[:, :, torch.cat(indices)] = torch.cat(parts, dim=2)
                out.append(full)
            return out

        times, forward_times, results, counts, peaks = {m: [] for m in modes}, {m: [] for m in modes}, {}, {}, {}
        for round_ in range(args.rounds + 1):  # the first round warms up
            turn = round_ % len(modes)
            for mode in modes[turn:] + modes[:turn]:  # each goes first by turns
                sent["bytes"] = 0
                dist.barrier()
                start = time.perf_counter()
                results[mode], forward_s = call(mode)
                elapsed = torch.tensor([time.perf_counter() - start, forward_s])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[mode].append(elapsed[0].item())
                forward_times[mode].append(elapsed[1].item())
                counts[mode] = sent["bytes"]
        for mode in modes:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                call(mode)
            peaks[mode] = profiled_peak_bytes(prof)
        wholes = {mode: whole(mode, results[mode]) for mode in modes}
        difference = max((a - b).abs().max().item() for mode in modes[1:]
                         for a, b in zip(wholes[mode], wholes["ring"]))
        rows.append({"case": case, "seq": seq, "kv_heads": kv_heads,
                     **{f"{m}_bytes": counts[m] for m in modes},
                     **{f"{m}_s": statistics.median(times[m][1:]) for m in modes},
                     **{f"{m}_forward_s": statistics.median(forward_times[m][1:]) for m in modes},
                     **{f"{m}_peak_bytes": peaks[m] for m in modes}, "max_difference": difference})
    dist.destroy_process_group()
    out.put((rank, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--cases", default="4096k8,4096k2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hybrid", type=int, default=0, metavar="U",
                        help="also Ulysses over U consecutive ranks with the ring across the groups")
    parser.add_argument("--ulysses-rounds", type=int, default=1, metavar="R",
                        help="also Ulysses with its heads in R rounds (parallel.ulysses_rounds)")
    parser.add_argument("--out", default="cp_modes")
    args = parser.parse_args(argv)
    if args.hybrid and (args.cp % args.hybrid or args.heads % args.hybrid or not 1 < args.hybrid < args.cp):
        raise SystemExit(f"--hybrid {args.hybrid} must be between 1 and --cp {args.cp}, dividing it and --heads")
    if args.ulysses_rounds > 1 and args.heads % (args.cp * args.ulysses_rounds):
        raise SystemExit(f"--ulysses-rounds {args.ulysses_rounds} x --cp {args.cp} must divide --heads {args.heads}")
    if args.heads % args.cp:
        raise SystemExit(f"--heads {args.heads} is not divisible by --cp {args.cp} (Ulysses splits the heads)")
    for case in args.cases.split(","):
        seq, kv_heads = parse(case)
        if seq % (2 * args.cp) or args.heads % kv_heads:
            raise SystemExit(f"--cases {case}: the sequence must divide by 2 * --cp = {2 * args.cp} and the "
                             f"K/V heads divide --heads {args.heads}")
    target = importlib.import_module(Path(__file__).stem)._rank  # by module name: spawned ranks import it
    by_rank = dict(run_ranks(target, args.cp, (args,), "cp_modes"))
    rows = by_rank[0]  # counts and times (the slowest rank's) as rank 0 has them; peaks: the largest rank's
    modes = MODES + (("hybrid",) if args.hybrid else ()) + (("rounds",) if args.ulysses_rounds > 1 else ())
    for row, *others in zip(rows, *(by_rank[r] for r in range(1, args.cp))):
        for mode in modes:
            row[f"{mode}_peak_bytes"] = max(r[f"{mode}_peak_bytes"] for r in (row, *others))
        difference = max(r["max_difference"] for r in (row, *others))
        if difference > 1e-5:
            raise SystemExit(f"{row['case']}: Ulysses differs from the ring by {difference:.2e}")
    names = " / ".join(modes)
    print_table(["case (T k K/V heads)", f"MB sent {names}", f"s {names}", f"forward s {names}",
                 f"peak MB {names}"],
                [[r["case"], *(" / ".join(fmt(r[f"{m}_{key}"]) for m in modes)
                               for key, fmt in (("bytes", lambda b: f"{b / 1e6:.1f}"), ("s", lambda t: f"{t:.3f}"),
                                                ("forward_s", lambda t: f"{t:.3f}"),
                                                ("peak_bytes", lambda b: f"{b / 1e6:.1f}")))] for r in rows])
    command = "python benchmarks/cp_modes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, **vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
