"""What the trainer's evaluation costs each rank: split over the layout (kiln/train/evaluate.py:
windows over data-parallel ranks, kiln/data/loader.py `rank_batches`; sequences over the cp ring)
against every rank scoring every window whole (how kiln evaluated before).

N gloo processes build kiln's transformer alike (the same weights), cut the same validation set
(`--windows` random-token windows of `--seq` tokens, spread as `eval_batches` spreads them) and
score it both ways with kiln's scorer (kiln/eval/scoring.py `score_batches`), alternating for
--rounds rounds. Layouts: `dp` (every rank a data-parallel rank: a 1/N block of the windows),
`cp` (every rank a cp rank: each window's zig-zag 1/N through ring attention) and `pp` (every
rank a pipeline stage, 1F1B's placement: each batch through the stages in micro-batches,
`--pp-microbatches`, 0: the training step's count, one per stage, against the whole batch as one,
how kiln evaluated under pp before; kiln/parallel/pipeline.py `_through_stages`). Per way:

- eval s: wall time of the whole evaluation, the slowest rank's (median over rounds);
- peak MiB: the most tensor bytes allocated at once during it, the largest rank's (torch's
  profiler memory events, in a separate profiled pass);
- loss: the evaluation's loss. Both ways must give the same (relative 1e-5), or the benchmark fails.

    python benchmarks/parallel_eval.py [--layouts dp,cp,pp] [--worlds 2] [--dim 384 --layers 6 --heads 6 --vocab 4096]
                                       [--seq 1024 --batch 4 --windows 16] [--window 0] [--pp-microbatches 0] [--rounds 3]

`--window W` gives every layer a sliding window of W (model.sliding_window): the cp ring then skips
the blocks wholly outside it, and the whole-sequence way runs kiln's blocked window attention.

Writes benchmarks/results/parallel_eval.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln (also in the spawned ranks)
sys.path.insert(1, str(Path(__file__).resolve().parent))
from common import join_gloo, paired_cells, print_table, run_ranks, write_results  # noqa: E402
from rank_measures import profiled_peak_bytes  # noqa: E402


def _rank(rank: int, world: int, port: int, layout: str, args, out) -> None:
    from kiln.config import load_config
    from kiln.data.loader import TokenWindows, eval_batches
    from kiln.eval.scoring import score_batches
    from kiln.model.transformer import Transformer
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.dims import ParallelDims

    join_gloo(rank, world, port)
    parallel = {"cp": [f"parallel.cp={world}"], "dp": ["parallel.dp_mode='ddp'"],
                "pp": [f"parallel.pp={world}", f"parallel.pp_microbatches={args.pp_microbatches}",
                       f"train.batch_size={args.batch}", "model.tie_embeddings=false"]}[layout]
    cfg = load_config(None, [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                             f"model.vocab_size={args.vocab}", f"data.seq_len={args.seq}",
                             f"model.max_seq_len={args.seq}", f"model.sliding_window={args.window}", *parallel])
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world, seq_len=args.seq)
    dims.build_mesh("cpu")
    if layout == "pp":  # this rank's stage of the same weights (the trainer's build)
        from kiln.parallel.pipeline import Pipeline, PipelineEvalModel
        from kiln.train.trainer import build_model

        pipeline = Pipeline(build_model(cfg, dims, torch.device("cpu")), cfg, dims, torch.device("cpu"))
    else:
        model = Transformer(cfg.model)
        model.init_weights(torch.Generator().manual_seed(0))
    tokens = np.random.default_rng(1).integers(0, args.vocab, args.windows * args.seq + 1)
    windows = TokenWindows([tokens.astype(np.int64)], args.seq)
    byte_lengths = torch.ones(args.vocab, dtype=torch.int64)
    context, group = None, None
    if layout == "pp":  # every window through the stages: micro-batched, or each batch as one
        batches = list(eval_batches(windows, args.batch, args.windows // args.batch))
        split, whole = PipelineEvalModel(pipeline), PipelineEvalModel(pipeline, microbatches=1)
        ways = {"split": lambda: score_batches(split, batches, byte_lengths),
                "whole": lambda: score_batches(whole, batches, byte_lengths)}
    elif layout == "cp":  # every window, this rank's zig-zag slice of it
        context, group = ContextParallel(model, dims, args.seq, torch.device("cpu")), dist.group.WORLD
        split = list(eval_batches(windows, args.batch, args.windows // args.batch))
    else:  # this rank's block of the windows: batch x world x eval_batches = --windows
        group = dist.group.WORLD
        split = list(eval_batches(windows, args.batch, args.windows // (args.batch * world), (rank, world)))
    if layout != "pp":
        whole = list(eval_batches(windows, args.batch * (1 if layout == "cp" else world),
                                  args.windows // (args.batch * (1 if layout == "cp" else world))))
        ways = {"split": lambda: score_batches(model, split, byte_lengths, context=context, group=group),
                "whole": lambda: score_batches(model, whole, byte_lengths)}
    rows = []
    for round_ in range(args.rounds):
        for way, run in (ways.items() if round_ % 2 == 0 else reversed(ways.items())):
            dist.barrier()
            t0 = time.perf_counter()
            loss = run()["loss"]
            rows.append({"way": way, "round": round_, "eval_s": time.perf_counter() - t0, "loss": loss})
    peaks = {}
    for way, run in ways.items():
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        peaks[way] = profiled_peak_bytes(prof)
    out.put({"rank": rank, "rows": rows, "peaks": peaks})
    dist.barrier()
    dist.destroy_process_group()


def measure(layout: str, world: int, args) -> dict:
    target = importlib.import_module(Path(__file__).stem)._rank  # by module name: spawned ranks import it
    results = run_ranks(target, world, (layout, args), f"parallel_eval {layout} x{world}")
    summary = {"layout": layout, "world": world}
    for way in ("split", "whole"):
        rows = [row for r in results for row in r["rows"] if row["way"] == way]
        per_round = [max(row["eval_s"] for row in rows if row["round"] == k) for k in range(args.rounds)]
        summary[way] = {"eval_s": statistics.median(per_round), "eval_s_rounds": per_round,
                        "peak_bytes": max(r["peaks"][way] for r in results), "loss": rows[0]["loss"]}
    if abs(summary["split"]["loss"] - summary["whole"]["loss"]) > 1e-5 * abs(summary["whole"]["loss"]):
        raise SystemExit(f"parallel_eval {layout} x{world}: split loss {summary['split']['loss']} != "
                         f"whole {summary['whole']['loss']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dp,cp")
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--windows", type=int, default=16, help="validation windows (a multiple of batch x world)")
    ap.add_argument("--window", type=int, default=0, help="model.sliding_window (0: full attention)")
    ap.add_argument("--pp-microbatches", type=int, default=0, help="pp: micro-batches per batch (0: one per stage)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="parallel_eval")
    args = ap.parse_args(argv)
    summaries = [measure(layout, int(w), args) for layout in args.layouts.split(",") for w in args.worlds.split(",")]
    mb = 1 / 2**20
    fields = (("eval_s", 1, 3), ("peak_bytes", mb, 1))
    table = [[s["layout"], s["world"], *paired_cells(s["split"], s["whole"], fields),
              round(s["whole"]["eval_s"] / s["split"]["eval_s"], 2)] for s in summaries]
    print_table(["layout", "ranks", "eval s", "peak MiB", "speedup"], table)
    print("(each cell: split / whole, per rank: the slowest rank's seconds, the largest rank's peak)")
    command = "python benchmarks/parallel_eval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    sizes = {k: getattr(args, k) for k in ("dim", "layers", "heads", "vocab", "seq", "batch", "windows", "window",
                                           "pp_microbatches", "rounds")}
    print(f"wrote {write_results(args.out, {'command': command, **sizes, 'rows': summaries})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
