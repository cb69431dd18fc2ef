"""The results file of benchmarks/parallel_memory.py: its markdown table, and the merge of a
partial (--only) or counts-only (--counts-only) run into an existing file."""

from __future__ import annotations

import copy

from parallel_rows import DEEP_LAYERS, MOE_DESC


def mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def bubble(run: dict) -> float | None:
    """A pipeline row's bubble fraction: the one its measurement recorded (the trainer's run-row
    value), else (rows measured before it was recorded) kiln's same formula on the row's config."""
    recorded = run["per_rank"][0].get("bubble_fraction")
    if recorded is not None or not any(o.startswith("parallel.pp=") for o in run.get("overrides", ())):
        return recorded
    from kiln.config import load_config
    from kiln.parallel.pipeline_layout import bubble_fraction, n_microbatches

    cfg = load_config(None, list(run["overrides"]))
    p = cfg.parallel
    return bubble_fraction(p.pp_schedule, p.pp, n_microbatches(cfg), p.pp_virtual_stages)


def layout_name(run: dict) -> str:
    """The row's layout, with the layer count where the row overrides the model's."""
    layers = [o.split("=", 1)[1] for o in run.get("overrides", ()) if o.startswith("model.n_layers=")]
    name = run["mode"] + (f" ({layers[-1]} layers)" if layers else "")
    return name + (f" (H={run['per_rank'][0]['sync_every']})" if "sync_every" in run["per_rank"][0] else "")


def render_table(results: dict) -> str:
    """Markdown table of every layout in a results file (rows of older runs lack some fields)."""
    a = results["args"]
    lines = [f"model: {results['single']['n_params'] / 1e6:.2f}M params (MoE variant: {MOE_DESC}), global batch "
             f"{a['batch']} x {a['seq']} tokens, fp32 AdamW; bytes per rank (largest rank), MB = 2^20 bytes; step s: "
             f"median of interleaved rounds (spread = (max - min) / median); x single: step s / the same model's "
             f"1-process step in the same rounds; comm: payload handed to gloo per step (profiler), calls; "
             f"wire: bytes written to gloo sockets per step; bubble: the pipeline bubble fraction the run row reports "
             f"(an upper bound for zero-bubble schedules); ({DEEP_LAYERS} layers): a deeper variant of the model, x single "
             f"against its own 1-process row", "",
             "| layout | N | params MB (ideal) | after fwd MB | grads MB (ideal) | optim MB (ideal) | worst / ideal | "
             "step s | spread | x single | comm MB/step (calls) | wire MB/step | bubble |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in [dict(results["single"], mode="single", world=1, per_rank=[results["single"]])] + results["runs"]:
        ranks = run["per_rank"]
        worst = {k: max(r.get(k, 0) for r in ranks) for k in ("params", "params_after_forward", "grads", "optimizer")}
        ideal = run.get("ideal") or ({k: worst[k] for k in ("params", "grads", "optimizer")}
                                     if run["mode"] == "single" else None)
        if ideal:
            memory = " | ".join(f"{mb(worst[k])} ({mb(ideal[k])})" if k in ideal else mb(worst[k]) for k in worst)
            memory += f" | {run.get('worst_over_ideal', 1.0):.2f}"
        else:
            memory = f"{mb(worst['params'])} | - | - | {mb(worst['optimizer'])} | -"
        comm = [r["comm"] for r in ranks if "comm" in r]
        comm_cell = (f"{max(c['sent_bytes'] for c in comm) / 2**20:.2f} ({max(c['calls'] for c in comm):.4g})"
                     if comm else "0" if run["world"] == 1 else "-")
        ratio = f"{run['vs_single']:.2f}" if "vs_single" in run else "-"
        b = bubble(run)
        lines.append(f"| {layout_name(run)} | {run['world']} | {memory} | {run['step_s_median']:.3f} | "
                     f"{run.get('step_s_spread', 0.0):.0%} | {ratio} | {comm_cell} | "
                     f"{max(r.get('sent', 0) for r in ranks) / 2**20:.2f} | {'-' if b is None else f'{b:.2f}'} |")
    lines += ["", "CPU busy (ranks' CPU seconds / (step s x cores they could use); about 1 on a quiet machine) "
              "per layout, rounds in order: " + "; ".join(
                  f"{r['mode']} x{r['world']} " + " ".join(f"{b:.2f}" for b in r.get("cpu_busy_rounds", []))
                  for r in [dict(results["single"], mode="single", world=1)] + results["runs"])]
    return "\n".join(lines)



def merge(old: dict, new: dict, named: set[str]) -> dict:
    """`old` results with the layouts of a partial run: a layout in `named` replaces the old one,
    a reference layout the run measured only for its ratios is added when `old` lacks it."""
    merged = copy.deepcopy(old)
    have = {f"{r['mode']}@{r['world']}" for r in old["runs"]} | {"single@1"}
    keep = {n for n in (f"{r['mode']}@{r['world']}" for r in new["runs"]) if n in named or n not in have}
    merged["runs"] = [r for r in old["runs"] if f"{r['mode']}@{r['world']}" not in keep] + \
                     [r for r in new["runs"] if f"{r['mode']}@{r['world']}" in keep]
    if "single@1" in named:
        merged["single"] = new["single"]
    merged["partial_runs"] = old.get("partial_runs", []) + [
        {k: new[k] for k in ("command", "date_utc", "rounds", "seconds", "machine")} | {"layouts": sorted(keep)}]
    return merged


def add_counts(old: dict, new: dict) -> dict:
    """`old` results with the counted collectives of the same layouts in `new` (a --counts-only
    run) put into their rank rows; times and memory stay as they were (the counts do not depend
    on the machine's load, the times do)."""
    merged = copy.deepcopy(old)
    fresh = {f"{r['mode']}@{r['world']}": r for r in new["runs"]}
    added = []
    for run in merged["runs"]:
        got = fresh.get(f"{run['mode']}@{run['world']}")
        if got is None or run.get("overrides", got["overrides"]) != got["overrides"]:
            continue
        for rank_row, new_row in zip(run["per_rank"], got["per_rank"]):
            if "comm" in new_row:
                rank_row["comm"] = new_row["comm"]
        added.append(f"{run['mode']}@{run['world']}")
    merged["partial_runs"] = old.get("partial_runs", []) + [
        {k: new[k] for k in ("command", "date_utc", "seconds", "machine")} | {"counts_added_to": added}]
    return merged
