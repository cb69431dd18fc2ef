"""The backward of an MoE block under tensor parallelism with the experts sharded over tp
(etp = tp, kiln/parallel/tensor_parallel.py `MoETensorParallel`): the gathered tokens' gradient
reduce-scattered back to the sequence shard (kiln's, Megatron's sequence-parallel "g") vs
all-reduced and then sliced (kiln before: the experts' input gradient all-reduced over tp, the
gathered input's gradient taken as replicated).

N gloo processes (one thread each, N = each --tp) build kiln's transformer through the trainer's
path (`build_model` -> parallelize, `build_optimizer`) with every block an MoE block (--experts,
top-2, a quarter of the FFN each) and tp = N, and take fp32 AdamW steps of --rows rows x 64 tokens
through kiln's `train_step`. Variants, built afresh and run in alternating order each round:

  all_reduce      `MoETensorParallel._gather_sequence` patched to the earlier form: the gather's
                  gradient taken as replicated (a slice in backward) after an all-reduce of the
                  partial sum; the same numbers, the earlier traffic
  reduce_scatter  kiln's: the gradient left partial, reduce-scattered by the gather's backward

Reported per tp degree and variant: the step time (median over --steps steps, median over rounds
of the slowest rank), the bytes each rank wrote to its sockets per step (/proc/self/io wchar),
rank 0's c10d collectives by kind in one more step (torch.profiler) and rank 0's loss after the
timed steps (the same in both, up to the order of sums).

On gloo the two variants move the same bytes: ProcessGroupGloo runs a reduce-scatter as an
all-reduce of the whole tensor (benchmarks/comm_count.py). The difference is NCCL's, whose ring
reduce-scatter sends (N-1)/N of the tensor per rank where an all-reduce sends 2 (N-1)/N; what this
machine shows is the swap of the calls (one all-reduce per MoE block and step becomes a
reduce-scatter), the losses and the step time.

    python benchmarks/moe_tp_backward.py [--tp 2,4] [--rounds 3] [--steps 3] [--rows 8]

Writes benchmarks/results/moe_tp_backward.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (gloo_rank_config, print_table, rank_dims, run_ranks, slowest_rank_median,  # noqa: E402
                    timed_train_steps, trainer_model, write_results)

VARIANTS = ("all_reduce", "reduce_scatter")


def _gather_then_all_reduce(module, inputs, mesh):
    """The earlier backward: the gathered input's gradient all-reduced over tp, then sliced."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    (x,) = inputs
    gathered = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    # the identity, its gradient (a partial sum) all-reduced: Megatron's "f"
    return (DTensor.from_local(gathered, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()]),)


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from kiln.parallel.tensor_parallel import MoETensorParallel

    kiln_gather = MoETensorParallel.__dict__["_gather_sequence"]
    cfg = gloo_rank_config(rank, world, port, args, "train.dtype=fp32", f"train.batch_size={args.rows}",
                           f"parallel.tp={world}", "parallel.dp_mode='ddp'", f"model.moe_experts={args.experts}",
                           "model.moe_top_k=2", "model.moe_every=1", f"model.moe_hidden={args.dim}",
                           "optim.implementation='auto'")
    dims = rank_dims(cfg, rank, world)
    tokens = torch.randint(0, args.vocab, (args.rows, 65), generator=torch.Generator().manual_seed(1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]  # every tp rank the same rows
    results = {v: {"step_s": [], "sent": [], "loss": None} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            gather = staticmethod(_gather_then_all_reduce) if variant == "all_reduce" else kiln_gather
            MoETensorParallel._gather_sequence = gather
            model, optimizer = trainer_model(cfg, dims)
            step_s, sent, loss, step = timed_train_steps(model, optimizer, batch, args.steps)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            results[variant]["c10d"] = dict(collections.Counter(e.name.removeprefix("c10d::").strip("_")
                                                                for e in prof.events() if e.name.startswith("c10d::")))
            results[variant]["step_s"].append(step_s)
            results[variant]["sent"].append(sent)
            results[variant]["loss"] = loss
    MoETensorParallel._gather_sequence = kiln_gather
    out.put({"rank": rank, "results": results})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", default="moe_tp_backward")
    args = parser.parse_args(argv)
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    rows, table = {}, []
    for tp in (int(t) for t in args.tp.split(",")):
        ranks = sorted(run_ranks(target, tp, (args,), f"moe_tp_backward tp {tp}", timeout_s=1800),
                       key=lambda r: r["rank"])  # (in the order they finished): the loss is rank 0's
        rows[f"tp{tp}"] = row = {}
        for v in VARIANTS:
            step = slowest_rank_median(ranks, lambda r: r["results"][v]["step_s"], args.rounds)
            sent = slowest_rank_median(ranks, lambda r: r["results"][v]["sent"], args.rounds)
            row[v] = {"step_s": step, "sent_bytes_per_rank": sent, "loss": ranks[0]["results"][v]["loss"],
                      "c10d_calls": ranks[0]["results"][v]["c10d"]}
        before, after = row["all_reduce"], row["reduce_scatter"]

        def calls(v):  # all-reduces and reduce-scatters (gloo's coalesced or base op)
            return "{} / {}".format(*(sum(n for op, n in v["c10d_calls"].items() if kind in op)
                                      for kind in ("allreduce", "reduce_scatter")))

        table.append([f"tp {tp}", f"{before['step_s']:.3f} / {after['step_s']:.3f}",
                      f"{before['sent_bytes_per_rank'] / 1e6:.2f} / {after['sent_bytes_per_rank'] / 1e6:.2f}",
                      f"{calls(before)}; {calls(after)}", f"{before['loss']:.5f} / {after['loss']:.5f}"])
    print("each cell: the all_reduce variant, then the reduce_scatter variant (kiln's)")
    print_table(["layout", "step s", "MB sent per rank (gloo)", "all-reduces / reduce-scatters per step", "loss"], table)
    command = "python benchmarks/moe_tp_backward.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'layouts': rows, 'load_avg': os.getloadavg()[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
