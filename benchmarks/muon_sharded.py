"""Muon's step on FSDP2-sharded parameters: every rank orthogonalizing every matrix, or each
matrix on one rank (kiln/train/optimizers/muon_split.py).

N gloo processes (one thread each) hold the parameter set of a Llama-style decoder (optimizer_step.py's
ShapeOnlyTransformer: 17.3M parameters at the defaults), FSDP2-sharded per block over all N (with
`--tp T`: over N / T, each block first tensor-parallel over T with Megatron's column / row plan),
and step kiln's Muon (`build_optimizer`, optim.name = "muon") on fixed random gradients (`--ddp`:
replicated on every rank instead, as under DDP). Two variants, built afresh and timed in
alternating rounds:

  gather  each sharded matrix gathered whole on every rank and orthogonalized there (kiln before
          muon_split.py; still its path where DTensor cannot narrow a matrix to one cut);
  split   each matrix orthogonalized on one rank, shards exchanged by two all-to-alls (under
          FSDP over tp: gathered over FSDP's ranks first, then dealt over tp; `--ddp`: whole
          matrices dealt over the ranks, one broadcast per owner).

Reported per world size: the step's wall time (median over rounds of the slowest rank's median
step), CPU seconds per step per rank, bytes each rank wrote to its sockets per step (/proc/self/io
wchar) and the largest difference between the two variants' parameters after the same steps
(they run the same Newton-Schulz on the same matrices: expected 0).

    python benchmarks/muon_sharded.py [--worlds 1,2,4] [--tp 1] [--rounds 3] [--steps 3] [--dim 384 --layers 8]

Writes benchmarks/results/muon_sharded.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (add_sharded_set_args, join_gloo, print_table, run_ranks, sharded_parameter_set,  # noqa: E402
                    slowest_rank_median, socket_bytes, write_results)

VARIANTS = ("gather", "split")


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.config import OptimConfig
    from kiln.train.optim import build_optimizer
    from kiln.train.optimizers import muon_split

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    real = muon_split._cut, muon_split._to_one_cut

    def sharded(seed):  # the parameter set, tp-sharded where tp > 1, FSDP2 per block; --ddp: whole on every rank
        return sharded_parameter_set(args, mesh, seed, sharded=not args.ddp)

    def build():
        model = sharded(0)
        grads = [p.detach() * 1e-3 for p in sharded(1).parameters()]  # fixed, sharded as the parameters
        optimizer = build_optimizer(model, OptimConfig(name="muon", lr=0.02, muon_adam_lr=0.004), "cpu")
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        if args.ddp and dealing:  # what kiln's shard_optimizer_state sets under ddp
            optimizer.replicas = dist.group.WORLD
        return model, optimizer, grads

    def step(model, optimizer, grads) -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()

    results = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    sent = {v: [] for v in VARIANTS}
    final = {}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            dealing = variant == "split"
            if variant == "split":
                muon_split._cut, muon_split._to_one_cut = real
            else:
                muon_split._cut, muon_split._to_one_cut = (lambda u, stacked: "gather"), (lambda u, stacked: None)
            model, optimizer, grads = build()
            step(model, optimizer, grads)  # state created, untimed
            times = []
            for _ in range(args.steps):
                dist.barrier()
                w0, c0, b0 = time.perf_counter(), time.process_time(), socket_bytes()
                step(model, optimizer, grads)
                times.append(time.perf_counter() - w0)
                cpu[variant].append(time.process_time() - c0)
                sent[variant].append(socket_bytes() - b0)
            results[variant].append(statistics.median(times))
            if r == 0:
                final[variant] = [p.detach().clone() if args.ddp else p.full_tensor() for p in model.parameters()]
    muon_split._cut, muon_split._to_one_cut = real
    difference = max((a - b).abs().max().item() for a, b in zip(final["gather"], final["split"]))
    out.put({"rank": rank, "step_s": results, "cpu_s": {v: statistics.median(c) for v, c in cpu.items()},
             "sent_bytes": {v: statistics.median(s) for v, s in sent.items()}, "difference": difference})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sharded_set_args(parser)
    parser.add_argument("--ddp", action="store_true", help="replicated parameters (DDP) instead of FSDP2: "
                        "gather = every rank orthogonalizes all, split = dealt over the ranks and broadcast")
    parser.add_argument("--out", default="muon_sharded")
    args = parser.parse_args(argv)
    rows, table, worst = {}, [], 0.0
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w % args.tp for w in worlds):
        parser.error(f"--tp {args.tp} must divide every world in --worlds {args.worlds}")
    for world in worlds:
        target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
        ranks = run_ranks(target, world, (args,), f"muon_sharded world {world}", timeout_s=1800)
        step = {v: slowest_rank_median(ranks, lambda r: r["step_s"][v], args.rounds) for v in VARIANTS}
        per_round = [max(r["step_s"]["gather"][i] for r in ranks) / max(r["step_s"]["split"][i] for r in ranks)
                     for i in range(args.rounds)]
        rows[world] = {"step_s": step, "speedup_per_round": per_round,
                       "cpu_s_per_rank": {v: max(r["cpu_s"][v] for r in ranks) for v in VARIANTS},
                       "sent_bytes_per_rank": {v: max(r["sent_bytes"][v] for r in ranks) for v in VARIANTS},
                       "difference": max(r["difference"] for r in ranks), "load_avg": os.getloadavg()[0]}
        worst = max(worst, rows[world]["difference"])
        row = rows[world]
        table.append([f"{world} (tp {args.tp})" if args.tp > 1 else f"{world} (ddp)" if args.ddp else world, f"{step['gather']:.3f} / {step['split']:.3f}",
                      f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})",
                      f"{row['cpu_s_per_rank']['gather']:.3f} / {row['cpu_s_per_rank']['split']:.3f}",
                      f"{row['sent_bytes_per_rank']['gather'] / 1e6:.1f} / {row['sent_bytes_per_rank']['split'] / 1e6:.1f}",
                      f"{row['difference']:.1e}"])
    print_table(["ranks", "step s: gather / split", "split speed-up", "CPU s per rank", "MB sent per rank",
                 "max |diff|"], table)
    command = "python benchmarks/muon_sharded.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'worlds': rows})}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
