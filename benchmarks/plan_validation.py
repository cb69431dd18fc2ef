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
the count excludes), against rank_memory's total less its communication buffers. Model-parallel
layouts (tp, cp, pp schedules, ddp/zero1 x tp): (a) without gradients, the fullest rank's parameters
+ optimizer state (parallel_memory.py measures their step inside kiln's trainer step, which frees
the gradients), target exact within 0.5%.

Time: kiln/plan/timing.py `step_time` on the cpu-local cluster preset with `cores_per_node` set
to the measuring machine's cores (each of N processes computes at min(1, cores / N) of a core),
the link's latency and bandwidth fitted to the gloo collectives timed by parallel_memory.py
(kiln/plan/calibrate.py `fit_link`), then the efficiency curve, overlap and per-collective launch
cost fitted by least squares on log step time (`fit_cluster`). Leave-one-out: each layout is
predicted from a fit to the others, never to itself; a run whose round-to-round spread exceeds the
25% target is predicted but never fitted to. The measured step time is the median of
parallel_memory.py's interleaved rounds (a dense row merged from a later `--only` run, under another
load: its ratio to the 1-process step of its own rounds times the file's 1-process step); its spread ((max - min) / median over the rounds) is the
measurement's tolerance in the search checks below.

Search checks, per process count, on the cluster fitted to all nine runs: (1) the search's best
data-parallel plan (max tp = pp = cp = 1) must have been run and measure no slower than the best
run, within the tolerance t = the larger of the two layouts' round-to-round spreads:
plan_s <= best_s * (1 + t); (2) every pair of layouts whose measured gap exceeds their combined
spread (the sum of the two spreads: each median may lie anywhere in its rounds' range, so two
ranges can overlap until the medians are that far apart) must be predicted in the measured order.

Activation checkpointing (`checkpointing_check`): the eager peak per rank of none / full /
selective / op at tp 1 and 2 (benchmarks/activation_checkpointing.py's exact profiled peaks)
against rank_memory's, within 15%, and the settings' order where their measured peaks are more than
10% apart.

    python benchmarks/plan_validation.py [--results benchmarks/results/parallel_memory.json]

Prints a markdown table and writes benchmarks/results/plan_validation.json.

Single GPU (`--gpu-results FILE`): a JSON list of measured single-GPU cases, each
{"case", "shape", "step_ms", "peak_mem_gib" (torch.cuda.max_memory_allocated / 2**30, as
benchmarks/gpu_throughput.py writes it; or "peak_mem_gb", / 1e9), "plan": {"model":
ModelConfig fields, "batch" (micro-batch), "seq", "grad_accum", "ac", "compile", "loss", "precision",
"optimizer", "cuda_graphs"}} (cases without "plan" are skipped, and said so). Each case is predicted
with the --gpu-cluster preset as it is (uncalibrated) and with its efficiency curve
(max_efficiency, half_efficiency_work) fitted to the other cases (leave-one-out; kiln/plan/calibrate.py
`fit_cluster(device_only=True)`); step time includes kiln/plan/timing.py's memory-bound terms of
compiled runs; peak memory is rank_memory's total (compiled: the larger of the end-of-forward and
end-of-backward phases, kiln/plan/memory.py). Prints a table and writes benchmarks/results/plan_gpu_validation.json.

    python benchmarks/plan_validation.py --gpu-results gpu_cases.json [--gpu-cluster h100]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR  # noqa: E402

from kiln.config import ModelConfig, fill_dataclass  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.plan.calibrate import CollectiveSample, Measurement, fit_cluster, predicted_step  # noqa: E402
from kiln.plan.cluster import load_cluster  # noqa: E402
from kiln.plan.memory import OPTIM_STATE_BYTES, Layout, ModelShape, rank_memory, recomputed_blocks  # noqa: E402
from kiln.plan.timing import step_time  # noqa: E402

# benchmarks/parallel_memory.py's defaults before it recorded its arguments in the results file
DEFAULTS = {"dim": 384, "layers": 6, "heads": 6, "vocab": 4096, "seq": 128, "batch": 8}
TIME_TARGET = 0.25  # the step-time target: within 25%


