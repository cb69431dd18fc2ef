"""Helpers shared by the training benchmarks: machine facts, the matmul peak probe, results files."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kiln.train.peak import cpu_matmul_peak

RESULTS_DIR = Path(__file__).parent / "results"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:  # /proc/cpuinfo names the CPU model; platform.processor() is often just "x86_64"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores_visible": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "mkldnn_bf16_native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], seconds: float) -> dict[str, Any]:
    """Best FLOP/s over several square sizes: kiln's probe at one size can sit below the kernel's
    best (cache blocking favours some sizes), and MFU against a low peak would flatter us."""
    by_size = {n: cpu_matmul_peak(dtype, n=n, seconds=seconds) for n in sizes}
    best_n = max(by_size, key=by_size.get)
    return {"flops": by_size[best_n], "best_n": best_n,
            "by_size_gflops": {str(n): round(f / 1e9, 2) for n, f in by_size.items()}}


def train_in_child(overrides: list[str], run_dir: str) -> None:
    """Process target: one `kiln train` run. Lives here, not in a script, so that spawned children
    can import it (spawn passes the parent's sys.path, which holds benchmarks/)."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    train(load_config(None, overrides), run_dir, resume=False)


def free_port() -> int:
    """A TCP port free on this host now, for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, args: tuple, name: str, timeout_s: float = 900) -> list[Any]:
    """Spawn `world` processes running target(rank, world, free port, *args, queue) and return what
    each puts on the queue (one item per rank). A rank that dies or a run past `timeout_s` ends the
    benchmark with one line naming `name`, every process killed; so does a non-zero exit."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < world:
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"{name}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"{name}: a rank exited with {p.exitcode}")
    return results


def socket_bytes() -> int:
    """Bytes this process has written so far (/proc/self/io wchar: gloo's sockets, for a rank that
    writes no files while timed)."""
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))


def timed_train_steps(model, optimizer, batch, steps: int):
    """Inside a rank of `run_ranks`: one warm-up fp32 `train_step` of `batch` (micro-batches; DDP
    builds its reducer, FSDP its buffers), then `steps` timed ones, each after a barrier. Returns
    (median wall seconds, median bytes written to the sockets, the last loss, the step function)."""
    import torch.distributed as dist

    from kiln.train.step import train_step

    def step():
        return train_step(model, optimizer, batch, autocast=torch.autocast("cpu", enabled=False),
                          scaler=None, clip=0.0)[0]

    step()
    times, sent = [], []
    for _ in range(steps):
        dist.barrier()
        w0, b0 = time.perf_counter(), socket_bytes()
        loss = step()
        times.append(time.perf_counter() - w0)
        sent.append(socket_bytes() - b0)
    return statistics.median(times), statistics.median(sent), float(loss), step


def slowest_rank_median(ranks: list, values, rounds: int) -> float:
    """The median over `rounds` of the slowest rank's value in each round; `values(rank_result)`
    is that rank's list of per-round values."""
    return statistics.median(max(values(r)[i] for r in ranks) for i in range(rounds))


def add_sharded_set_args(parser) -> None:
    """The command-line options of a sharded-optimizer benchmark run over `sharded_parameter_set`:
    the worlds, rounds and steps measured, the parameter set's sizes and the tp degree."""
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree inside each world (FSDP2 over tp)")


def sharded_parameter_set(args, mesh, seed: int, sharded: bool = True):
    """optimizer_step.py's ShapeOnlyTransformer at args' sizes (`vocab`, `dim`, `layers`, `hidden`),
    seeded; `sharded`: each block tensor-parallel over mesh["tp"] first where args.tp > 1
    (Megatron's column / row plan), then FSDP2 per block and at the root over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from optimizer_step import ShapeOnlyTransformer

    torch.manual_seed(seed)
    model = ShapeOnlyTransformer(args.vocab, args.dim, args.layers, args.hidden)
    if not sharded:
        return model
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    for block in model.layers:
        if args.tp > 1:
            parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def join_gloo(rank: int, world: int, port: int) -> None:
    """Inside a rank of `run_ranks`: join the gloo group on this machine, one thread per process."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def gloo_rank_config(rank: int, world: int, port: int, args, *extra: str):
    """Inside a rank of `run_ranks`: join the gloo group (one thread per process) and return kiln's
    config of a transformer at args.dim, layers, heads and vocab on 64-token windows with the
    foreach optimizer, plus the `extra` overrides."""
    from kiln.config import load_config

    join_gloo(rank, world, port)
    return load_config(None, [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                              f"model.vocab_size={args.vocab}", "data.seq_len=64", "model.max_seq_len=64",
                              "optim.implementation='foreach'", *extra])


def rank_dims(cfg, rank: int, world: int, seq_len: int = 64):
    """Inside a rank of `run_ranks`: kiln's ParallelDims of cfg.parallel over the `world` gloo
    ranks (all on one node), its mesh built."""
    from kiln.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world, seq_len=seq_len)
    dims.build_mesh("cpu")
    return dims


def trainer_model(cfg, dims):
    """kiln's model and optimizer as the trainer builds them on CPU (`build_model` -> parallelize,
    the loss, `build_optimizer` -> `shard_optimizer_state`), seeded alike on every rank."""
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.train.optim import build_optimizer
    from kiln.train.system import resolve_loss
    from kiln.train.trainer import build_model

    device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(cfg, dims, device)
    model.loss_impl = resolve_loss(cfg.train.loss, device, False, tp=dims.tp)
    return model, shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims, model)


def stepped_transformer(rank: int, world: int, port: int, args, zero1: bool):
    """Inside a rank of `run_ranks`: join the gloo group, build kiln's transformer (args.dim,
    layers, heads, vocab) with the trainer's AdamW (foreach), wrapped in kiln's Zero1Optimizer when
    `zero1`, alike on every rank, and take one step on the same batch (the state exists). Returns
    (build, model, optimizer); build() gives a fresh, unstepped pair."""
    import torch.distributed as dist

    from kiln.model.transformer import Transformer
    from kiln.parallel.zero1 import Zero1Optimizer
    from kiln.train.optim import build_optimizer

    cfg = gloo_rank_config(rank, world, port, args)

    def build():
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        optimizer = build_optimizer(model, cfg.optim, "cpu")
        return model, Zero1Optimizer(optimizer, dist.group.WORLD) if zero1 else optimizer

    model, optimizer = build()
    tokens = torch.randint(0, args.vocab, (4, 65), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return build, model, optimizer


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write results/NAME.json, or to NAME itself when it is a path ending in .json (tests)."""
    path = Path(name) if name.endswith(".json") else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine_info(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def write_sized_results(script: str, argv: list[str] | None, args, **results: Any) -> None:
    """write_results(args.out, ...) for a benchmark of a `stepped_transformer` model: the command
    line, the model's dim / layers / vocab, the rounds, then `results`; prints where it went."""
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    sizes = {key: getattr(args, key) for key in ("dim", "layers", "vocab", "rounds")}
    print(f"wrote {write_results(args.out, {'command': command, **sizes, **results})}")


def paired_cells(ours: dict[str, float], theirs: dict[str, float],
                 fields: tuple[tuple[str, float, int], ...]) -> list[str]:
    """Table cells "ours / theirs" for each (key, scale, decimals) in `fields`."""
    return [f"{ours[key] * scale:.{digits}f} / {theirs[key] * scale:.{digits}f}" for key, scale, digits in fields]


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
