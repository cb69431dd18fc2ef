"""FSDP2's units outside the blocks: kiln before (one root unit holding the embedding, the final
norm and the head, resharded after forward as the blocks are) vs kiln now
(kiln/parallel/parallelize.py apply_fsdp: an untied embedding is a unit of its own, resharded
after its forward and not gathered for backward, whose embedding gradient needs no weight; the
root holds the head and final norm and stays gathered from forward into backward).

N gloo processes (one thread each) build kiln's transformer through the trainer's path
(`build_model` -> parallelize, `build_optimizer`; --dim, --layers, --heads, --vocab) and take
AdamW (foreach) steps of 2 rows x 64 tokens per rank through kiln's `train_step`. Layouts, each on
--ranks ranks: fsdp with an untied and with a tied embedding, zero2 with an untied one. Variants,
built afresh and run in alternating order each round:

  root    kiln before: `own_embedding_unit` patched to give none, and the root resharded after
          forward under fsdp (what `reshard_after_forward=True` made it from torch 2.9 on;
          zero2 kept it)
  units   kiln's

Reported per layout and variant: the step time (median over --steps steps, median over rounds
of the slowest rank), the bytes each rank wrote to its sockets per step (/proc/self/io wchar),
the most tensor bytes live at once during a profiled step on rank 0 above what was live before
it (median over --profiled steps in each round: a step's figure varies by a few MB from one step
to the next, the allocator events of gloo's threads interleaving differently), and rank 0's loss
after the timed steps (equal in both variants: the same math).

    python benchmarks/fsdp_units.py [--ranks 2] [--rounds 3] [--steps 3] [--profiled 5] [--dim 256 --layers 4 --vocab 8192]

Writes benchmarks/results/fsdp_units.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import (gloo_rank_config, print_table, rank_dims, run_ranks, slowest_rank_median,  # noqa: E402
                    timed_train_steps, write_results)
from rank_measures import profiled_peak_bytes  # noqa: E402

VARIANTS = ("root", "units")
LAYOUTS = {"fsdp untied": ["parallel.dp_mode='fsdp'", "model.tie_embeddings=false"],
           "fsdp tied": ["parallel.dp_mode='fsdp'", "model.tie_embeddings=true"],
           "zero2 untied": ["parallel.dp_mode='zero2'", "model.tie_embeddings=false"]}


def build(cfg, dims, variant: str):
    """kiln's model, optimizer under `variant` ("root": kiln's layout before the embedding unit)."""
    import kiln.parallel.parallelize as parallelize
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.torch_compat import fsdp_set_reshard_after_forward
    from kiln.train.optim import build_optimizer
    from kiln.train.system import resolve_loss
    from kiln.train.trainer import build_model

    device = torch.device("cpu")
    real = parallelize.own_embedding_unit
    if variant == "root":
        parallelize.own_embedding_unit = lambda model: []
    try:
        torch.manual_seed(0)
        model = build_model(cfg, dims, device)
    finally:
        parallelize.own_embedding_unit = real
    if variant == "root" and dims.dp_mode == "fsdp":
        fsdp_set_reshard_after_forward(model, True, recurse=False)
    model.loss_impl = resolve_loss(cfg.train.loss, device, False, tp=dims.tp)
    return model, shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)


def rank_main(rank: int, world: int, port: int, layout: str, args, out) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile


    cfg = gloo_rank_config(rank, world, port, args, "train.dtype=fp32", "train.batch_size=2", *LAYOUTS[layout])
    dims = rank_dims(cfg, rank, world)
    tokens = torch.randint(0, args.vocab, (2, 65), generator=torch.Generator().manual_seed(1 + rank))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    results = {v: {"step_s": [], "sent": [], "peak": [], "loss": None} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            model, optimizer = build(cfg, dims, variant)
            step_s, sent, loss, step = timed_train_steps(model, optimizer, batch, args.steps)
            results[variant]["step_s"].append(step_s)
            results[variant]["sent"].append(sent)
            results[variant]["loss"] = loss
            for _ in range(args.profiled):
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    step()
                results[variant]["peak"].append(profiled_peak_bytes(prof))
    out.put({"rank": rank, "results": results})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profiled", type=int, default=5, choices=range(1, 101), metavar="N",
                        help="profiled steps per round and variant (peak bytes)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", default="fsdp_units")
    args = parser.parse_args(argv)
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    rows, table = {}, []
    for layout in LAYOUTS:
        ranks = sorted(run_ranks(target, args.ranks, (layout, args), f"fsdp_units {layout}", timeout_s=1800),
                       key=lambda r: r["rank"])  # (in the order they finished)
        rows[layout] = {}
        for v in VARIANTS:
            res = [r["results"][v] for r in ranks]
            rows[layout][v] = {
                "step_s": slowest_rank_median(res, lambda x: x["step_s"], args.rounds),
                "sent_bytes_per_rank": slowest_rank_median(res, lambda x: x["sent"], args.rounds),
                "peak_bytes_rank0": statistics.median(ranks[0]["results"][v]["peak"]),
                "peak_bytes_rank0_all": ranks[0]["results"][v]["peak"], "loss_rank0": res[0]["loss"]}
        before, now = rows[layout]["root"], rows[layout]["units"]
        table.append([f"{layout} x{args.ranks}", f"{before['step_s']:.3f} / {now['step_s']:.3f}",
                      f"{before['sent_bytes_per_rank'] / 1e6:.2f} / {now['sent_bytes_per_rank'] / 1e6:.2f}",
                      f"{before['peak_bytes_rank0'] / 1e6:.2f} / {now['peak_bytes_rank0'] / 1e6:.2f}",
                      f"{before['loss_rank0']:.6f} / {now['loss_rank0']:.6f}"])
    print_table(["layout", "step s: root / units", "MB sent per rank: root / units",
                 "peak MB in a step: root / units", "rank 0's loss: root / units"], table)
    command = "python benchmarks/fsdp_units.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'layouts': rows, 'load_avg': os.getloadavg()[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