def layout_for(mode: str, world: int, batch: int, diloco_inner_steps: int = 0) -> Layout:
    """The planner's Layout of a parallel_memory.py run (its MODEL_PARALLEL layouts: no data
    parallelism, the whole batch on every rank; pipelines with 2 x pp micro-batches; DiLoCo: every
    ddp rank a replica)."""
    per_rank = batch // world
    if mode == "diloco":
        return Layout(dp_replicate=world, dp_shard=1, dp_mode="ddp", micro_batch=per_rank, precision="fp32",
                      diloco_inner_steps=diloco_inner_steps)
    if mode == "diloco_ddp":  # parallel_rows.py: 2 replicas of DDP over world / 2 ranks
        return Layout(dp_replicate=2, dp_shard=world // 2, dp_mode="ddp", micro_batch=per_rank, precision="fp32",
                      diloco_inner_steps=diloco_inner_steps)
    if mode == "tp":
        return Layout(tp=world, micro_batch=batch, precision="fp32")
    if mode == "cp":
        return Layout(cp=world, micro_batch=batch, precision="fp32")
    if mode.startswith("pp_"):
        schedule = mode[3:]  # parallel_rows.py: the multi-stage schedules with 2 stages per rank
        return Layout(pp=world, micro_batch=batch // (2 * world), grad_accum=2 * world, schedule=schedule,
                      virtual_stages=1 if schedule in ("gpipe", "1f1b") else 2, precision="fp32")
    if mode in ("ddp_tp", "zero1_tp"):  # parallel_rows.py: world / 2 replicas of a tp=2 model, each its share
        return Layout(dp_replicate=world // 2, dp_shard=1, tp=2, dp_mode=mode[:-3], micro_batch=batch // (world // 2),
                      precision="fp32")
    if mode == "fsdp_reshard2":  # parallel_rows.py: fsdp resharded to 2 ranks after forward
        return Layout(dp_replicate=1, dp_shard=world, dp_mode="fsdp", fsdp_reshard_to=2, micro_batch=per_rank,
                      precision="fp32")
    if mode == "hsdp":  # parallel_rows.py: 2 replicas x world / 2 shards
        return Layout(dp_replicate=2, dp_shard=world // 2, dp_mode="fsdp", micro_batch=per_rank, precision="fp32")
    if mode in ("ddp", "zero1") or world == 1:
        return Layout(dp_replicate=world, dp_shard=1, dp_mode=mode if world > 1 else "ddp", micro_batch=per_rank,
                      precision="fp32")
    return Layout(dp_replicate=1, dp_shard=world, dp_mode=mode, micro_batch=per_rank, precision="fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS_DIR / "parallel_memory.json"))
    ap.add_argument("--activations", default=str(RESULTS_DIR / "activation_bytes.json"),
                    help="bytes autograd saves per forward, by per-rank batch (parallel_memory.py 'activations')")
    ap.add_argument("--checkpointing", default=str(RESULTS_DIR / "activation_checkpointing.json"),
                    help="benchmarks/activation_checkpointing.py's results: the checkpointing table")
    ap.add_argument("--gpu-results", metavar="FILE", help="measured single-GPU cases (see above): only that table")
    ap.add_argument("--gpu-cluster", default="h100", help="cluster preset the GPU cases are predicted with")
    ap.add_argument("--gpu-out", default=str(RESULTS_DIR / "plan_gpu_validation.json"))
    args = ap.parse_args()
    if args.gpu_results:
        try:
            out = gpu_validation(args.gpu_results, args.gpu_cluster)
        except KilnError as e:
            sys.exit(f"plan_validation: error: {e}")
        out["command"] = "python " + " ".join(sys.argv)
        Path(args.gpu_out).write_text(json.dumps(out, indent=1))
        return
    data = json.loads(Path(args.results).read_text())
    run_args = {**DEFAULTS, **data.get("args", {})}
    seq, batch = run_args["seq"], run_args["batch"]
    if "activations_by_batch" in data:
        saved = {int(k): v for k, v in data["activations_by_batch"].items()}
    else:
        saved = {int(k): v for k, v in json.loads(Path(args.activations).read_text())["by_batch"].items()}
    model = ModelConfig(dim=run_args["dim"], n_layers=run_args["layers"], n_heads=run_args["heads"],
                        vocab_size=run_args["vocab"], max_seq_len=seq)
    shape = ModelShape.from_config(model, run_args["vocab"])
    assert shape.params == data["single"]["n_params"], "benchmark model shape changed; update DEFAULTS"
    untied = ModelShape.from_config(dataclasses.replace(model, tie_embeddings=False), run_args["vocab"])
    # The "deep" rows (parallel_rows.py: the same model with more layers, untied, for pipelines of
    # more stages than the benchmark model has layers) are timed with their own shape and compared
    # only with each other; the mixture-of-experts rows (another model) are not validated here.
    # DiLoCo's row is (kiln/plan/diloco.py), with its own inner steps (parallel_memory.py's --diloco-inner-steps).
    family_shape = {"dense": shape}
    for r in data["runs"]:
        if r.get("family") == "deep":
            layers = [int(o.split("=", 1)[1]) for o in r.get("overrides", []) if o.startswith("model.n_layers=")]
            family_shape["deep"] = ModelShape.from_config(dataclasses.replace(
                model, tie_embeddings=False, n_layers=layers[0] if layers else model.n_layers), run_args["vocab"])
    other = [f"{r['mode']} x{r['world']}" for r in data["runs"]
             if r.get("family", "dense") not in family_shape]
    if other:
        print(f"not validated (another model, or a strategy the planner does not model): {', '.join(other)}\n")
    runs = [("single", 1, [data["single"]], data["single"])] + [(r["mode"], r["world"], r["per_rank"], r)
                                                               for r in data["runs"]
                                                               if f"{r['mode']} x{r['world']}" not in other]
    # A run whose optimizer holds no state on any rank never stepped (its time lacks the update),
    # and one whose loss is not about ln(vocab) at init did not train: left out, and said so.
    limit = 2 * math.log(run_args["vocab"])
    stale = [f"{m} x{w}" for m, w, ranks, _ in runs if not any(p["optimizer"] for p in ranks)
             or not all(math.isfinite(p.get("loss", 0.0)) and p.get("loss", 0.0) < limit for p in ranks)]
    runs = [r for r in runs if f"{r[0]} x{r[1]}" not in stale]
    if stale:
        print(f"left out (no optimizer state after the timed steps, or a loss not below 2 ln(vocab)): "
              f"{', '.join(stale)}\n")
    cases, spreads, families = [], {}, {}
    for m, w, ranks, run in runs:
        step_s = run.get("step_s_median", max(p["step_s"] for p in ranks))
        family = run.get("family", "dense")
        if family == "dense" and "vs_single" in run and run.get("date_utc") != data["single"].get("date_utc"):
            # merged from a later --only run (another load): its ratio to the 1-process step timed in
            # the same rounds, times the file's 1-process step, puts it on the other rows' footing
            step_s = run["vs_single"] * data["single"]["step_s_median"]
        # pipeline runs untie the embeddings (parallel_memory.py MODEL_PARALLEL): their own shape
        case_shape = untied if m.startswith("pp_") and family == "dense" else family_shape[family]
        # parallel_memory.py runs optim.implementation='foreach'
        inner_steps = int(ranks[0].get("sync_every", run_args.get("diloco_inner_steps", 8))) if m.startswith("diloco") else 0
        cases.append(Measurement(f"{m} x{w}", case_shape, layout_for(m, w, batch, inner_steps), seq, step_s, "adamw",
                                 "foreach"))
        spreads[cases[-1].name] = run.get("step_s_spread", 0.0)
        families[cases[-1].name] = family
    links = [CollectiveSample(c["op"], c["ranks"], c["bytes"], c["seconds"]) for c in data.get("collectives", [])]
    cores = data.get("machine", {}).get("cores_visible") or os.cpu_count()
    cluster = load_cluster("cpu-local")
    cluster.cores_per_node, cluster.gpus_per_node = float(cores), max(c.layout.world_size for c in cases)
    # A run whose rounds spread wider than the accuracy target cannot calibrate to that target: it
    # is predicted and checked like the others but not fitted to.
    calibrating = [c for c in cases if spreads[c.name] <= TIME_TARGET]
    noisy = [c.name for c in cases if spreads[c.name] > TIME_TARGET]
    if noisy:
        print(f"not fitted to (round-to-round spread over {TIME_TARGET:.0%}): {', '.join(noisy)}\n")
    rows = []
    for i, ((mode, world, ranks, _), case) in enumerate(zip(runs, cases)):
        layout, measured_t = case.layout, case.step_s
        fitted = fit_cluster(cluster, [c for c in calibrating if c is not case], links=links or None)  # calibrate.py
        pred_t = predicted_step(case, fitted)
        params = (fitted.device.max_efficiency, fitted.device.half_efficiency_work, fitted.intra_node.bandwidth_gbps,
                  fitted.overlap_efficiency, fitted.collective_launch_us, fitted.intra_node.latency_us)
        row = dict(layout=case.name, family=families[case.name], describe=layout.describe(), measured_step_s=measured_t,
                   step_spread=spreads[case.name], predicted_step_s=pred_t, time_error=pred_t / measured_t - 1,
                   fit=params)
        rows.append(row)
        if "params_after_forward" not in ranks[0]:
            continue
        if layout.dp != world:
            # Model-parallel runs: the fullest rank's parameters and optimizer state at rest, exact
            # tensor bytes (parallel_memory.py's model-parallel step leaves no gradients to count)
            mem = rank_memory(case.shape, layout, seq, "adamw")
            measured_mem = max(p["params"] + p["optimizer"] for p in ranks)
            row.update(rest_measured_bytes=measured_mem, rest_predicted_bytes=mem.parameters + mem.optimizer,
                       rest_error=(mem.parameters + mem.optimizer) / measured_mem - 1)
            continue
        if families[case.name] != "dense":
            continue
        mem = rank_memory(shape, layout, seq, "adamw")
        # state at rest, exact tensor bytes (parallel_memory.py counts DiLoCo's anchor and momentum
        # as optimizer); gradients are fp32 and split like the parameters (rank_memory's peak
        # phase may hold none of them)
        pred_mem = 2 * mem.parameters + mem.optimizer + mem.outer_state
        measured_mem = max(p["params"] + p["grads"] + p["optimizer"] for p in ranks)
        # Peak with activations: the state, the parameters held from forward to backward (zero2
        # keeps them gathered) and what autograd saves; predicted: rank_memory's peak less the comm
        # buffers (gloo's and DDP's buckets are not tensors the measurement sees). The measured sum
        # holds every gradient and every saved tensor at once, which no moment of an eager step does
        # (its peak, in the loss's backward, has no gradients yet: memory.py _eager_peak_phase), so
        # it lies above the true peak; checkpointing_check compares true, profiled peaks.
        measured_peak = max(p["params_after_forward"] + p["grads"] + p["optimizer"] for p in ranks) + \
            saved[layout.micro_batch]
        pred_peak = mem.total - mem.comm_buffers
        row.update(measured_bytes=measured_mem, predicted_bytes=pred_mem, memory_error=pred_mem / measured_mem - 1,
                   measured_peak_bytes=measured_peak, predicted_peak_bytes=pred_peak,
                   peak_error=pred_peak / measured_peak - 1)
    print(f"model {shape.params / 1e6:.2f}M params, global batch {batch} x {seq}, fp32 AdamW, gloo, {cores} cores\n")
    print("| layout | state MiB measured | predicted | error | peak MiB measured | predicted | error | "
          "measured step s (spread) | predicted step s (LOO) | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        memory = (f"{r['measured_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / 2**20:.1f} | {r['memory_error']:+.1%} | "
                  f"{r['measured_peak_bytes'] / 2**20:.1f} | {r['predicted_peak_bytes'] / 2**20:.1f} | "
                  f"{r['peak_error']:+.1%}") if "measured_bytes" in r else "- | - | - | - | - | -"
        print(f"| {r['layout']} | {memory} | {r['measured_step_s']:.3f} ({r['step_spread']:.0%}) | "
              f"{r['predicted_step_s']:.3f} | {r['time_error']:+.1%} |")
    rest = [r for r in rows if "rest_error" in r]
    print("\nmodel-parallel layouts, the fullest rank's parameters + optimizer state at rest:\n")
    print("| layout | MiB measured | predicted | error |\n|---|---|---|---|")
    for r in rest:
        print(f"| {r['layout']} | {r['rest_measured_bytes'] / 2**20:.2f} | {r['rest_predicted_bytes'] / 2**20:.2f} | "
              f"{r['rest_error']:+.2%} |")
    fitted = fit_cluster(cluster, calibrating, links=links or None)
    print(f"\nfit to all {len(calibrating)}: link {fitted.intra_node.latency_us:.0f} us + {fitted.intra_node.bandwidth_gbps:.2f} GB/s"
          f" (from {len(links)} timed collectives), max_efficiency {fitted.device.max_efficiency:.3g}, "
          f"half_efficiency_work {fitted.device.half_efficiency_work:.3g}, overlap {fitted.overlap_efficiency:.2f}, "
          f"launch {fitted.collective_launch_us:.0f} us per collective")
    best_plan, ordering = best_plan_check(shape, cases, spreads, fitted, seq, batch, families)
    within = sum(abs(r["time_error"]) <= TIME_TARGET for r in rows)
    memory_ok = sum(abs(r["peak_error"]) <= 0.10 for r in rows if "peak_error" in r)
    print(f"\nchecks: step time within {TIME_TARGET:.0%} (leave-one-out): {within} of {len(rows)}; "
          f"peak memory within 10%: {memory_ok} of {sum('peak_error' in r for r in rows)}; model-parallel state "
          f"within 0.5%: {sum(abs(r['rest_error']) <= 0.005 for r in rest)} of {len(rest)}; best plan within the spread of the best run: "
          f"{sum(r['ok'] for r in best_plan)} of {len(best_plan)}; pairs ordered as measured (gap > combined spread): "
          f"{sum(p['ok'] for p in ordering)} of {len(ordering)}")
    published = published_table()
    checkpointing = checkpointing_check(Path(args.checkpointing))
    out = RESULTS_DIR / "plan_validation.json"
    out.write_text(json.dumps({"rows": rows, "best_plan": best_plan, "ordering": ordering, "published": published,
                               "checkpointing": checkpointing,
                               "fit_all": dict(latency_us=fitted.intra_node.latency_us,
                                               bandwidth_gbps=fitted.intra_node.bandwidth_gbps,
                                               max_efficiency=fitted.device.max_efficiency,
                                               half_efficiency_work=fitted.device.half_efficiency_work,
                                               overlap_efficiency=fitted.overlap_efficiency,
                                               collective_launch_us=fitted.collective_launch_us,
                                               cores_per_node=fitted.cores_per_node),
                               "left_out": stale, "time_target": TIME_TARGET, "time_within_target": within,
                               "source": args.results, "source_date_utc": data.get("date_utc"),
                               "source_loadavg": data.get("rounds"), "command": "python " + " ".join(sys.argv),
                               "cpu_count": os.cpu_count()}, indent=1))


def best_plan_check(shape, cases, spreads, fitted, seq, batch, families) -> tuple[list[dict], list[dict]]:
    """Per process count: the search's best data-parallel plan (max tp = pp = cp = 1, what the
    measured set covers) against the best measured layout, with the round-to-round spread as the
    tolerance; and every pair of measured layouts of one model (`families`) whose gap exceeds the
    sum of their spreads, predicted in order."""
    from kiln.plan.search import search

    best_rows, ordering = [], []
    print("\n| processes | search's best plan | its measured step s | best measured layout | step s | "
          "tolerance (spread) | within |\n|---|---|---|---|---|---|---|")
    for world in sorted({c.layout.world_size for c in cases} - {1}):
        c = copy.deepcopy(fitted)
        c.gpus_per_node, c.device.memory_gib = world, 64.0
        best = search(shape, c, seq, batch, precision="fp32", max_tp=1, max_pp=1, max_cp=1)[0].layout
        same_world = [m for m in cases if m.layout.world_size == world and families[m.name] == "dense"]
        measured = {(m.layout.dp_mode, m.layout.dp_replicate, m.layout.dp_shard, m.layout.micro_batch): m
                    for m in same_world if m.layout.dp == world and not m.layout.diloco_inner_steps}
        same = measured.get((best.dp_mode, best.dp_replicate, best.dp_shard, best.micro_batch))
        same = same if same is not None and best.ac == "none" and best.grad_accum == 1 else None
        top = min(measured.values(), key=lambda m: m.step_s)
        tol = max(spreads[top.name], spreads[same.name] if same else 0.0)
        ok = same is not None and same.step_s <= top.step_s * (1 + tol)
        print(f"| {world} | {best.describe()} | {f'{same.step_s:.3f}' if same else 'not run'} | {top.name} | "
              f"{top.step_s:.3f} | {tol:.0%} | {'yes' if ok else 'no'} |")
        best_rows.append(dict(world=world, plan=best.describe(), plan_measured=same.name if same else None,
                              plan_measured_s=same.step_s if same else None, best_measured=top.name,
                              best_measured_s=top.step_s, tolerance=tol, ok=ok))
        ranked = sorted([m for m in cases if m.layout.world_size == world], key=lambda m: m.step_s)  # model-parallel too
        for i, fast in enumerate(ranked):
            for slow in ranked[i + 1:]:
                if families[fast.name] != families[slow.name]:
                    continue  # another model: no order to keep
                gap = slow.step_s / fast.step_s - 1
                if gap <= spreads[fast.name] + spreads[slow.name]:
                    continue  # within the two measurements' combined spread: no order to keep
                pf, ps = predicted_step(fast, c), predicted_step(slow, c)
                ordering.append(dict(world=world, faster=fast.name, slower=slow.name, measured_gap=gap,
                                     predicted_gap=ps / pf - 1, ok=pf < ps))
    bad = [p for p in ordering if not p["ok"]]
    print(f"\npairs whose measured gap exceeds their combined spread: {len(ordering)}, predicted in the other order: "
          + (", ".join(f"{p['faster']} < {p['slower']} (measured {p['measured_gap']:+.0%}, predicted "
                       f"{p['predicted_gap']:+.0%})" for p in bad) or "none"))
    return best_rows, ordering


# Published large-scale runs: (label, source, model, vocab, seq, cluster, nodes, layout, published, kind).
# Llama 3's data parallelism is FSDP (parameters, gradients and optimizer state sharded; sec. 3.3.1)
# without resharding after forward: kiln's zero2. Its interleaved schedule's virtual stages are not
# in table 4; 2 is assumed (the bubble, (pp-1)/(m*v), is the largest term left: see benchmarks/README.md).
# kind "mfu": model FLOPs utilisation; "hw_tflops": per-GPU TFLOP/s counting activation recompute.
PUBLISHED = [
    ("Llama 3 405B, 8192 H100", "Llama 3 paper (Dubey et al. 2024), table 4",
     ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, max_seq_len=8192,
                 vocab_size=128256, tie_embeddings=False), 128256, 8192, "h100", 1024,
     Layout(dp_replicate=1, dp_shard=64, tp=8, pp=16, dp_mode="zero2", micro_batch=1, grad_accum=32,
            schedule="interleaved_1f1b", virtual_stages=2), 0.43, "mfu"),
    ("Llama 3 405B, 16384 H100", "Llama 3 paper (Dubey et al. 2024), table 4",
     ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, max_seq_len=8192,
                 vocab_size=128256, tie_embeddings=False), 128256, 8192, "h100", 2048,
     Layout(dp_replicate=1, dp_shard=128, tp=8, pp=16, dp_mode="zero2", micro_batch=1, grad_accum=16,
            schedule="interleaved_1f1b", virtual_stages=2), 0.41, "mfu"),
    ("GPT 1T, 3072 A100", "Narayanan et al. 2021 (Megatron-LM), table 1",
     ModelConfig(dim=25600, n_layers=128, n_heads=160, activation="gelu", max_seq_len=2048, vocab_size=51200),
     51200, 2048, "a100", 384,
     Layout(dp_replicate=6, dp_shard=1, tp=8, pp=64, dp_mode="ddp", micro_batch=1, grad_accum=512, ac="full",
            schedule="interleaved_1f1b", virtual_stages=2), 163.0, "hw_tflops"),
]


AC_TARGET = 0.15  # eager peak with activation checkpointing, CPU (see checkpointing_check)
AC_ORDER_GAP = 0.10  # settings whose measured peaks differ by more must be predicted in that order


def checkpointing_check(path: Path) -> dict:
    """kiln/plan/memory.py's eager peak under each activation-checkpointing setting against
    benchmarks/activation_checkpointing.py's measurement (one micro-batch's forward + backward per
    rank, tp 1 and 2, fp32: the most tensor bytes live at once above the parameters, from the
    profiler's allocator events; exact, load-independent). Predicted: `predicted_peak` there,
    recomputed with the current planner. Target: within AC_TARGET. The known shortfall is CPU's
    RMSNorm, which torch runs as a composite there and whose normalized input autograd saves (a
    fused CUDA kernel saves only the input and rstd, what the planner counts): about 2 x dim x 4
    bytes per token and block, split by tp."""
    from activation_checkpointing import predicted_peak

    data = json.loads(path.read_text())
    args = argparse.Namespace(**data["args"])
    rows = []
    for name, r in data["rows"].items():
        pred = predicted_peak(args, r["tp"], r["ac"])
        rows.append(dict(case=name, tp=r["tp"], ac=r["ac"], measured_peak_bytes=r["peak_bytes"],
                         predicted_peak_bytes=pred, error=pred / r["peak_bytes"] - 1))
    ordering = []
    for a in rows:
        for b in rows:
            if a["tp"] == b["tp"] and a["measured_peak_bytes"] > b["measured_peak_bytes"] * (1 + AC_ORDER_GAP):
                ordering.append(dict(larger=a["case"], smaller=b["case"], ok=a["predicted_peak_bytes"] > b["predicted_peak_bytes"],
                                     measured_gap=a["measured_peak_bytes"] / b["measured_peak_bytes"] - 1,
                                     predicted_gap=a["predicted_peak_bytes"] / b["predicted_peak_bytes"] - 1))
    print(f"\nactivation checkpointing, eager peak per rank above the parameters ({path.name}: "
          f"dim {args.dim}, {args.layers} layers, {args.batch} x {args.seq}, fp32):\n")
    print("| case | MiB measured | predicted | error |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['measured_peak_bytes'] / 2**20:.1f} | {r['predicted_peak_bytes'] / 2**20:.1f} | "
              f"{r['error']:+.1%} |")
    within = sum(abs(r["error"]) <= AC_TARGET for r in rows)
    print(f"\nwithin {AC_TARGET:.0%}: {within} of {len(rows)}; pairs apart by more than {AC_ORDER_GAP:.0%} "
          f"ordered as measured: {sum(o['ok'] for o in ordering)} of {len(ordering)}")
    return {"rows": rows, "ordering": ordering, "target": AC_TARGET, "order_gap": AC_ORDER_GAP,
            "source": str(path), "source_date_utc": data.get("date_utc")}


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


GPU_PLAN_KEYS = {"model": dict, "batch": int, "seq": int, "grad_accum": int, "ac": str, "compile": bool, "loss": str,
                 "precision": str, "optimizer": str, "cuda_graphs": bool}
MEMORY_TARGET = 0.10


def gpu_case(raw, i: int, path: str) -> tuple[Measurement, dict] | None:
    """A measured single-GPU case as a Measurement (step_s) and {peak_bytes, shape, cuda_graphs},
    or None without a plan; a KilnError naming the file, case and key for anything malformed."""
    where = f"{path}: cases[{i}]"
    if not isinstance(raw, dict):
        raise KilnError(f"{where}: expected a table with case, shape, step_ms, peak_mem_gb, plan")
    if raw.get("plan") is None:  # a case that is not kiln's step (the baseline, the train loop)
        return None
    mem_key = "peak_mem_gib" if "peak_mem_gib" in raw else "peak_mem_gb"  # gpu_throughput.py writes GiB
    for key in ("step_ms", mem_key):
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise KilnError(f"{where}: {key} {v!r}: expected a positive number")
    plan = raw["plan"]
    if not isinstance(plan, dict):
        raise KilnError(f"{where}.plan: expected a table")
    for key, kind in GPU_PLAN_KEYS.items():
        if not isinstance(plan.get(key), kind) or (kind is int and (isinstance(plan[key], bool) or plan[key] < 1)):
            expected = "a positive int" if kind is int else kind.__name__
            raise KilnError(f"{where}.plan.{key} {plan.get(key)!r}: expected {expected}")
    model = fill_dataclass(ModelConfig, plan["model"], f"{where}.plan", "model.")
    model.validate()
    if model.vocab_size < 1:
        raise KilnError(f"{where}.plan.model.vocab_size {model.vocab_size}: expected the vocabulary size")
    choices = {"precision": ("fp32", "bf16", "fp16", "float8"), "loss": ("full", "chunked"),
               "optimizer": tuple(OPTIM_STATE_BYTES)}
    for key, allowed in choices.items():
        if plan[key] not in allowed:
            raise KilnError(f"{where}.plan.{key} {plan[key]!r}: expected one of {', '.join(allowed)}")
    try:
        recomputed_blocks(plan["ac"], model.n_layers)
    except ValueError:
        raise KilnError(f"{where}.plan.ac {plan['ac']!r}: expected none, full, selective or every_k:K") from None
    layout = Layout(micro_batch=plan["batch"], grad_accum=plan["grad_accum"], ac=plan["ac"], precision=plan["precision"],
                    loss=plan["loss"], compiled=plan["compile"])
    m = Measurement(str(raw.get("case", f"case {i}")), ModelShape.from_config(model, model.vocab_size), layout,
                    plan["seq"], raw["step_ms"] / 1e3, plan["optimizer"], "fused")  # kiln's default on cuda
    return m, dict(peak_bytes=raw[mem_key] * (2**30 if mem_key == "peak_mem_gib" else 1e9), shape=str(raw.get("shape", "")), cuda_graphs=plan["cuda_graphs"])


def gpu_validation(path: str, preset: str = "h100") -> dict:
    """Predicted vs measured step time and peak memory of single-GPU cases: the preset as it is,
    and leave-one-out with the efficiency curve fitted to the other cases."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KilnError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not JSON ({e})") from None
    if isinstance(raw, dict) and "results" in raw:  # benchmarks/throughput.py --device cuda's results file
        raw = raw["results"]
    if not isinstance(raw, list):
        raise KilnError(f"{path}: expected a JSON list of measured cases (or a throughput.py results file)")
    cases = [gpu_case(r, i, path) for i, r in enumerate(raw)]
    skipped = [str(r.get("case", i)) if isinstance(r, dict) else str(i) for i, (r, c) in enumerate(zip(raw, cases))
               if c is None]
    extras = [c[1] for c in cases if c is not None]
    cases = [c[0] for c in cases if c is not None]
    if not cases:
        raise KilnError(f"{path}: no case has a \"plan\" to predict")
    cluster = load_cluster(preset)
    rows = []
    for i, (m, extra) in enumerate(zip(cases, extras)):
        preset_s = predicted_step(m, cluster)
        others = cases[:i] + cases[i + 1:]
        loo = predicted_step(m, fit_cluster(cluster, others, device_only=True)) if others else None
        mem = rank_memory(m.shape, m.layout, m.seq_len, m.optimizer).total
        rows.append(dict(case=m.name, shape=extra["shape"], describe=m.layout.describe() + (" compiled" if m.layout.compiled
                         else "") + (" cuda_graphs" if extra["cuda_graphs"] else ""), measured_step_s=m.step_s,
                         preset_step_s=preset_s, preset_error=preset_s / m.step_s - 1, loo_step_s=loo,
                         loo_error=None if loo is None else loo / m.step_s - 1, measured_peak_bytes=extra["peak_bytes"],
                         predicted_peak_bytes=mem, peak_error=mem / extra["peak_bytes"] - 1))
    print(f"single GPU, predicted with the {preset} preset (uncalibrated) and leave-one-out calibrated "
          f"(max_efficiency, half_efficiency_work fitted to the other {len(cases) - 1} cases)\n")
    print("| case | shape | layout | measured ms | preset ms | error | LOO ms | error | peak GB measured | "
          "predicted | error |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        loo = f"{r['loo_step_s'] * 1e3:.1f} | {r['loo_error']:+.1%}" if r["loo_step_s"] else "- | -"
        print(f"| {r['case']} | {r['shape']} | {r['describe']} | {r['measured_step_s'] * 1e3:.1f} | "
              f"{r['preset_step_s'] * 1e3:.1f} | {r['preset_error']:+.1%} | {loo} | {r['measured_peak_bytes'] / 1e9:.2f} | "
              f"{r['predicted_peak_bytes'] / 1e9:.2f} | {r['peak_error']:+.1%} |")
    summary = dict(cases=len(rows), time_within_preset=sum(abs(r["preset_error"]) <= TIME_TARGET for r in rows),
                   time_within_loo=sum(r["loo_error"] is not None and abs(r["loo_error"]) <= TIME_TARGET for r in rows),
                   memory_within=sum(abs(r["peak_error"]) <= MEMORY_TARGET for r in rows))
    print(f"\nwithin {TIME_TARGET:.0%} step time: preset {summary['time_within_preset']} of {len(rows)}, leave-one-out "
          f"{summary['time_within_loo']} of {len(rows)}; peak memory within {MEMORY_TARGET:.0%}: "
          f"{summary['memory_within']} of {len(rows)}" + (f"; skipped (no plan): {', '.join(skipped)}" if skipped else ""))
    return dict(rows=rows, summary=summary, skipped=skipped, cluster=preset, source=str(path),
                time_target=TIME_TARGET, memory_target=MEMORY_TARGET)


if __name__ == "__main__":
    main()
