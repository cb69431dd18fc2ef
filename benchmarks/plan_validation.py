"""`kiln plan`'s memory and time models against measured kiln runs.

Measurements: benchmarks/results/parallel_memory.json, written by benchmarks/parallel_memory.py
(kiln's own build_model -> parallelize -> shard_optimizer_state path, gloo, fp32, AdamW; exact
per-rank tensor bytes of parameters, gradients and optimizer state, the parameters held between
forward and backward, and the median step time of the slowest rank) for 1 process and for
ddp / zero1 / zero2 / fsdp at 2 and 4 processes: 9 layouts. Rerun that script first to refresh them.

Memory: kiln/plan/memory.py `rank_memory` (no fitting) against the largest rank's measured
parameters + gradients + optimizer state at rest. Activations, FSDP's all-gather buffers and
logits are not in those measurements (they are counts of the tensors a module exposes, not
allocator peaks), so they are left out of both sides: this checks the sharding terms only.

Time: kiln/plan/timing.py `step_time` on the cpu-local cluster preset, whose efficiency curve
(max_efficiency, half_efficiency_work), link bandwidth and overlap efficiency are unknown for this machine: they are
calibrated by least squares on log time, leave-one-out (each layout is predicted from a fit to
the other eight, never to itself) with kiln/plan/calibrate.py `fit_cluster`. This machine runs 4 processes on 2 cores, so each process
gets min(1, cores / processes) of a core: that factor is applied here, not in the planner.

    python benchmarks/plan_validation.py [--results benchmarks/results/parallel_memory.json]

Prints a markdown table and writes benchmarks/results/plan_validation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR  # noqa: E402

from kiln.config import ModelConfig  # noqa: E402
from kiln.plan.calibrate import Measurement, fit_cluster, predicted_step  # noqa: E402
from kiln.plan.cluster import load_cluster  # noqa: E402
from kiln.plan.memory import Layout, ModelShape, rank_memory  # noqa: E402
from kiln.plan.timing import step_time  # noqa: E402

# benchmarks/parallel_memory.py defaults (the results file records only the command)
DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 384, 6, 6, 4096, 128, 8
CORES = 2


def layout_for(mode: str, world: int) -> Layout:
    per_rank = BATCH // world
    if mode in ("ddp", "zero1") or world == 1:
        return Layout(dp_replicate=world, dp_shard=1, dp_mode=mode if world > 1 else "ddp", micro_batch=per_rank,
                      precision="fp32")
    return Layout(dp_replicate=1, dp_shard=world, dp_mode=mode, micro_batch=per_rank, precision="fp32")


def share(layout: Layout) -> float:
    return min(1.0, CORES / layout.world_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS_DIR / "parallel_memory.json"))
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
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
        fitted = fit_cluster(cluster, cases[:i] + cases[i + 1:], share)  # kiln/plan/calibrate.py
        pred_t = predicted_step(case, fitted, share)
        params = (fitted.device.max_efficiency, fitted.device.half_efficiency_work,
                  fitted.intra_node.bandwidth_gbps, fitted.overlap_efficiency)
        rows.append(dict(layout=f"{mode} x{world}", measured_bytes=measured_mem, predicted_bytes=pred_mem,
                         memory_error=pred_mem / measured_mem - 1, measured_step_s=measured_t,
                         predicted_step_s=pred_t, time_error=pred_t / measured_t - 1, fit=params))
    print(f"model {shape.params / 1e6:.2f}M params, global batch {BATCH} x {SEQ}, fp32 AdamW, gloo, {CORES} cores\n")
    print("| layout | measured MiB | predicted MiB | error | measured step s | predicted step s (LOO) | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['measured_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / 2**20:.1f} | "
              f"{r['memory_error']:+.1%} | {r['measured_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
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

    fitted = fit_cluster(cluster, cases, share)
    out = []
    print("\n| processes | search's best plan | its measured step s | best measured layout | step s |\n|---|---|---|---|---|")
    for world in (2, 4):
        fitted.gpus_per_node, fitted.device.memory_gib = world, 64.0
        best = search(shape, fitted, SEQ, BATCH, precision="fp32", max_tp=1, max_pp=1, max_cp=1)[0].layout
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
