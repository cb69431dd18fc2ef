"""DDP's gradients as views into its all-reduce buckets (`gradient_as_bucket_view=True`, kiln's
ddp and zero1) against DDP's default, where every gradient also has a copy in a bucket.

N gloo processes (one thread each) per variant build kiln's transformer through the trainer's path
(`build_model` -> parallelize with dp_mode ddp, `build_optimizer`), take --steps fp32 AdamW steps of
--rows rows x 64 tokens through kiln's `train_step`, and report their resident memory
(/proc/self/status VmRSS after the steps, and the peak VmHWM) and the step time (median of the
steps, the slower rank). `copy` is DDP's default (`gradient_as_bucket_view=False`, kiln before:
DistributedDataParallel's constructor patched to it for the run), `view` is kiln's. Each variant runs in
fresh processes (resident memory is per process), alternating over --rounds.

    python benchmarks/ddp_grad_buckets.py [--world 2] [--rounds 2] [--steps 3] [--dim 512] [--layers 8]

Writes benchmarks/results/ddp_grad_buckets.json (or --out) and prints a table.
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
from common import (gloo_rank_config, print_table, rank_dims, run_ranks, timed_train_steps,  # noqa: E402
                    trainer_model, write_results)

VARIANTS = ("copy", "view")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def rank_main(rank: int, world: int, port: int, args, variant: str, out) -> None:
    import torch.distributed as dist

    if variant == "copy":  # DDP's default: a bucket copy of every gradient (the class composable
        # `replicate` builds)
        from torch.nn.parallel import DistributedDataParallel

        kiln_init = DistributedDataParallel.__init__
        DistributedDataParallel.__init__ = lambda self, *a, **kw: kiln_init(
            self, *a, **{**kw, "gradient_as_bucket_view": False})
    cfg = gloo_rank_config(rank, world, port, args, "train.dtype=fp32", f"train.batch_size={args.rows}",
                           "parallel.dp_mode='ddp'")
    model, optimizer = trainer_model(cfg, rank_dims(cfg, rank, world))
    tokens = torch.randint(0, args.vocab, (args.rows * world, 65), generator=torch.Generator().manual_seed(1))
    rows = tokens[rank * args.rows:(rank + 1) * args.rows]
    step_s, _, loss, _ = timed_train_steps(model, optimizer, [(rows[:, :-1], rows[:, 1:])], args.steps)
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    out.put({"rank": rank, "rss_mib": _status_mib("VmRSS"), "peak_mib": _status_mib("VmHWM"), "step_s": step_s,
             "loss": loss, "param_mib": params})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", default="ddp_grad_buckets")
    args = parser.parse_args(argv)
    target = importlib.import_module(Path(__file__).stem).rank_main  # by module name: spawned ranks import it
    runs = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(run_ranks(target, args.world, (args, variant), f"ddp_grad_buckets {variant}",
                                           timeout_s=1800))
    rows = {}
    for v in VARIANTS:  # per round the larger rank's figure, then the median over rounds
        rows[v] = {key: statistics.median(max(rank[key] for rank in ranks) for ranks in runs[v])
                   for key in ("rss_mib", "peak_mib", "step_s")}
        rows[v]["loss"] = min(runs[v][-1], key=lambda rank: rank["rank"])["loss"]
        rows[v]["param_mib"] = runs[v][-1][0]["param_mib"]
    copy, view = rows["copy"], rows["view"]
    print(f"parameters {view['param_mib']:.1f} MiB (fp32 gradients as much) per rank, {args.world} ranks")
    print_table(["variant", "resident MiB after steps", "peak MiB", "step s", "loss"],
                [[v, f"{rows[v]['rss_mib']:.1f}", f"{rows[v]['peak_mib']:.1f}", f"{rows[v]['step_s']:.3f}",
                  f"{rows[v]['loss']:.5f}"] for v in VARIANTS])
    print(f"view saves {copy['rss_mib'] - view['rss_mib']:.1f} MiB resident, {copy['peak_mib'] - view['peak_mib']:.1f} MiB peak")
    command = "python benchmarks/ddp_grad_buckets.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'args': vars(args), 'variants': rows, 'load_avg': os.getloadavg()[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
