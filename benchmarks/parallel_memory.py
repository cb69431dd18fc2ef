"""Per-rank memory, step time and bytes sent per step of each data-parallel mode, on CPU/gloo.

For world sizes 1, 2, 4 and dp_mode ddp, zero1, zero2, fsdp, N processes (gloo) each build
kiln's transformer through the trainer's own path (`build_model` -> parallelize, then
`build_optimizer` -> `shard_optimizer_state`) and run AdamW steps on a fixed global batch.
Measured on every rank, then the largest rank is reported:

- parameters, gradients, optimizer state: bytes of the tensors this rank holds (the local shard
  of a DTensor) after a step; "after fwd" is parameter bytes held between forward and backward
  (what ZeRO-2 keeps gathered and ZeRO-3 does not);
- ideal: the single-process bytes / N for the parts the mode shards, the full bytes otherwise;
- activations: bytes autograd saves for backward in one forward (`SavedBytes`, torch's
  saved_tensors_hooks; parameters and their views excluded);
- step time: median wall time of the timed steps (slowest rank); with --rounds R every layout is
  measured R times, interleaved (round 1 runs every layout, then round 2, ...: a shared machine's
  load drifts over minutes), and the JSON keeps each round's value, their median and their spread
  ((max - min) / median) per layout, and the machine's load average (os.getloadavg) at each
  measurement;
- gloo collectives: all_reduce, all_gather, reduce_scatter and broadcast of 16 KiB - 16 MiB at 2
  and 4 processes, and a tensor copy of the same sizes on every rank at once, median of
  --collective-reps calls each, once per round (the samples kiln/plan/calibrate.py `fit_link`
  fits the link's latency and bandwidth and the memory bandwidth to);
- activations at each per-rank batch: one single-process forward's saved bytes (below);
- CPU seconds per step of each rank (time.process_time, all its threads): on a quiet machine
  their sum is about the step time x min(N, cores); far less means other work took the cores;
- the last timed step's loss (a sanity check: about ln(vocab) at init);
- sent per step: bytes this process wrote to its gloo sockets during one step (Linux
  /proc/self/io `wchar`; the step does no other writes). Ring all-reduce sends 2(N-1)/N of the
  gradient bytes per rank; all-gather and reduce-scatter (N-1)/N each.

    python benchmarks/parallel_memory.py [--dim 384 --layers 6 --vocab 4096] [--worlds 1,2,4]
        [--modes ddp,zero1,zero2,fsdp] [--steps 2] [--rounds 3] [--quick]

Writes benchmarks/results/parallel_memory.json and prints a markdown table. Memory figures are
exact byte counts (not allocator statistics), so they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine_info  # noqa: E402

MODES = ("ddp", "zero1", "zero2", "fsdp")
# Model-parallel layouts over all N processes (no data parallelism), run through the trainer's own
# step (kiln/train/step.py train_step, kiln/parallel/pipeline.py pipeline_train_step, with
# ContextParallel's sequence split): their config overrides, given N.
# Pipeline layouts untie the embeddings (kiln refuses to split tied ones over stages; run with them
# tied, before split_model checked that, the last stage's head was never initialized: NaN losses).
MODEL_PARALLEL = {
    "tp": lambda n: [f"parallel.tp={n}"],
    "cp": lambda n: [f"parallel.cp={n}"],
    "pp_gpipe": lambda n: [f"parallel.pp={n}", "parallel.pp_schedule='gpipe'", f"parallel.pp_microbatches={2 * n}",
                           "model.tie_embeddings=false"],
    "pp_1f1b": lambda n: [f"parallel.pp={n}", "parallel.pp_schedule='1f1b'", f"parallel.pp_microbatches={2 * n}",
                          "model.tie_embeddings=false"],
}
SHARDED = {"ddp": (), "zero1": ("optimizer",), "zero2": ("params", "grads", "optimizer"),
           "fsdp": ("params", "grads", "optimizer")}


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's optimizer
    return [v for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


class SavedBytes:
    """Bytes of the tensors autograd saves for backward during a forward (torch's
    saved_tensors_hooks; each storage counted once, parameters - leaves that require grad and their
    views, gathered FSDP ones included - excluded): the activations."""

    def __init__(self):
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t):
        if not t.is_nested and t.device.type == "cpu" and not hasattr(t, "to_local"):
            ptr = t.untyped_storage().data_ptr()
            base = t._base if t._base is not None else t  # weight.t() views save the parameter itself
            if not (base.is_leaf and base.requires_grad) and ptr not in self.seen:
                self.seen.add(ptr)
                self.total += t.untyped_storage().nbytes()
        return t


def sent_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))


def model_parallel_step(cfg, dims, model, tokens: torch.Tensor):
    """The trainer's step for a tp / cp / pp layout on the whole batch (every rank sees all of it:
    there is no data parallelism), set up in the trainer's order (pipeline, loss, context
    parallel, then the optimizer over the stage's parameters); returns (one step, optimizer)."""
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.train.optim import build_optimizer
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.pipeline import Pipeline, pipeline_train_step
    from kiln.train.evaluate import autocast_context
    from kiln.train.step import train_step
    from kiln.train.attention import configure_attention
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
        step.loss = float(loss)
    return step, optimizer


