"""Per-rank memory, step time and communication per step of each parallel layout, on CPU/gloo.

N processes (gloo) build kiln's transformer through the trainer's own path (`build_model` ->
parallelize, `build_optimizer` -> `shard_optimizer_state`) and run AdamW steps on a fixed global
batch. The layouts (benchmarks/parallel_rows.py): 1 process; ddp, zero1, zero2, fsdp at 2 and 4;
HSDP (dp_replicate 2 x dp_shard 2) at 4; a mixture-of-experts variant of the model (4 experts of a
quarter of the FFN each, top-2) in 1 process, under fsdp and under expert parallelism (ep=2 carved
out of dp_shard) at 2 and 4; DiLoCo with 2 replicas; tp, cp, pipelines (GPipe, 1F1B at 2 and 4;
interleaved 1F1B, interleaved zero-bubble and ZBV zero-bubble with 2 stages per rank at 2 and 4,
at 4 on a deeper variant of the model with its own 1-process row when the model has fewer than
8 layers) through the trainer's step.
Measured on every rank, then the largest rank is reported:

- parameters, gradients, optimizer state: bytes of the tensors this rank holds (the local shard
  of a DTensor) after a step; "after fwd" is parameter bytes held between forward and backward
  (what ZeRO-2 keeps gathered and ZeRO-3 does not); DiLoCo's optimizer bytes include its anchor
  and outer momentum;
- ideal: the single-process bytes (of the same model) / the ranks a layout shards a part over;
- activations: bytes autograd saves for backward in one forward (`SavedBytes`, torch's
  saved_tensors_hooks; parameters and their views excluded), per per-rank batch, 1 process;
- step time: median wall time of the timed steps (slowest rank); with --rounds R every layout is
  measured R times, interleaved (round 1 runs every layout, then round 2, ...: a shared machine's
  load drifts over minutes); the JSON keeps each round's value, their median, their spread
  ((max - min) / median), the load average at each measurement and, per layout, the ratio to its
  model's single-process step measured in the same rounds;
- DiLoCo: one measured step is H = --diloco-inner-steps inner steps and the outer sync, divided
  by H (time, traffic); the inner step and the sync are also kept apart;
- communication per step, two ways: (a) the collectives kiln issues, counted from torch's
  profiler in one extra step of round 1 (benchmarks/comm_count.py: calls and payload bytes per
  op); (b) bytes this process wrote to its gloo sockets per timed step (Linux /proc/self/io
  `wchar`; the step does no other writes);
- CPU seconds per step of each rank (time.process_time, all its threads): on a quiet machine
  their sum is about the step time x min(N, cores); far less means other work took the cores;
- the last timed step's loss (a sanity check: about ln(vocab) at init);
- pipelines: the bubble fraction the trainer's run row reports for the layout (computed from the
  schedule, stages and micro-batches, not measured);
- gloo collectives (full runs only): all_reduce, all_gather, reduce_scatter, broadcast and a
  copy of 16 KiB - 16 MiB at 2 and 4 processes, for kiln/plan/calibrate.py `fit_link`.

    python benchmarks/parallel_memory.py [--dim 384 --layers 6 --vocab 4096] [--worlds 1,2,4]
        [--only hsdp,moe_ep,diloco,tp@4] [--steps 2] [--rounds 3] [--diloco-inner-steps 8] [--quick]

--only MODE[@N],... measures just those layouts (and their model's single-process reference,
for the ratio) and merges them into the existing results file: rows of the same layout are
replaced, the others kept, each row with its own date and load. Writes
benchmarks/results/parallel_memory.json and prints a markdown table of every row it holds.
Memory figures are exact byte counts (not allocator statistics): they do not depend on load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln, not an installed one
from comm_count import counting_collectives, scaled  # noqa: E402
from common import RESULTS_DIR, free_port, machine_info  # noqa: E402
from parallel_results import add_counts, merge, render_table  # noqa: E402
from parallel_rows import MOE_EXPERTS, Row, rows, select, unsupported  # noqa: E402
from rank_measures import (SavedBytes, collective_times, local_bytes, optimizer_state,  # noqa: E402
                           sent_bytes)

MODEL_ARGS = ("dim", "layers", "heads", "vocab", "seq", "batch")  # rows measured together share these


def model_parallel_step(cfg, dims, model, tokens: torch.Tensor):
    """The trainer's step for a tp / cp / pp layout on the whole batch (every rank sees all of it:
    there is no data parallelism), set up in the trainer's order (pipeline, loss, context
    parallel, then the optimizer over the stage's parameters); returns (one step, optimizer)."""
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.pipeline import Pipeline
    from kiln.train.pipeline_step import pipeline_train_step
    from kiln.train.attention import configure_attention
    from kiln.train.evaluate import autocast_context
    from kiln.train.optim import build_optimizer
    from kiln.train.step import train_step
    from kiln.train.system import compute_dtype, resolve_loss

    device = torch.device("cpu")
    pipeline = Pipeline(model, cfg, dims, device) if dims.pp > 1 else None
    model.loss_impl = resolve_loss(cfg.train.loss, device, False, tp=dims.tp)
    configure_attention(model, cfg.train.attention_backend, device, compute_dtype(cfg.train.dtype),
                        cfg.train.batch_size, cfg.data.seq_len)
    context_parallel = ContextParallel(model, dims, cfg.data.seq_len, device)
    micro = [context_parallel.shard(tokens[:, :-1], tokens[:, 1:])]
    autocast = autocast_context(device, cfg.train.dtype)
    optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)

    def step() -> None:
        with context_parallel:
            loss, _, _ = (pipeline_train_step if pipeline else train_step)(pipeline or model, optimizer, micro,
                                                                           autocast=autocast, scaler=None, clip=0.0)
        step.loss = float(loss.detach())
    # What the trainer's run row reports as bubble_fraction (kiln/parallel/pipeline.py; an upper
    # bound for the zero-bubble schedules, which fill the bubble with weight-gradient passes).
    step.bubble = pipeline.bubble if pipeline else None
    return step, optimizer


