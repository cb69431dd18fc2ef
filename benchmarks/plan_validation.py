"""`kiln plan`'s memory and time models against measured kiln runs.

Measurements: benchmarks/results/parallel_memory.json, written by benchmarks/parallel_memory.py
(kiln's own build_model -> parallelize -> shard_optimizer_state path, gloo, fp32, AdamW; exact
per-rank tensor bytes of parameters, gradients and optimizer state, the parameters held between
forward and backward, and the median step time of the slowest rank) for 1 process and for
ddp / zero1 / zero2 / fsdp at 2 and 4 processes: 9 layouts. Rerun that script first to refresh them.

Memory: kiln/plan/memory.py `rank_memory` (no fitting), twice: (a) parameters + gradients +
optimizer state at rest on the largest rank (exact tensor bytes); (b) the peak with activations:
(a) with the parameters held from forward to backward, plus the bytes autograd saves for backward
(results/activation_bytes.json: parallel_memory.py's saved-tensor count at 1 process for each
per-rank batch; what autograd saves does not depend on the data-parallel mode, whose parameters
the count excludes), against rank_memory's total less its communication buffers.

Time: kiln/plan/timing.py `step_time` on the cpu-local cluster preset, with the efficiency curve
(max_efficiency, half_efficiency_work) and link bandwidth fitted by least squares on log time
(kiln/plan/calibrate.py `fit_cluster`) with the overlap efficiency; each process of a
multi-process run gets min(1, cores / processes) of a core (CORE_GRID, FIXED_OVERLAP: a fitted
core count and a zero overlap were tried and fit worse), applied here and in the search below,
not in the planner. Leave-one-out: each layout is predicted from a fit to the
other eight, never to itself.

    python benchmarks/plan_validation.py [--results benchmarks/results/parallel_memory.json]

Prints a markdown table and writes benchmarks/results/plan_validation.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR  # noqa: E402

from kiln.config import ModelConfig  # noqa: E402
from kiln.plan.calibrate import Measurement, fit_cluster, fit_error, predicted_step  # noqa: E402
from kiln.plan.cluster import load_cluster  # noqa: E402
from kiln.plan.memory import Layout, ModelShape, rank_memory  # noqa: E402
from kiln.plan.timing import step_time  # noqa: E402

# benchmarks/parallel_memory.py defaults (the results file records only the command)
DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 384, 6, 6, 4096, 128, 8
CORES = 2
# Effective cores the processes share (each of N processes gets min(1, cores / N) of a core).
# Fitting it over (0.5, 0.75, 1, 1.25, 1.5, 2) with overlap fixed at 0 (gloo has no spare cores
# to overlap on) was tried: 2 of 9 layouts within 25% instead of 4 (benchmarks/README.md), so the
# physical core count and a fitted overlap stay. Both knobs are kept to rerun that comparison.
CORE_GRID = (CORES,)
FIXED_OVERLAP = None  # 0.0: the gloo-hides-nothing variant


def layout_for(mode: str, world: int) -> Layout:
    per_rank = BATCH // world
    if mode in ("ddp", "zero1") or world == 1:
        return Layout(dp_replicate=world, dp_shard=1, dp_mode=mode if world > 1 else "ddp", micro_batch=per_rank,
                      precision="fp32")
    return Layout(dp_replicate=1, dp_shard=world, dp_mode=mode, micro_batch=per_rank, precision="fp32")


def share_for(cores: float):
    return lambda layout: min(1.0, cores / layout.world_size)


def fit(cluster, cases):
    """The cluster and effective cores (from CORE_GRID) that best explain `cases`."""
    best = None
    for cores in CORE_GRID:
        fitted = fit_cluster(cluster, cases, share_for(cores), overlap=FIXED_OVERLAP)
        err = fit_error(fitted, cases, share_for(cores))
        if best is None or err < best[0]:
            best = (err, fitted, cores)
    return best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS_DIR / "parallel_memory.json"))
    ap.add_argument("--activations", default=str(RESULTS_DIR / "activation_bytes.json"),
                    help="bytes autograd saves per forward, by per-rank batch (parallel_memory.py 'activations')")
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
    saved = {int(k): v for k, v in json.loads(Path(args.activations).read_text())["by_batch"].items()}
    model = ModelConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, vocab_size=VOCAB, max_seq_len=SEQ)
    shape = ModelShape.from_config(model, VOCAB)
    assert shape.params == data["single"]["n_params"], "benchmark model shape changed; update the constants"
    runs = [("single", 1, [data["single"]])] + [(r["mode"], r["world"], r["per_rank"]) for r in data["runs"]]
    cases = [Measurement(f"{m} x{w}", shape, layout_for(m, w), SEQ, max(p["step_s"] for p in ranks))
             for m, w, ranks in runs]
    cluster = load_cluster("cpu-local")
    rows = []
    for i, ((mode, world, ranks), case) in enumerate(zip(runs, cases)):
        layout, measured_t = case.layout, case.step_s
        mem = rank_memory(shape, layout, SEQ, "adamw")
        pred_mem = mem.parameters + mem.gradients + mem.optimizer  # state at rest, exact tensor bytes
        measured_mem = max(p["params"] + p["grads"] + p["optimizer"] for p in ranks)
        # Peak with activations: the state, the parameters held from forward to backward (zero2
        # keeps them gathered) and what autograd saves; predicted: rank_memory less the comm
        # buffers (gloo's and DDP's buckets are not tensors the measurement sees).
        measured_peak = max(p["params_after_forward"] + p["grads"] + p["optimizer"] for p in ranks) + \
            saved[layout.micro_batch]
        pred_peak = mem.total - mem.comm_buffers
        fitted, cores = fit(cluster, cases[:i] + cases[i + 1:])  # kiln/plan/calibrate.py
        pred_t = predicted_step(case, fitted, share_for(cores))
        params = (fitted.device.max_efficiency, fitted.device.half_efficiency_work,
                  fitted.intra_node.bandwidth_gbps, fitted.overlap_efficiency, cores)
        rows.append(dict(layout=f"{mode} x{world}", measured_bytes=measured_mem, predicted_bytes=pred_mem,
                         memory_error=pred_mem / measured_mem - 1, measured_peak_bytes=measured_peak,
                         predicted_peak_bytes=pred_peak, peak_error=pred_peak / measured_peak - 1, measured_step_s=measured_t,
                         predicted_step_s=pred_t, time_error=pred_t / measured_t - 1, fit=params))
    print(f"model {shape.params / 1e6:.2f}M params, global batch {BATCH} x {SEQ}, fp32 AdamW, gloo, {CORES} cores\n")
    print("| layout | state MiB measured | predicted | error | peak MiB measured | predicted | error | "
          "measured step s | predicted step s (LOO) | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['measured_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / 2**20:.1f} | "
              f"{r['memory_error']:+.1%} | {r['measured_peak_bytes'] / 2**20:.1f} | "
              f"{r['predicted_peak_bytes'] / 2**20:.1f} | {r['peak_error']:+.1%} | {r['measured_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
              f"{r['time_error']:+.1%} |")
    best_plan = best_plan_check(shape, cases, cluster)
    published = published_table()
    out = RESULTS_DIR / "plan_validation.json"
    out.write_text(json.dumps({"rows": rows, "best_plan": best_plan, "published": published, "source": args.results, "command": "python " + " ".join(sys.argv),
                               "cpu_count": os.cpu_count()}, indent=1))


def best_plan_check(shape, cases, cluster) -> list[dict]:
    """Per world size: the search's best data-parallel plan (max tp = pp = cp = 1, what kiln
    trains today; cluster fitted to all nine runs) against the best measured layout."""
    from kiln.plan.search import search

    fitted, cores = fit(cluster, cases)
    out = []
    print("\n| processes | search's best plan | its measured step s | best measured layout | step s |\n|---|---|---|---|---|")
    for world in (2, 4):
        c = copy.deepcopy(fitted)
        c.gpus_per_node, c.device.memory_gib = world, 64.0
        # Each of `world` processes gets min(1, cores / world) of a core: the search's compute and
        # optimizer terms run at that share of the fitted rate (what predicted_step divides by).
        part = min(1.0, cores / world)
        c.device.peak_tflops_fp32 *= part
        c.device.memory_bandwidth_gbps *= part
        best = search(shape, c, SEQ, BATCH, precision="fp32", max_tp=1, max_pp=1, max_cp=1)[0].layout
        measured = {(c.layout.dp_mode, c.layout.dp_replicate, c.layout.dp_shard, c.layout.micro_batch): c
                    for c in cases if c.layout.world_size == world}
        same = measured.get((best.dp_mode, best.dp_replicate, best.dp_shard, best.micro_batch))
        top = min(measured.values(), key=lambda c: c.step_s)
        same_ok = same is not None and best.tp == best.pp == best.cp == 1 and best.ac == "none"
        print(f"| {world} | {best.describe()} | {f'{same.step_s:.2f}' if same_ok else 'not run'} | {top.name} | {top.step_s:.2f} |")
        out.append(dict(world=world, plan=best.describe(), plan_measured_s=same.step_s if same_ok else None,
                        best_measured=top.name, best_measured_s=top.step_s))
    return out


# Published large-scale runs: (label, source, model, vocab, seq, cluster, nodes, layout, published, kind).
# kind "mfu": model FLOPs utilisation; "hw_tflops": per-GPU TFLOP/s counting activation recompute.
PUBLISHED = [
    ("Llama 3 405B, 8192 H100", "Llama 3 paper (Dubey et al. 2024), table 4",
     ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, max_seq_len=8192,
                 vocab_size=128256, tie_embeddings=False), 128256, 8192, "h100", 1024,
     Layout(dp_replicate=64, dp_shard=1, tp=8, pp=16, dp_mode="zero1", micro_batch=1, grad_accum=32,
            schedule="interleaved_1f1b", virtual_stages=2), 0.43, "mfu"),
    ("Llama 3 405B, 16384 H100", "Llama 3 paper (Dubey et al. 2024), table 4",
     ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, max_seq_len=8192,
                 vocab_size=128256, tie_embeddings=False), 128256, 8192, "h100", 2048,
     Layout(dp_replicate=128, dp_shard=1, tp=8, pp=16, dp_mode="zero1", micro_batch=1, grad_accum=16,
            schedule="interleaved_1f1b", virtual_stages=2), 0.41, "mfu"),
    ("GPT 1T, 3072 A100", "Narayanan et al. 2021 (Megatron-LM), table 1",
     ModelConfig(dim=25600, n_layers=128, n_heads=160, activation="gelu", max_seq_len=2048, vocab_size=51200),
     51200, 2048, "a100", 384,
     Layout(dp_replicate=6, dp_shard=1, tp=8, pp=64, dp_mode="ddp", micro_batch=1, grad_accum=512, ac="full",
            schedule="interleaved_1f1b", virtual_stages=2), 163.0, "hw_tflops"),
]


def published_table() -> list[dict]:
    rows = []
    print("\n| run | layout | published | predicted | source |\n|---|---|---|---|---|")
    for label, source, model, vocab, seq, preset, nodes, layout, value, kind in PUBLISHED:
        cluster = load_cluster(preset, nodes)
        shape = ModelShape.from_config(model, vocab)
        t = step_time(shape, layout, seq, cluster)
        mfu = t.mfu(cluster, "bf16", cluster.world_size)
        pred = mfu if kind == "mfu" else mfu * cluster.device.peak_flops("bf16") / 1e12 * 4 / 3  # + one recompute forward
        shown = (lambda v: f"{v:.0%} MFU") if kind == "mfu" else (lambda v: f"{v:.0f} TFLOP/s/GPU")
        print(f"| {label} | {layout.describe()} | {shown(value)} | {shown(pred)} | {source} |")
        rows.append(dict(run=label, layout=layout.describe(), published=value, predicted=pred, kind=kind,
                         source=source))
    return rows


if __name__ == "__main__":
    main()