def measure_layout(rank: int, world: int, port: int, args: argparse.Namespace, mode: str) -> list[dict]:
    """One layout in this process (rank `rank` of `world`): every rank's row."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from kiln.config import load_config
    from kiln.model.transformer import lm_loss
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.trainer import build_model

    cfg = load_config(None, [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                             f"model.vocab_size={args.vocab}", f"data.seq_len={args.seq}", f"model.max_seq_len={args.seq}",
                             "train.dtype=fp32", "optim.implementation='foreach'", f"train.batch_size={args.batch}"]
                      + (MODEL_PARALLEL[mode](world) + ["parallel.dp_mode='ddp'"] if mode in MODEL_PARALLEL
                         else [f"parallel.dp_mode={mode!r}"]))
    dims = ParallelDims.from_config(cfg.parallel)
    device = torch.device("cpu")
    dims.build_mesh("cpu")
    model = build_model(cfg, dims, device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    if mode in MODEL_PARALLEL:
        mp_step, optimizer = model_parallel_step(cfg, dims, model, tokens)
    else:
        optimizer = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims)
    per_rank = args.batch // world
    x = tokens[rank * per_rank:(rank + 1) * per_rank, :-1]
    y = tokens[rank * per_rank:(rank + 1) * per_rank, 1:]

    def step() -> tuple[int, int]:
        if mode in MODEL_PARALLEL:  # no memory split here: the trainer's step zeroes the gradients
            mp_step()
            step.activations, step.loss = 0, mp_step.loss
            return 0, 0
        saved = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = lm_loss(model(x), y)
        step.activations, step.loss = saved.total, float(loss.detach())
        after_forward = local_bytes(model.parameters())
        loss.backward()
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return after_forward, grads

    # Two warm-up steps: the first builds DDP's reducer, FSDP's buffers and the optimizer state;
    # DDP rebuilds its buckets (in the gradients' arrival order) during the second.
    after_forward, grads = step()
    step()
    times, sent, cpu = [], [], []
    for _ in range(args.steps):
        if dist.is_initialized():
            dist.barrier()
        s0, t0, c0 = sent_bytes(), time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        sent.append(sent_bytes() - s0)
    row = {"params": local_bytes(model.parameters()), "params_after_forward": after_forward, "grads": grads,
           "optimizer": local_bytes(optimizer_state(optimizer)), "step_s": statistics.median(times),
           "cpu_s": statistics.median(cpu), "sent": statistics.median(sent), "loss": step.loss, "activations": step.activations, "n_params": sum(p.numel() for p in model.parameters())}
    rows = [row]
    if dist.is_initialized():
        rows = [None] * world
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    return rows


def worker(rank: int, world: int, ports: list[int], args: argparse.Namespace, modes: list[str],
           collective_reps: int, out: str) -> None:
    """Every mode of one world size in one set of processes (a process group per mode, built and
    destroyed in turn): spawning and importing torch once per world size, not per layout."""
    torch.set_num_threads(1)
    collectives = collective_times(rank, world, ports[-1], collective_reps) if collective_reps else []
    # An untimed first layout: a fresh process's first-time costs (lazy initialisation, page faults)
    # would otherwise land on whichever layout comes first.
    measure_layout(rank, world, ports[-2], argparse.Namespace(**{**vars(args), "steps": 1}), modes[0])
    layouts = {mode: measure_layout(rank, world, port, args, mode) for mode, port in zip(modes, ports)}
    if rank == 0:
        Path(out).write_text(json.dumps({"layouts": layouts, "collectives": collectives}))


COLLECTIVE_SIZES = (2**14, 2**18, 2**22, 2**24)  # bytes of the full (unsharded) tensor


def collective_times(rank: int, world: int, port: int, reps: int) -> list[dict]:
    """Median seconds of each gloo collective at each size (the slowest rank's)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch: the older name
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    for nbytes in COLLECTIVE_SIZES:
        full = torch.ones(nbytes // 4)
        shard = torch.ones(nbytes // 4 // world)
        copy_to = torch.empty_like(full)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: gather(full, shard),
               "reduce_scatter": lambda: scatter(shard, full),
               "broadcast": lambda: dist.broadcast(full, src=0),
               "copy": lambda: copy_to.copy_(full)}  # every rank at once, as FSDP2's copy-in/out
        for op, call in ops.items():
            call()  # warm-up: connections and buffers
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            rows.append({"op": op, "ranks": world, "bytes": nbytes, "seconds": statistics.median(times)})
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    return [max((g[i] for g in gathered), key=lambda r: r["seconds"]) for i in range(len(rows))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, modes: list[str], args, collective_reps: int = 0) -> dict:
    """{"layouts": {mode: rows}, "collectives": [...]} for `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if world == 1:
            worker(0, 1, [0, 0, 0], args, modes, 0, out)
        else:
            ports = [free_port() for _ in range(len(modes) + 2)]
            mp.spawn(worker, args=(world, ports, args, modes, collective_reps, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def spread(values: list[float]) -> float:
    """Round-to-round spread: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per measurement (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every layout this many times, interleaved (a shared machine's load drifts); "
                         "step_s is the median over the rounds")
    ap.add_argument("--collective-reps", type=int, default=5)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model-parallel", default=",".join(MODEL_PARALLEL),
                    help="model-parallel layouts run at --model-parallel-world processes ('' for none)")
    ap.add_argument("--model-parallel-world", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model, world 1 and 2, one round: checks the script runs")
    ap.add_argument("--out", default=str(RESULTS_DIR / "parallel_memory.json"))
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.heads, args.vocab, args.seq, args.batch, args.steps = 32, 2, 2, 256, 16, 4, 1
        args.worlds, args.rounds, args.collective_reps = "1,2", 1, 2
    worlds = [int(w) for w in args.worlds.split(",")]
    modes = args.modes.split(",")
    if any(args.batch % w for w in worlds):
        ap.error(f"--batch {args.batch} must be divisible by every world size {worlds}")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    extra = [m for m in args.model_parallel.split(",") if m]
    if any(m not in MODEL_PARALLEL for m in extra):
        ap.error(f"--model-parallel: choose from {', '.join(MODEL_PARALLEL)}")
    mp_world = args.model_parallel_world
    if extra and (mp_world not in worlds or mp_world == 1 or args.layers % mp_world or args.heads % mp_world):
        ap.error(f"--model-parallel-world {mp_world} must be one of --worlds (> 1) and divide --layers and --heads")

    started = time.perf_counter()
    layouts = [(1, "ddp")] + [(w, m) for w in worlds if w > 1 for m in modes + (extra if w == mp_world else [])]
    measured: dict[tuple[int, str], list[list[dict]]] = {k: [] for k in layouts}
    loads: dict[tuple[int, str], list[float]] = {k: [] for k in layouts}
    collectives, rounds_log = [], []
    for r in range(args.rounds):
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        for world in worlds:
            world_modes = ["ddp"] if world == 1 else modes + (extra if world == mp_world else [])
            load = os.getloadavg()[0]
            got = measure(world, world_modes, args, args.collective_reps if world > 1 else 0)
            collectives += [dict(row, round=r) for row in got["collectives"]]
            for mode in world_modes:
                loads[(world, mode)].append(load)
                measured[(world, mode)].append(got["layouts"][mode])
                print(f"round {r + 1}/{args.rounds} {mode} x{world}: "
                      f"{max(x['step_s'] for x in got['layouts'][mode]):.3f} s (load {load:.1f})", flush=True)
        rounds_log.append({"round": r, "seconds": time.perf_counter() - t0, "loadavg_1min_start": load0,
                           "loadavg_1min_end": os.getloadavg()[0]})

    def rows_of(world: int, mode: str) -> tuple[list[dict], dict]:
        rounds = measured[(world, mode)]
        rows = rounds[0]
        for rank, row in enumerate(rows):
            row["step_s_rounds"] = [rr[rank]["step_s"] for rr in rounds]
            row["step_s"] = statistics.median(row["step_s_rounds"])
        slowest = [max(x["step_s"] for x in rr) for rr in rounds]  # the step ends when the slowest rank does
        cores = min(world, os.cpu_count() or 1)
        busy = [sum(x.get("cpu_s", 0.0) for x in rr) / (t * cores) for rr, t in zip(rounds, slowest)]
        return rows, {"step_s_rounds": slowest, "step_s_median": statistics.median(slowest), "cpu_busy_rounds": busy,
                      "step_s_spread": spread(slowest), "loadavg_1min": loads[(world, mode)]}

    # What autograd saves depends on the per-rank batch, not the mode: one forward per batch size.
    activations = {}
    for b in sorted({args.batch // w for w in worlds}):
        one = measure(1, ["ddp"], argparse.Namespace(**{**vars(args), "batch": b, "steps": 1}))
        activations[str(b)] = one["layouts"]["ddp"][0]["activations"]

    single, single_time = rows_of(1, "ddp")
    single = single[0]
    results = {"single": dict(single, **single_time), "runs": [], "collectives": collectives,
               "activations_by_batch": activations, "rounds": rounds_log,
               "args": {k: v for k, v in vars(args).items() if k != "out"}}
    lines = [f"model: {single['n_params'] / 1e6:.2f}M params, global batch {args.batch} x {args.seq} tokens, "
             f"fp32 AdamW; bytes per rank (largest rank), MB = 2^20 bytes; step s: median of {args.rounds} "
             f"interleaved rounds (spread = (max - min) / median)", "",
             "| mode | N | params MB (ideal) | after fwd MB | grads MB (ideal) | optim MB (ideal) | "
             "worst part / ideal | step s | spread | sent/step MB |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| single | 1 | {single['params'] / 2**20:.2f} | {single['params_after_forward'] / 2**20:.2f} | "
             f"{single['grads'] / 2**20:.2f} | {single['optimizer'] / 2**20:.2f} | 1.00 | "
             f"{single_time['step_s_median']:.3f} | {single_time['step_s_spread']:.0%} | 0 |"]
    for world in worlds:
        if world == 1:
            continue
        for mode in modes:
            rows, timing = rows_of(world, mode)
            worst = {k: max(r[k] for r in rows) for k in rows[0] if not k.endswith("_rounds")}
            ideal = {k: single[k] / (world if k in SHARDED[mode] else 1) for k in ("params", "grads", "optimizer")}
            ratio = max(worst[k] / ideal[k] for k in ideal)
            results["runs"].append({"mode": mode, "world": world, "per_rank": rows, "ideal": ideal,
                                    "worst_over_ideal": ratio, **timing})
            lines.append(
                f"| {mode} | {world} | " + " | ".join(
                    f"{worst[k] / 2**20:.2f} ({ideal[k] / 2**20:.2f})" if k != "params_after_forward"
                    else f"{worst[k] / 2**20:.2f}" for k in ("params", "params_after_forward", "grads", "optimizer"))
                + f" | {ratio:.2f} | {timing['step_s_median']:.3f} | {timing['step_s_spread']:.0%} | "
                  f"{worst['sent'] / 2**20:.2f} |")
    for mode in extra:  # model-parallel: time and traffic (the memory split is the DP modes' table)
        rows, timing = rows_of(mp_world, mode)
        results["runs"].append({"mode": mode, "world": mp_world, "per_rank": rows, **timing})
        lines.append(f"| {mode} | {mp_world} | {max(r['params'] for r in rows) / 2**20:.2f} | - | - | "
                     f"{max(r['optimizer'] for r in rows) / 2**20:.2f} | - | {timing['step_s_median']:.3f} | "
                     f"{timing['step_s_spread']:.0%} | {max(r['sent'] for r in rows) / 2**20:.2f} |")
    lines += ["", "CPU busy (ranks' CPU seconds / (step s x cores they could use); about 1 on a quiet machine) "
              "per layout, rounds in order: " + "; ".join(
                  f"{r['mode']} x{r['world']} " + " ".join(f"{b:.2f}" for b in r["cpu_busy_rounds"])
                  for r in [dict(results["single"], mode="single", world=1)] + results["runs"])]
    lines += ["", "load average (1 min) per round: " + ", ".join(
        f"{r['loadavg_1min_start']:.1f} -> {r['loadavg_1min_end']:.1f}" for r in rounds_log)
        + f"; total {time.perf_counter() - started:.0f} s"]
    table = "\n".join(lines)
    print(table)
    results.update(table=table, machine=machine_info(), command="python " + " ".join(sys.argv),
                   date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=time.perf_counter() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
