"""DiLoCo's outer syncs, whole or streamed (kiln/parallel/diloco.py): what crosses the link between
replicas per step and at the peak, and how long the loop waits for it.

2 gloo processes (2 whole DiLoCo replicas, one thread each) train kiln's transformer (--dim,
--layers, --heads, --vocab; AdamW, foreach) on fixed random tokens, 4 rows of 64 per replica, with
H = --inner-steps. Variants, built afresh and run in alternating order each round:

  diloco            every H steps one fp32 all-reduce of all parameters (Douillard et al. 2023)
  fragments         Streaming DiLoCo's P = --fragments fragments (strided), one every H / P steps
  fragments_bf16    the same, the outer gradient in bfloat16 on the wire
  fragments_fp8     the same in float8 (e4m3, a scale per 256 elements), all-gathered
  overlapped_bf16   the same, each exchange started one inner step before its merge (tau = 1)

Each round runs 2 H steps per variant. Reported per variant (median over rounds, slowest rank):
the step time; the time the loop spends in DiLoCo's calls (`after_step`: the blocking exchange,
the outer step, the merge) per step; the bytes this process wrote to its sockets per step on
average and in the step that wrote most (/proc/self/io wchar: the peak a slow link must carry
at once); the loss of the last step of round 1 (a sanity check: the variants train alike).

    python benchmarks/diloco_streaming.py [--rounds 3] [--inner-steps 8] [--fragments 4]
        [--dim 384 --layers 8 --heads 6 --vocab 4096]

Writes benchmarks/results/diloco_streaming.json (or --out) and prints a table.
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
from common import gloo_rank_config, print_table, run_ranks, slowest_rank_median, socket_bytes, write_results  # noqa: E402

VARIANTS = ("diloco", "fragments", "fragments_bf16", "fragments_fp8", "overlapped_bf16")


def settings(variant: str, fragments: int) -> dict:
    return {"diloco": {}, "fragments": {"fragments": fragments},
            "fragments_bf16": {"fragments": fragments, "comm_dtype": "bfloat16"},
            "fragments_fp8": {"fragments": fragments, "comm_dtype": "float8_e4m3fn"},
            "overlapped_bf16": {"fragments": fragments, "comm_dtype": "bfloat16", "sync_delay": 1}}[variant]


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    import torch.distributed as dist

    from kiln.model.transformer import Transformer
    from kiln.parallel.diloco import DiLoCo
    from kiln.train.optim import build_optimizer

    cfg = gloo_rank_config(rank, world, port, args)
    steps = 2 * args.inner_steps
    tokens = torch.randint(0, args.vocab, (steps, 4, 65), generator=torch.Generator().manual_seed(1 + rank))
    step_s, outer_s, mean_bytes, peak_bytes, last_loss = ({v: [] for v in VARIANTS} for _ in range(5))
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            model = Transformer(cfg.model)
            model.init_weights(torch.Generator().manual_seed(0))
            optimizer = build_optimizer(model, cfg.optim, "cpu")
            diloco = DiLoCo(model, args.inner_steps, n_layers=args.layers, **settings(variant, args.fragments))
            times, outer, sent = [], 0.0, []
            dist.barrier()
            for step in range(1, steps + 1):
                w0, b0 = time.perf_counter(), socket_bytes()
                batch = tokens[step - 1]
                loss = model(batch[:, :-1], batch[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                o0 = time.perf_counter()
                diloco.after_step(step)
                outer += time.perf_counter() - o0
                times.append(time.perf_counter() - w0)
                sent.append(socket_bytes() - b0)
            diloco.settle()
            step_s[variant].append(statistics.median(times))
            outer_s[variant].append(outer / steps)
            mean_bytes[variant].append(sum(sent) / steps)
            peak_bytes[variant].append(max(sent))
            last_loss[variant].append(float(loss.detach()))
    out.put({"rank": rank, "step_s": step_s, "outer_s": outer_s, "mean_bytes": mean_bytes, "peak_bytes": peak_bytes,
             "loss": {v: losses[0] for v, losses in last_loss.items()},
             "params": sum(p.numel() for p in model.parameters())})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", default="diloco_streaming")
    args = parser.parse_args(argv)
    if args.inner_steps % args.fragments or args.inner_steps // args.fragments < 2 or args.fragments > args.layers:
        parser.error(f"--fragments {args.fragments} must divide --inner-steps {args.inner_steps} at most "
                     f"half-way (the overlapped variant's delay 1 < H / P) and be at most --layers {args.layers}")
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    ranks = run_ranks(target, 2, (args,), "diloco_streaming", timeout_s=1800)

    def slowest(key: str, variant: str) -> float:
        return slowest_rank_median(ranks, lambda r: r[key][variant], args.rounds)

    rows, table = {}, []
    for v in VARIANTS:
        rows[v] = {key: slowest(key, v) for key in ("step_s", "outer_s", "mean_bytes", "peak_bytes")}
        rows[v]["loss"] = max(r["loss"][v] for r in ranks)
        row = rows[v]
        table.append([v, f"{row['step_s']:.3f}", f"{row['outer_s'] * 1e3:.1f}", f"{row['mean_bytes'] / 1e6:.2f}",
                      f"{row['peak_bytes'] / 1e6:.2f}", f"{row['loss']:.4f}"])
    print_table(["variant", "step s", "DiLoCo ms per step", "MB sent per step", "peak MB in a step", "loss"], table)
    command = "python benchmarks/diloco_streaming.py " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"command": command, "args": vars(args), "params": ranks[0]["params"], "variants": rows,
               "load_avg": os.getloadavg()[0]}
    print(f"wrote {write_results(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
