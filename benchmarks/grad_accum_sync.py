"""Gradient accumulation under DDP, HSDP and DDP with expert parallelism: reducing across the
replicas in every micro-batch (kiln before `sync_on_last_micro_batch`) vs in the last one only
(kiln/parallel/data_parallel.py).

N gloo processes (one thread each) build kiln's transformer through the trainer's path
(`build_model` -> parallelize, `build_optimizer` -> `shard_optimizer_state`; --dim, --layers,
--heads, --vocab) and take AdamW (foreach) steps of --accum micro-batches of 2 rows x 64 tokens through
kiln's `train_step`. Layouts: ddp over --ddp-ranks ranks; HSDP, 2 replicas x FSDP over 2 (4
ranks); ddp_ep (below). Variants, built afresh and run in alternating order each round:

  every   each micro-batch's backward reduces across the replicas (DDP: its all-reduce; HSDP: the
          reduce-scatter and the all-reduce), the sync switched off by making
          `sync_on_last_micro_batch` a no-op
  last    kiln's: DDP all-reduces in the last micro-batch only; HSDP reduce-scatters inside the
          replica every micro-batch and all-reduces across the replicas in the last only

ddp_ep (4 ranks: ddp over 4, MoE with 4 experts of a quarter of the FFN, top-2, ep 2, so each
expert lives on 2 ranks, edp 2): DDP's dense all-reduce in the last micro-batch in both variants;
`every` sums the experts' gradients over edp in every micro-batch's backward (kiln before
expert_parallel.py `ReplicatedExpertGrads` waited for the last; its per-backward sum, as pipeline
stages take it, switched on), `last` once a step.

Reported per layout and variant: the step time (median over --steps steps, median over rounds
of the slowest rank), the bytes each rank wrote to its sockets per step (/proc/self/io wchar)
and rank 0's loss after the timed steps (the same in both variants up to the order of sums).

    python benchmarks/grad_accum_sync.py [--accum 4] [--rounds 3] [--steps 3] [--dim 256 --layers 4]

Writes benchmarks/results/grad_accum_sync.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (gloo_rank_config, print_table, rank_dims, run_ranks, slowest_rank_median,  # noqa: E402
                    timed_train_steps, write_results)

VARIANTS = ("every", "last")
LAYOUTS = {"ddp": ["parallel.dp_mode='ddp'"],
           "hsdp": ["parallel.dp_mode='fsdp'", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
           # foreach AdamW cannot step DTensor experts and plain dense parameters together: auto
           "ddp_ep": ["parallel.dp_mode='ddp'", "parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2",
                      "optim.implementation='auto'"]}
WORLD = {"hsdp": 4, "ddp_ep": 4}  # ddp: --ddp-ranks


def rank_main(rank: int, world: int, port: int, layout: str, args, out) -> None:
    import torch.distributed as dist

    import kiln.parallel.data_parallel as data_parallel
    from kiln.train.optim import build_optimizer
    from kiln.train.system import resolve_loss
    from kiln.train.trainer import build_model

    real = data_parallel.sync_on_last_micro_batch
    cfg = gloo_rank_config(rank, world, port, args, "train.dtype=fp32", "train.batch_size=2",
                           f"train.grad_accum={args.accum}", *LAYOUTS[layout])
    dims = rank_dims(cfg, rank, world)
    device = torch.device("cpu")
    from kiln.parallel.data_parallel import shard_optimizer_state

    tokens = torch.randint(0, args.vocab, (args.accum, 2, 65), generator=torch.Generator().manual_seed(1 + rank))
    batch = [(t[:, :-1], t[:, 1:]) for t in tokens]
    results = {v: {"step_s": [], "sent": [], "loss": None} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            every_dense = variant == "every" and layout != "ddp_ep"
            data_parallel.sync_on_last_micro_batch = (lambda model, last: None) if every_dense else real
            torch.manual_seed(0)
            model = build_model(cfg, dims, device)
            if variant == "every" and layout == "ddp_ep":  # the experts summed in each backward's hook
                model.replicated_expert_grads.per_backward = True
            model.loss_impl = resolve_loss(cfg.train.loss, device, False, tp=dims.tp)
            optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)
            step_s, sent, loss, _ = timed_train_steps(model, optimizer, batch, args.steps)
            results[variant]["step_s"].append(step_s)
            results[variant]["sent"].append(sent)
            results[variant]["loss"] = loss
    data_parallel.sync_on_last_micro_batch = real
    out.put({"rank": rank, "results": results})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ddp-ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", default="grad_accum_sync")
    args = parser.parse_args(argv)
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    rows, table = {}, []
    for layout in LAYOUTS:
        world = WORLD.get(layout, args.ddp_ranks)
        ranks = sorted(run_ranks(target, world, (layout, args), f"grad_accum_sync {layout}", timeout_s=1800),
                       key=lambda r: r["rank"])  # (in the order they finished): the loss is rank 0's
        rows[layout] = {}
        for v in VARIANTS:
            step = slowest_rank_median(ranks, lambda r: r["results"][v]["step_s"], args.rounds)
            sent = slowest_rank_median(ranks, lambda r: r["results"][v]["sent"], args.rounds)
            rows[layout][v] = {"step_s": step, "sent_bytes_per_rank": sent, "loss": ranks[0]["results"][v]["loss"]}
        every, last = rows[layout]["every"], rows[layout]["last"]
        table.append([f"{layout} x{world}", f"{every['step_s']:.3f} / {last['step_s']:.3f}",
                      f"{every['sent_bytes_per_rank'] / 1e6:.2f} / {last['sent_bytes_per_rank'] / 1e6:.2f}",
                      f"{every['loss']:.5f} / {last['loss']:.5f}"])
    print_table(["layout", "step s: every / last", "MB sent per rank: every / last", "loss: every / last"], table)
    command = "python benchmarks/grad_accum_sync.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'layouts': rows, 'load_avg': os.getloadavg()[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
