"""Adafactor's step on FSDP2-sharded parameters (kiln/train/optimizers/adafactor.py) against one
process stepping them whole.

N gloo processes (one thread each) hold the parameter set of a Llama-style decoder (optimizer_step.py's
ShapeOnlyTransformer: 17.3M parameters at the defaults), FSDP2-sharded per block over all N (with
`--tp T`: over N / T, each block first tensor-parallel over T with Megatron's column / row plan),
and step kiln's Adafactor (`build_optimizer`, optim.name = "adafactor") on fixed random gradients.
The baseline, in the same run: one process stepping the whole parameter set with torch's
`torch.optim.Adafactor` (what kiln ran before, and the only way torch's could run: it cannot step
DTensors) and with kiln's. The reference at every world size: torch's fused AdamW on the same
sharding (an elementwise step, no reductions: what sharding alone does to a step on this machine).

Reported per world size: the step's wall time (median over rounds of the slowest rank's median
step), its ratio to torch's one-process step, CPU seconds per step per rank, bytes each rank wrote
to its sockets per step (/proc/self/io wchar), all_reduce calls per step, and the largest
difference between the parameters after the same steps and one process's (kiln's; float
summation order only).

    python benchmarks/adafactor_sharded.py [--worlds 1,2,4] [--tp 1] [--rounds 3] [--steps 3]

Writes benchmarks/results/adafactor_sharded.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (add_sharded_set_args, join_gloo, print_table, run_ranks, sharded_parameter_set,  # noqa: E402
                    slowest_rank_median, socket_bytes, write_results)


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.config import OptimConfig
    from kiln.train import optim
    from kiln.train.optimizers import adafactor

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    def build(variant):
        sharded = variant != "torch" and world > 1
        model = sharded_parameter_set(args, mesh, 0, sharded)
        grads = [p.detach() * 1e-3 for p in sharded_parameter_set(args, mesh, 1, sharded).parameters()]  # placed alike
        real = optim.Adafactor
        optim.Adafactor = torch.optim.Adafactor if variant == "torch" else real
        try:
            name = "adamw" if variant == "adamw" else "adafactor"
            optimizer = optim.build_optimizer(model, OptimConfig(name=name, lr=0.01), "cpu")
        finally:
            optim.Adafactor = real
        return model, optimizer, grads

    def step(model, optimizer, grads) -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()

    calls, real_all_reduce = [0], adafactor.dist.all_reduce

    def counting(*a, **k):
        calls[0] += 1
        return real_all_reduce(*a, **k)

    variants = ("torch", "kiln", "adamw") if world == 1 else ("kiln", "adamw")
    results, cpu, sent, final = {v: [] for v in variants}, {v: [] for v in variants}, {v: [] for v in variants}, {}
    adafactor.dist.all_reduce = counting
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            model, optimizer, grads = build(variant)
            step(model, optimizer, grads)  # state created, untimed
            times, calls[0] = [], 0
            for _ in range(args.steps):
                dist.barrier()
                w0, c0, b0 = time.perf_counter(), time.process_time(), socket_bytes()
                step(model, optimizer, grads)
                times.append(time.perf_counter() - w0)
                cpu[variant].append(time.process_time() - c0)
                sent[variant].append(socket_bytes() - b0)
            results[variant].append(statistics.median(times))
            if r == 0 and variant == "kiln":
                # numpy: a tensor on the queue is shared memory, gone when this process ends
                final = torch.cat([(p.detach().full_tensor() if world > 1 else p.detach()).flatten()
                                   for p in model.parameters()]).numpy()
                all_reduces = calls[0] / args.steps
    out.put({"rank": rank, "step_s": results, "cpu_s": {v: statistics.median(c) for v, c in cpu.items()},
             "sent_bytes": {v: statistics.median(s) for v, s in sent.items()}, "all_reduces": all_reduces,
             "final": final if rank == 0 else None})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sharded_set_args(parser)
    parser.add_argument("--out", default="adafactor_sharded")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if worlds[0] != 1 or any(w % args.tp for w in worlds[1:]):
        parser.error(f"--worlds {args.worlds} must start with 1 (the baseline) and --tp {args.tp} divide the rest")
    rows, table, baseline, reference, worst = {}, [], None, None, 0.0
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    for world in worlds:
        tp = args.tp if world > 1 else 1
        ranks = run_ranks(target, world, (argparse.Namespace(**{**vars(args), "tp": tp}),),
                          f"adafactor_sharded world {world}", timeout_s=1800)
        step = {v: slowest_rank_median(ranks, lambda r: r["step_s"][v], args.rounds) for v in ranks[0]["step_s"]}
        final = next(r["final"] for r in ranks if r["rank"] == 0)  # the queue's order is arrival
        if world == 1:
            baseline, reference = step["torch"], final
        difference = float(abs(final - reference).max())
        worst = max(worst, difference)
        rows[world] = {"tp": tp, "step_s": step, "vs_torch_one_process": baseline / step["kiln"],
                       "over_adamw_fused": step["kiln"] / step["adamw"],
                       "cpu_s_per_rank": max(r["cpu_s"]["kiln"] for r in ranks),
                       "sent_bytes_per_rank": max(r["sent_bytes"]["kiln"] for r in ranks),
                       "all_reduces_per_step": ranks[0]["all_reduces"], "difference": difference,
                       "load_avg": os.getloadavg()[0]}
        label = f"{world} (tp {tp})" if tp > 1 else str(world)
        if world == 1:
            table.append([f"{label}, torch's", f"{step['torch']:.4f}", "1.00x", "-", "-", "-", "-", "-"])
        row = rows[world]
        table.append([f"{label}, kiln's", f"{step['kiln']:.4f}", f"{row['vs_torch_one_process']:.2f}x",
                      f"{step['adamw']:.4f} ({row['over_adamw_fused']:.2f}x)",
                      f"{row['cpu_s_per_rank']:.4f}", f"{row['sent_bytes_per_rank'] / 1e6:.2f}",
                      f"{row['all_reduces_per_step']:.0f}", f"{difference:.1e}"])
    print_table(["ranks", "step s", "speed-up vs torch's, 1 process", "AdamW fused s (Adafactor / it)",
                 "CPU s per rank", "MB sent per rank",
                 "all_reduces per step", "max |diff| vs 1 process"], table)
    command = "python benchmarks/adafactor_sharded.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'worlds': rows})}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