def measure_layout(rank: int, world: int, port: int, args: argparse.Namespace, row: Row,
                   count_comm: bool) -> list[dict]:
    """One layout in this process (rank `rank` of `world`): every rank's row."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from kiln.config import load_config
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.diloco import DiLoCo, replicated_group
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.trainer import build_model

    from kiln import torch_compat

    # foreach AdamW everywhere (the planner's timing of these rows assumes it), but per tensor where
    # this torch cannot step the experts' and the dense meshes together (before 2.9: kiln refuses)
    multi_mesh = any(o.startswith("parallel.ep=") and o != "parallel.ep=1" for o in row.overrides)
    impl = "single" if multi_mesh and not torch_compat.fused_adam_across_meshes() else "foreach"
    cfg = load_config(None, [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                             f"model.vocab_size={args.vocab}", f"data.seq_len={args.seq}", f"model.max_seq_len={args.seq}",
                             "train.dtype=fp32", f"optim.implementation={impl!r}", f"train.batch_size={args.batch}"]
                      + list(row.overrides))
    dims = ParallelDims.from_config(cfg.parallel, seq_len=cfg.data.seq_len)
    dims.check_model(cfg)
    device = torch.device("cpu")
    dims.build_mesh("cpu")
    model = build_model(cfg, dims, device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    diloco = None
    per_rank = args.batch // dims.dp_size  # mp rows: the whole batch, unless ddp x pp (each replica its half)
    first = dims.dp_rank * per_rank
    if row.kind == "mp":
        mp_step, optimizer = model_parallel_step(cfg, dims, model, tokens[first:first + per_rank])
    else:
        optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)
        if row.kind == "diloco":
            across = dims.mesh["dp_replicate"] if dims.dp_replicate > 1 else None  # as kiln's trainer
            diloco = DiLoCo(model, cfg.parallel.diloco_inner_steps, cfg.parallel.diloco_outer_lr,
                            cfg.parallel.diloco_outer_momentum, group=across.get_group() if across else None,
                            inside=replicated_group(dims))
    x, y = tokens[first:first + per_rank, :-1], tokens[first:first + per_rank, 1:]

    def dp_step() -> tuple[int, int]:
        saved = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = model(x, y)  # the loss (with a mixture of experts' auxiliary losses)
        step.activations, step.loss = saved.total, float(loss.detach())
        after_forward = local_bytes(model.parameters())
        loss.backward()
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return after_forward, grads

    inner, outer = [], []

    def step() -> tuple[int, int]:
        """One measured step: a training step, or DiLoCo's H inner steps and its outer sync."""
        if row.kind == "mp":  # no memory split here: the trainer's step zeroes the gradients
            mp_step()
            step.activations, step.loss = 0, mp_step.loss
            return 0, 0
        if diloco is None:
            return dp_step()
        for _ in range(diloco.inner_steps):
            t0 = time.perf_counter()
            result = dp_step()
            inner.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        diloco.outer_step()
        outer.append(time.perf_counter() - t0)
        return result

    per_step = diloco.inner_steps if diloco else 1  # training steps in one measured step
    # Warm-up: the first step builds DDP's reducer, FSDP's buffers and the optimizer state; DDP
    # rebuilds its buckets (in the gradients' arrival order) during the second. DiLoCo: two inner
    # steps and a sync, then one timed window of H inner steps (H samples of the inner step).
    after_forward, grads = dp_step() if diloco else step()
    step() if diloco is None else (dp_step(), diloco.outer_step())
    inner.clear(), outer.clear()
    times, sent, cpu = [], [], []
    for _ in range(1 if diloco else args.steps):
        if dist.is_initialized():
            dist.barrier()
        s0, t0, c0 = sent_bytes(), time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - t0) / per_step)
        cpu.append((time.process_time() - c0) / per_step)
        sent.append((sent_bytes() - s0) / per_step)
    optim_bytes = local_bytes(optimizer_state(optimizer))
    if diloco is not None:  # the anchor and the outer Nesterov momentum: a second optimizer's state
        optim_bytes += local_bytes(diloco.anchors()) + local_bytes(diloco.momenta())
    result = {"params": local_bytes(model.parameters()), "params_after_forward": after_forward, "grads": grads,
              "optimizer": optim_bytes, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
              "sent": statistics.median(sent), "loss": step.loss, "activations": step.activations,
              "n_params": sum(p.numel() for p in model.parameters())}
    if row.kind == "mp" and mp_step.bubble is not None:
        result["bubble_fraction"] = mp_step.bubble
    if diloco is not None:
        result.update(inner_step_s=statistics.median(inner), outer_sync_s=statistics.median(outer),
                      sync_every=diloco.inner_steps)
    if count_comm and dist.is_initialized():
        dist.barrier()
        with counting_collectives() as comm:
            step()
        result["comm"] = scaled(comm, per_step)
    rows_ = [result]
    if dist.is_initialized():
        rows_ = [None] * world
        dist.all_gather_object(rows_, result)
        dist.destroy_process_group()
    return rows_


