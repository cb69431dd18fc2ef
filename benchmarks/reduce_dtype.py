"""Data-parallel gradients sent in bf16 (parallel.reduce_dtype = "bf16") against fp32, under the
replicating modes: ddp at each --worlds size (torch's DDP with kiln's `bf16_mean_hook`) and ddp x
tp 2 on 4 ranks (kiln's `OverlappedReplicas`, each bucket cast before its all-reduce).

N gloo processes (one thread each) build kiln's transformer through the trainer's path
(`build_model` -> parallelize, `build_optimizer`) and take fp32 AdamW steps of --rows rows x 64
tokens per data-parallel rank through kiln's `train_step`. The two variants are built afresh and
run in alternating order each round. Reported per layout and variant: the step time (median over
--steps steps, median over rounds of the slowest rank), the bytes each rank wrote to its sockets
per step (/proc/self/io wchar: gloo's traffic, all of it gradient all-reduces here) and rank 0's
loss after the timed steps (bf16 sums differ from fp32 by their rounding).

    python benchmarks/reduce_dtype.py [--worlds 2,4] [--rounds 3] [--steps 3] [--rows 4]

Writes benchmarks/results/reduce_dtype.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import replace
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (gloo_rank_config, print_table, rank_dims, run_ranks, slowest_rank_median,  # noqa: E402
                    timed_train_steps, trainer_model, write_results)

VARIANTS = ("fp32", "bf16")


def rank_main(rank: int, world: int, port: int, args, tp: int, out) -> None:
    import torch.distributed as dist

    results = {v: {"step_s": [], "sent": [], "loss": None} for v in VARIANTS}
    base = gloo_rank_config(rank, world, port, args, "train.dtype=fp32", f"train.batch_size={args.rows}",
                            f"parallel.tp={tp}", "parallel.dp_mode='ddp'")
    configs, layouts = {}, {}
    for variant in VARIANTS:  # each variant's config and mesh, built once
        configs[variant] = cfg = replace(base, parallel=replace(base.parallel, reduce_dtype=variant))
        layouts[variant] = rank_dims(cfg, rank, world)
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            cfg, dims = configs[variant], layouts[variant]
            model, optimizer = trainer_model(cfg, dims)
            tokens = torch.randint(0, args.vocab, (args.rows * dims.dp_size, 65),
                                   generator=torch.Generator().manual_seed(1))
            rows = tokens[dims.dp_rank * args.rows:(dims.dp_rank + 1) * args.rows]
            step_s, sent, loss, _ = timed_train_steps(model, optimizer, [(rows[:, :-1], rows[:, 1:])], args.steps)
            results[variant]["step_s"].append(step_s)
            results[variant]["sent"].append(sent)
            results[variant]["loss"] = loss
    out.put({"rank": rank, "results": results})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", default="reduce_dtype")
    args = parser.parse_args(argv)
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    layouts = [(f"ddp x{n}", n, 1) for n in (int(w) for w in args.worlds.split(","))]
    layouts += [("ddp2 x tp2", 4, 2)] if 4 in (n for _, n, _ in layouts) else []
    rows, table = {}, []
    for name, world, tp in layouts:
        ranks = sorted(run_ranks(target, world, (args, tp), f"reduce_dtype {name}", timeout_s=1800),
                       key=lambda r: r["rank"])  # (in the order they finished): the loss is rank 0's
        rows[name] = row = {}
        for v in VARIANTS:
            row[v] = {"step_s": slowest_rank_median(ranks, lambda r: r["results"][v]["step_s"], args.rounds),
                      "sent_bytes_per_rank": slowest_rank_median(ranks, lambda r: r["results"][v]["sent"], args.rounds),
                      "loss": ranks[0]["results"][v]["loss"]}
        fp32, bf16 = row["fp32"], row["bf16"]
        table.append([name, f"{fp32['step_s']:.3f} / {bf16['step_s']:.3f}",
                      f"{fp32['sent_bytes_per_rank'] / 1e6:.2f} / {bf16['sent_bytes_per_rank'] / 1e6:.2f}",
                      f"{bf16['sent_bytes_per_rank'] / fp32['sent_bytes_per_rank']:.2f}",
                      f"{fp32['loss']:.5f} / {bf16['loss']:.5f}"])
    print("each cell: fp32 on the wire, then bf16")
    print_table(["layout", "step s", "MB sent per rank (gloo)", "bytes bf16 / fp32", "loss"], table)
    command = "python benchmarks/reduce_dtype.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'layouts': rows, 'load_avg': os.getloadavg()[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
