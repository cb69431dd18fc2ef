"""How evenly an MoE spreads its tokens under each way of balancing it, and what it costs: the same
model and data trained with no balancing term, the load-balancing loss (Switch / GShard, kiln's
default weight 0.01), and DeepSeek-V3's auxiliary-loss-free expert bias (model.moe_bias_update_rate)
at two rates, all with a sigmoid top-2 router, dropless (so the load decides the slowest expert's
work, what an expert-parallel step waits for).

Each recipe is one `kiln train` process (the run directories stay under --workdir). Reported per
recipe: `moe_max_load` (the step's largest expert load over all layers, relative to the layer's
mean; 1.0 = even) averaged over the last third of the steps and at the last step, the final
validation loss, and the median step time (ms) with its ratio to the no-balancing recipe in the
same invocation (the bias update is one all-reduce of layers x experts counts and a few tiny ops).

    python benchmarks/moe_balancing.py [--data ../shared/data/tinyshakespeare.txt] [--steps 300]
        [--out benchmarks/results/moe_balancing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from common import print_table, write_results  # noqa: E402

RECIPES = {
    "none": ["model.moe_aux_loss_weight=0.0"],
    "aux loss 0.01": ["model.moe_aux_loss_weight=0.01"],
    "bias 0.001": ["model.moe_aux_loss_weight=0.0", "model.moe_bias_update_rate=0.001"],
    "bias 0.01": ["model.moe_aux_loss_weight=0.0", "model.moe_bias_update_rate=0.01"],
}


def overrides(data: str, steps: int, quick: bool) -> list[str]:
    size = (["model.dim=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=32", "train.batch_size=2"]
            if quick else ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "data.seq_len=128",
                           "train.batch_size=8"])
    return size + [f"data.source={data!r}", "data.tokenizer=byte", "data.max_bytes=0", f"train.steps={steps}",
                   f"train.eval_every={steps}", "train.eval_batches=8", "checkpoint.every=0", "train.dtype=fp32",
                   "train.device=cpu", "metrics.progress=none", "metrics.peak_flops=1e11", "optim.lr=3e-3",
                   "schedule.warmup_steps=20", "model.moe_experts=16", "model.moe_top_k=2",
                   "model.moe_capacity_factor=0.0", "model.moe_router=sigmoid", "model.moe_z_loss_weight=0.001",
                   "train.seed=0"]


def run(name: str, sets: list[str], workdir: Path) -> dict:
    from kiln.config import load_config
    from kiln.train.trainer import train

    run_dir = workdir / name.replace(" ", "_")
    train(load_config(None, sets), run_dir, resume=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    tail = steps[-max(1, len(steps) // 3):]
    evals = [r for r in rows if r["kind"] == "eval"]
    return {"max_load_last_third": statistics.mean(r["moe_max_load"] for r in tail),
            "max_load_last": steps[-1]["moe_max_load"], "val_loss": evals[-1]["val_loss"] if evals else None,
            "step_ms": statistics.median(r["step_ms"] for r in steps[len(steps) // 10:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="a tiny model, for the smoke test")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default="moe_balancing")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-moe-balancing-"))
    # one-time costs (imports, the allocator's first growth) in an unreported run, not in the first recipe's
    run("warm-up", overrides(args.data, min(args.steps, 20), args.quick), workdir)
    results = {name: run(name, overrides(args.data, args.steps, args.quick) + extra, workdir)
               for name, extra in RECIPES.items()}
    base = results["none"]["step_ms"]
    rows = [[name, r["max_load_last_third"], r["max_load_last"], r["val_loss"], r["step_ms"], r["step_ms"] / base]
            for name, r in results.items()]
    print_table(["recipe", "max load (last third)", "max load (last)", "val loss", "step ms", "vs none"], rows)
    command = "python benchmarks/moe_balancing.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_results(args.out, {'command': command, 'steps': args.steps, 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