def worker(rank: int, world: int, ports: list[int], args: argparse.Namespace, layouts: list[Row],
           collective_reps: int, count_comm: bool, out: str) -> None:
    """Every layout of one world size in one set of processes (a process group per layout, built
    and destroyed in turn): spawning and importing torch once per world size, not per layout."""
    torch.set_num_threads(1)
    collectives = collective_times(rank, world, ports[-1], collective_reps) if collective_reps else []
    # An untimed first layout: a fresh process's first-time costs (lazy initialisation, page faults)
    # would otherwise land on whichever layout comes first.
    measure_layout(rank, world, ports[-2], argparse.Namespace(**{**vars(args), "steps": 1}), layouts[0], False)
    measured = {row.name: measure_layout(rank, world, port, args, row, count_comm)
                for row, port in zip(layouts, ports)}
    if rank == 0:
        Path(out).write_text(json.dumps({"layouts": measured, "collectives": collectives}))


def measure(world: int, layouts: list[Row], args, collective_reps: int = 0, count_comm: bool = False) -> dict:
    """{"layouts": {row name: per-rank rows}, "collectives": [...]} for `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if world == 1:
            worker(0, 1, [0] * (len(layouts) + 2), args, layouts, 0, False, out)
        else:
            ports = [free_port() for _ in range(len(layouts) + 2)]
            mp.spawn(worker, args=(world, ports, args, layouts, collective_reps, count_comm, out), nprocs=world,
                     join=True)
        return json.loads(Path(out).read_text())


def spread(values: list[float]) -> float:
    """Round-to-round spread: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def run_entry(row: Row, rounds: list[list[dict]], loads: list[float], single: dict | None) -> dict:
    """The results file's entry of one layout from its rounds (rank rows of round 1: memory and
    the counted collectives; step time: the slowest rank per round, median over rounds)."""
    slowest = [max(x["step_s"] for x in rr) for rr in rounds]  # the step ends when the slowest rank does
    cores = min(row.world, os.cpu_count() or 1)
    busy = [sum(x.get("cpu_s", 0.0) for x in rr) / (t * cores) for rr, t in zip(rounds, slowest)]
    per_rank = rounds[0]  # after `slowest`: this overwrites round 1's step_s with the median
    for rank, r in enumerate(per_rank):
        r["step_s_rounds"] = [rr[rank]["step_s"] for rr in rounds]
        r["step_s"] = statistics.median(r["step_s_rounds"])
    entry = {"mode": row.mode, "world": row.world, "kind": row.kind, "family": row.family,
             "overrides": list(row.overrides), "per_rank": per_rank, "step_s_rounds": slowest,
             "step_s_median": statistics.median(slowest), "cpu_busy_rounds": busy, "step_s_spread": spread(slowest),
             "loadavg_1min": loads, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if row.world == 1:
        single = per_rank[0]
    if single is not None and row.kind != "mp":  # mp rows: time and traffic only
        entry["ideal"] = {k: single[k] / (row.shard if k in row.sharded else 1) for k in ("params", "grads", "optimizer")}
        entry["worst_over_ideal"] = max(max(r[k] for r in per_rank) / entry["ideal"][k] for k in entry["ideal"])
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per measurement (after the warm-up)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every layout this many times, interleaved (a shared machine's load drifts); "
                         "step_s is the median over the rounds")
    ap.add_argument("--collective-reps", type=int, default=5, help="timed gloo collectives (full runs only)")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--only", default="", help="MODE or MODE@N, comma-separated: measure just these layouts (and "
                                               "their model's 1-process reference) and merge them into --out")
    ap.add_argument("--counts-only", action="store_true",
                    help="with --only: one round, and only the counted collectives go into the existing rows of "
                         "--out (their times and memory stay)")
    ap.add_argument("--diloco-inner-steps", type=int, default=8, help="DiLoCo's H: inner steps per outer sync")
    ap.add_argument("--quick", action="store_true", help="tiny model, world 1 and 2, one round: checks the script runs")
    ap.add_argument("--out", default=str(RESULTS_DIR / "parallel_memory.json"))
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.heads, args.vocab, args.seq, args.batch, args.steps = 32, 4, 2, 256, 16, 4, 1
        args.worlds, args.rounds, args.collective_reps, args.diloco_inner_steps = "1,2", 1, 2, 2
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.counts_only:
        if not args.only or not Path(args.out).is_file():
            ap.error("--counts-only adds counts to layouts of an existing --out: pass --only and that file")
        args.rounds, args.steps = 1, 1
    if any(args.batch % w for w in worlds):
        ap.error(f"--batch {args.batch} must be divisible by every world size {worlds}")
    if args.rounds < 1 or args.steps < 1 or args.diloco_inner_steps < 1:
        ap.error("--rounds, --steps and --diloco-inner-steps must be >= 1")
    from kiln.config import ModelConfig
    from kiln.model.transformer import ffn_hidden_size

    moe_hidden = ffn_hidden_size(ModelConfig(dim=args.dim)) // MOE_EXPERTS  # together: the dense FFN's parameters
    all_rows = rows(args.dim, args.heads, args.layers, args.seq, moe_hidden, args.diloco_inner_steps)
    try:
        layouts = select(all_rows, args.only, worlds)
    except ValueError as e:
        ap.error(str(e))
    if args.only and not Path(args.out).is_file() and layouts[0].name != "single@1":
        layouts.insert(0, all_rows[0])  # a new file's table and activations are of the benchmark model
    old = None
    if args.only and Path(args.out).is_file():
        try:
            old = json.loads(Path(args.out).read_text())
            old_args = {k: old["args"][k] for k in MODEL_ARGS}
            # What a merge and the table read, checked before any measuring.
            old["single"]["n_params"], [(r["mode"], int(r["world"]), r["per_rank"][0], r["step_s_median"])
                                        for r in old["runs"]]  # noqa: B018
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"--only merges into {args.out}, which is not a parallel_memory.py results file ({e!r}); "
                     f"pass another --out")
        if old_args != {k: vars(args)[k] for k in MODEL_ARGS}:
            ap.error(f"--only: {args.out} was measured with {old_args}; pass the same model and batch "
                     f"or another --out")
    named = {r.name for r in layouts if not args.only or r.mode in args.only.split(",") or r.name in args.only.split(",")}

    started = time.perf_counter()
    by_world = {w: [r for r in layouts if r.world == w] for w in sorted({r.world for r in layouts})}
    measured: dict[str, list[list[dict]]] = {r.name: [] for r in layouts}
    loads: dict[str, list[float]] = {r.name: [] for r in layouts}
    collectives, rounds_log = [], []
    for rnd in range(args.rounds):
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        for world, world_rows in by_world.items():
            load = os.getloadavg()[0]
            reps = args.collective_reps if world > 1 and not args.only else 0
            got = measure(world, world_rows, args, reps, count_comm=rnd == 0)
            collectives += [dict(c, round=rnd) for c in got["collectives"]]
            for row in world_rows:
                loads[row.name].append(load)
                measured[row.name].append(got["layouts"][row.name])
                print(f"round {rnd + 1}/{args.rounds} {row.mode} x{world}: "
                      f"{max(x['step_s'] for x in got['layouts'][row.name]):.3f} s (load {load:.1f})", flush=True)
        rounds_log.append({"round": rnd, "seconds": time.perf_counter() - t0, "loadavg_1min_start": load0,
                           "loadavg_1min_end": os.getloadavg()[0]})

    singles = {r.name: run_entry(r, measured[r.name], loads[r.name], None) for r in layouts if r.world == 1}
    runs = []
    for row in layouts:
        ref = singles.get(row.reference)
        entry = singles[row.name] if row.world == 1 else \
            run_entry(row, measured[row.name], loads[row.name], ref["per_rank"][0] if ref else None)
        if ref is not None:
            entry["vs_single"] = entry["step_s_median"] / ref["step_s_median"]
        if row.mode != "single":
            runs.append(entry)
    single = singles.get("single@1")
    single = dict(single["per_rank"][0], **{k: v for k, v in single.items() if k != "per_rank"}) if single else None
    results = {"single": single, "runs": runs, "rounds": rounds_log, "seconds": time.perf_counter() - started,
               "args": {k: v for k, v in vars(args).items() if k != "out"}, "machine": machine_info(),
               "command": "python " + " ".join(sys.argv),
               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.counts_only:
        results = add_counts(old, results)
    elif old is not None:
        results = merge(old, results, named)
    else:
        # What autograd saves depends on the per-rank batch, not the layout: one forward per batch size.
        results["activations_by_batch"] = {
            str(b): measure(1, [layouts[0]], argparse.Namespace(**{**vars(args), "batch": b, "steps": 1})
                            )["layouts"]["single@1"][0]["activations"] for b in sorted({args.batch // w for w in worlds})}
        results["collectives"] = collectives
    results["not_measured"] = unsupported(args.dim, args.heads, args.layers, args.seq)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))  # before anything else can fail
    table = render_table(results) + "\n\nload average (1 min) per round of this run: " + ", ".join(
        f"{r['loadavg_1min_start']:.1f} -> {r['loadavg_1min_end']:.1f}" for r in rounds_log) + \
        f"; {time.perf_counter() - started:.0f} s" + "".join(f"\nnot measured: {u}" for u in results["not_measured"])
    print(table)
    results["table"] = table
    Path(args.out).write_text(json.dumps(results, indent=1))

if __name__ == "__main__":
    main()
