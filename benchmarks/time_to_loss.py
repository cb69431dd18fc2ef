"""Time to a target validation loss: kiln's default recipe against a GPT-2-style baseline.

Both runs go through `kiln.train.trainer.train` on the same corpus with the byte tokenizer and
model sizes chosen for (about) the same parameter count; only the recipe differs:

- default: kiln's JobConfig defaults (RMSNorm, SwiGLU, RoPE, gpt2 init, AdamW lr 3e-3, cosine).
- baseline: GPT-2 style as nanoGPT's shakespeare-char recipe trains it (LayerNorm, GeLU, learned
  positions, normal(0.02) init, AdamW lr 1e-3 betas (0.9, 0.99), warmup 100, cosine).

Runs go in child processes side by side, one torch thread each, so load from other processes hits
both alike; the parent watches metrics.jsonl and stops a child once its val_loss reached the
target. Time to target = time of the first eval row with val_loss <= target minus the run row's
time, less the time spent in evaluations before it (eval row time minus the train row before it).
CPU seconds of the child over the same span (evaluations included) are reported beside it.

    python benchmarks/time_to_loss.py CORPUS [--target 2.0] [--params 800000] [--quick]
    python benchmarks/time_to_loss.py /work/shared/data/tinyshakespeare.txt

Prints a table and writes benchmarks/results/time_to_loss.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from common import print_table, train_in_child, write_results  # noqa: E402

from kiln.config import JobConfig, load_config  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.model.transformer import Transformer, count_params  # noqa: E402

BYTE_VOCAB = 256
LADDER = (2.6, 2.4, 2.2, 2.1, 2.0, 1.9, 1.8, 1.7, 1.6)  # intermediate targets, also reported

RECIPES: dict[str, list[str]] = {
    "default": [],
    "baseline": ["model.norm=layernorm", "model.activation=gelu", "model.positions=learned",
                 "model.init=normal", "optim.lr=1e-3", "optim.betas=[0.9, 0.99]",
                 "schedule.name=cosine", "schedule.warmup_steps=100"],
}


def size_for_params(target: int, n_layers: int, overrides: list[str]) -> tuple[int, int]:
    """(dim, parameter count) for the dim (multiple of 32, head_dim 32) nearest `target` params."""
    best: tuple[int, int] | None = None
    for dim in range(64, 1025, 32):
        cfg = load_config(None, overrides + [f"model.dim={dim}", f"model.n_layers={n_layers}",
                                             f"model.n_heads={dim // 32}", f"model.vocab_size={BYTE_VOCAB}"])
        with torch.device("meta"):
            n = count_params(Transformer(cfg.model))["total"]
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (dim, n)
    assert best is not None
    return best


def job_overrides(corpus: str, recipe: list[str], dim: int, n_layers: int, steps: int, eval_every: int,
                  eval_batches: int, threads: int) -> list[str]:
    return recipe + [
        f"data.source={corpus}", "data.tokenizer=byte", "data.val_fraction=0.1", "data.max_bytes=0",
        f"model.dim={dim}", f"model.n_layers={n_layers}", f"model.n_heads={dim // 32}",
        f"train.steps={steps}", f"train.eval_every={eval_every}", f"train.eval_batches={eval_batches}",
        f"train.threads={threads}", "train.device=cpu", "checkpoint.every=0", "checkpoint.save_final=false",
        "metrics.progress=none",
    ]


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def crossing(rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """Time/step of the first eval row with val_loss <= target, evaluation time excluded."""
    run = next((r for r in rows if r["kind"] == "run"), None)
    if run is None:
        return None
    eval_s, last_train_time = 0.0, run["time"]
    for row in rows:
        if row["kind"] == "train":
            last_train_time = row["time"]
        elif row["kind"] == "eval":
            eval_s += row["time"] - last_train_time
            if row["val_loss"] <= target:
                return {"step": row["step"], "val_loss": row["val_loss"],
                        "train_wall_s": row["time"] - run["time"] - eval_s, "eval_wall_s": eval_s,
                        "wall_s_with_evals": row["time"] - run["time"]}
    return None


def run_recipes(corpus: str, recipes: dict[str, list[str]], args, workdir: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # a clean interpreter per run: no state shared with the parent
    runs: dict[str, dict[str, Any]] = {}
    for name, recipe in recipes.items():
        dim, n_params = size_for_params(args.params, args.layers, recipe)
        overrides = job_overrides(corpus, recipe, dim, args.layers, args.steps, args.eval_every,
                                  args.eval_batches, args.threads)
        run_dir = workdir / name
        proc = ctx.Process(target=train_in_child, args=(overrides, str(run_dir)), daemon=True)
        proc.start()
        runs[name] = {"proc": proc, "ps": psutil.Process(proc.pid), "dir": run_dir, "dim": dim,
                      "n_params": n_params, "overrides": overrides, "cpu_at_run": None, "cpu_at_target": None, "cpu_at": {}}
    deadline = time.monotonic() + args.max_minutes * 60
    try:
        while any(r["proc"].is_alive() for r in runs.values()) and time.monotonic() < deadline:
            time.sleep(0.25)
            for name, r in runs.items():
                if not r["proc"].is_alive() or r["cpu_at_target"] is not None:
                    continue
                rows = read_rows(r["dir"] / "metrics.jsonl")
                cpu = _cpu_s(r["ps"])
                if r["cpu_at_run"] is None and any(x["kind"] == "run" for x in rows):
                    r["cpu_at_run"] = cpu
                for t in LADDER:  # CPU-seconds at the intermediate targets too
                    if t > args.target and t not in r["cpu_at"] and crossing(rows, t) is not None:
                        r["cpu_at"][t] = cpu
                if crossing(rows, args.target) is not None:
                    r["cpu_at_target"] = r["cpu_at"][args.target] = cpu
                    r["proc"].terminate()  # reached the target: its core goes to the other run
    finally:
        for r in runs.values():
            if r["proc"].is_alive():
                r["proc"].terminate()
            r["proc"].join(timeout=30)
    out = {}
    for name, r in runs.items():
        rows = read_rows(r["dir"] / "metrics.jsonl")
        run_row = next((x for x in rows if x["kind"] == "run"), {})
        hit = crossing(rows, args.target)
        cpu = (r["cpu_at_target"] - r["cpu_at_run"]) if hit and r["cpu_at_run"] is not None else None
        train_rows = [x for x in rows if x["kind"] == "train"]
        out[name] = {"dim": r["dim"], "n_layers": args.layers, "n_params": run_row.get("n_params", r["n_params"]),
                     "overrides": r["overrides"], "reached": hit, "cpu_s_to_target": cpu,
                     "median_step_ms": _median([x["step_ms"] for x in train_rows]),
                     "curve": [(x["step"], round(x["val_loss"], 4)) for x in rows if x["kind"] == "eval"],
                     "train_wall_s_to": {str(t): (c or {}).get("train_wall_s") for t in LADDER
                                         if t >= args.target for c in [crossing(rows, t)]},
                     "cpu_s_to": {str(t): (c - r["cpu_at_run"]) if c is not None and r["cpu_at_run"] is not None
                                  else None for t, c in sorted(r["cpu_at"].items(), reverse=True)},
                     "exit_code": r["proc"].exitcode}
    return out


def _cpu_s(ps: psutil.Process) -> float | None:
    try:
        t = ps.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", help="a text file (one document: the last 10%% is validation)")
    ap.add_argument("--target", type=float, default=2.0, help="validation loss (nats/byte) to reach")
    ap.add_argument("--params", type=int, default=800_000, help="parameter count of both models")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600, help="train.steps (the schedules span this)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (runs go side by side)")
    ap.add_argument("--max-minutes", type=float, default=12.0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=V,KEY=V",
                    help="also run kiln defaults with these overrides (for a recipe search)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run; figures are noise")
    ap.add_argument("--out", default="time_to_loss", help="results/NAME.json, or a path ending in .json")
    args = ap.parse_args(argv)
    if not Path(args.corpus).is_file():
        raise KilnError(f"{args.corpus}: corpus file not found")
    if args.quick:
        args.params, args.layers, args.steps, args.eval_every, args.eval_batches = 30_000, 1, 6, 3, 1
        args.target, args.max_minutes = 100.0, 2.0
    recipes = dict(RECIPES)
    if args.no_baseline:
        del recipes["baseline"]
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        recipes[name] = [s for s in sets.split(",") if s]

    # SIGTERM -> SystemExit, so the finally below stops the child runs instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kiln-ttl-") as tmp:
        t0 = time.perf_counter()
        runs = run_recipes(args.corpus, recipes, args, Path(tmp))
        total_s = time.perf_counter() - t0
    base = runs.get("baseline", {}).get("reached")
    rows = []
    for name, r in runs.items():
        hit = r["reached"]
        ratio = hit["train_wall_s"] / base["train_wall_s"] if hit and base else None
        rows.append([name, f"{r['n_params'] / 1e6:.3f}M", r["dim"], r["median_step_ms"],
                     hit["step"] if hit else "-", hit["train_wall_s"] if hit else "-",
                     r["cpu_s_to_target"] if r["cpu_s_to_target"] is not None else "-",
                     f"{ratio:.2f}x" if ratio else "-", r["curve"][-1][1] if r["curve"] else "-"])
        r["wall_ratio_vs_baseline"] = ratio
    print(f"\ntarget val_loss {args.target} on {args.corpus} (byte tokenizer), {args.threads} thread(s) per run")
    print_table(["recipe", "params", "dim", "step ms", "step@target", "wall s", "CPU s", "vs baseline",
                 "last val"], rows)
    path = write_results(args.out, {
        "command": "python benchmarks/time_to_loss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "corpus": args.corpus, "target": args.target, "params": args.params, "steps": args.steps,
        "eval_every": args.eval_every, "eval_batches": args.eval_batches, "threads_per_run": args.threads,
        "total_s": total_s, "runs": runs})
    print(f"wrote {path} ({total_s:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
