"""kiln plan [CONFIG] --cluster NAME|FILE [--nodes N] [--islands N] [--budget-flops C | --gpu-hours H] [--out PLAN.toml]
   kiln plan --cluster NAME|FILE --calibrate RUN_DIR... [--calibrated-out FILE]
   kiln plan --cluster NAME|FILE [--calibrate RUN_DIR...] (--time-collectives 2,4 | --collectives FILE.json)

What to train (compute-optimal model and tokens for a budget) and how (the fastest layout that
fits), with the checkpoint interval, wall time and cost; the best plan is written as a config
that `kiln train` runs as is. A config with DiLoCo (parallel.diloco_inner_steps) is planned on a
cluster of islands, one replica per island (kiln/plan/diloco.py).
"""

from __future__ import annotations

import argparse
import math

from kiln.errors import KilnError

SMALLEST_PARAMS = 1e5  # below this a "model" is a few embedding rows; nothing worth planning


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML (default: the embedded default job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key; repeatable")
    p.add_argument("--cluster", default="h100", help="preset (a100, h100, h200, cpu-local) or cluster TOML path")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the cluster file's)")
    p.add_argument("--islands", type=int, help="groups of nodes joined by the cluster's slow island link, one "
                                               "DiLoCo replica each (default: the cluster file's, 1)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-flops", type=float, metavar="C", help="compute budget in FLOPs: plan the model too")
    budget.add_argument("--gpu-hours", type=float, metavar="H", help="budget as GPU-hours at --mfu of peak")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for --gpu-hours (default 0.4)")
    p.add_argument("--law", default="chinchilla-1", choices=("kaplan", "chinchilla-1", "chinchilla-2", "chinchilla-3"),
                   help="which optimal allocation sizes the model (default chinchilla-1)")
    p.add_argument("--tokens", type=float, help="training tokens (default: the budget's, else Chinchilla-optimal for the model)")
    p.add_argument("--fit-sweep", metavar="SWEEP_DIR", help="fit the loss law to a `kiln sweep` directory's runs")
    p.add_argument("--global-batch", type=int, metavar="SEQS",
                   help="sequences per optimizer step (default: train.global_batch_size, else "
                        "train.batch_size x grad_accum x GPUs)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16", "float8"))
    for dim in ("tp", "pp", "cp"):
        p.add_argument(f"--max-{dim}", type=int, default=None, metavar="N",
                       help=f"largest {dim} degree to consider (1: data-parallel layouts only)")
    p.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--as-configured", action="store_true",
                   help="predict the config's own layout (its [parallel], batch and activation checkpointing) on "
                        "the cluster instead of searching: whether kiln train takes it at the cluster's world "
                        "size, memory per rank and step time, next to the search's fastest; nothing is written")
    p.add_argument("--out", default="plan.toml", help="where to write the best plan's config (default plan.toml)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                   help="fit --cluster's efficiency curve, link bandwidth and overlap to these kiln runs and "
                        "write the calibrated cluster to --calibrated-out (no plan is made)")
    p.add_argument("--calibrated-out", default="cluster-calibrated.toml", help="(default cluster-calibrated.toml)")
    links = p.add_mutually_exclusive_group()
    links.add_argument("--time-collectives", metavar="N[,N...]",
                       help="time all-reduce / all-gather / reduce-scatter / broadcast at several sizes over N "
                            "processes of this machine, fit the link's latency and bandwidth to them (with "
                            "--calibrate: before fitting the runs) and write --calibrated-out")
    links.add_argument("--collectives", metavar="FILE.json",
                       help="timed collectives to fit the link to instead (as --collectives-out writes, or "
                            "benchmarks/parallel_memory.py's results)")
    p.add_argument("--collective-backend", choices=("gloo", "nccl"),
                   help="backend of the timed collectives (default: nccl with CUDA, else gloo; for --collectives "
                        "the cluster's): gloo reduce-scatters as an all-reduce")
    p.add_argument("--collectives-out", default="collectives.json",
                   help="where --time-collectives writes its samples (default collectives.json)")


def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f}"


def _fmt_s(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.3g} s"


def _link_samples(args: argparse.Namespace, cluster) -> list:
    """Timed collectives from --time-collectives (run now) or --collectives (a file), or []."""
    from kiln.io import atomic_write_text
    from kiln.plan.collectives import read_collectives, samples_json, time_collectives

    if args.collectives:
        if args.collective_backend:
            cluster.backend = args.collective_backend
        return read_collectives(args.collectives)
    if not args.time_collectives:
        return []
    try:
        counts = [int(n) for n in args.time_collectives.split(",")]
    except ValueError:
        raise KilnError(f"--time-collectives {args.time_collectives!r}: expected process counts such as 2,4") from None
    backend = args.collective_backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    cluster.backend = backend
    samples = []
    for n in counts:
        print(f"timing {backend} collectives over {n} processes ...", flush=True)
        samples += time_collectives(n, backend)
    atomic_write_text(args.collectives_out, samples_json(samples))
    print(f"wrote {len(samples)} timed collectives to {args.collectives_out}")
    return samples


def _calibrate(args: argparse.Namespace, cluster) -> int:
    from kiln.io import atomic_write_text
    from kiln.plan.calibrate import cluster_toml, fit_cluster, fit_link, measured_run, predicted_step

    runs = [measured_run(d) for d in args.calibrate or []]  # read them all before timing anything
    links = _link_samples(args, cluster)
    fitted = fit_cluster(cluster, runs, links=links or None) if runs else fit_link(cluster, links)
    if links:
        print(f"link fitted to {len(links)} timed collectives ({cluster.backend}): latency "
              f"{fitted.intra_node.latency_us:.3g} us, bandwidth {fitted.intra_node.bandwidth_gbps:.3g} GB/s, "
              f"memory bandwidth {fitted.device.memory_bandwidth_gbps:.3g} GB/s")
    if runs:
        print(f"calibrated {cluster.name} on {len(runs)} runs: max_efficiency {fitted.device.max_efficiency:.3g}, "
              f"half_efficiency_work {fitted.device.half_efficiency_work:.3g}, link "
              f"{fitted.intra_node.bandwidth_gbps:.3g} GB/s, overlap {fitted.overlap_efficiency:.2g}, launch "
              f"{fitted.collective_launch_us:.3g} us per collective")
    for m in runs:
        print(f"  {m.name}: {m.layout.describe()}  measured {m.step_s:.4g} s, fitted {predicted_step(m, fitted):.4g} s")
    atomic_write_text(args.calibrated_out, cluster_toml(fitted))
    print(f"wrote {args.calibrated_out}: kiln plan --cluster {args.calibrated_out}")
    return 0


def _as_configured(cfg, cluster, shape, args: argparse.Namespace) -> int:
    """The config's own layout on `cluster`: kiln train's checks at the cluster's world size (a
    refusal is their one line), then the memory model and step time the search ranks layouts by,
    and the search's fastest at the same global batch and precision. 0 when it fits, else 1."""
    import copy
    import dataclasses

    from kiln.parallel.dims import ParallelDims
    from kiln.plan.memory import rank_memory
    from kiln.plan.search import fuses_projections, search
    from kiln.plan.timing import step_time
    from kiln.train.memory import layout_of

    cfg = copy.deepcopy(cfg)
    world, gpu = cluster.world_size, cluster.backend == "nccl"
    dims, _ = ParallelDims.for_job(cfg, world_size=world, rank=0, local_rank=0, local_world_size=cluster.gpus_per_node)
    if cfg.train.dtype == "auto":  # what kiln train resolves it to on the cluster's devices
        cfg.train.dtype = "bf16" if gpu else "fp32"
    layout = layout_of(cfg, dims)
    # as kiln train resolves them on the cluster's devices, not on this machine's
    value = cfg.model.fused_projections
    fused = (gpu and fuses_projections(layout)) if value == "auto" else (bool(value) and layout.tp == 1
                                                                          and layout.precision != "float8")
    layout = dataclasses.replace(layout, fused_projections=fused, fused_ring_blocks=not gpu and cfg.model.dropout == 0)
    mem = rank_memory(shape, layout, cfg.data.seq_len, cfg.optim.name)
    t = step_time(shape, layout, cfg.data.seq_len, cluster, cfg.optim.name)
    budget = cluster.device.usable_bytes
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * dims.dp_size
    print(f"\nas configured on {cluster.nodes} x {cluster.gpus_per_node} {cluster.device.name}, global batch "
          f"{global_batch} x {cfg.data.seq_len} tokens: {layout.describe()}")
    print(f"  step {t.total:.4g} s (compute {t.compute:.3g}, exposed comm {t.comm_exposed:.2g}, bubble "
          f"{t.bubble:.2g}), MFU {t.mfu(cluster, layout.precision, world):.0%}")
    print("  per rank: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in mem.as_dict().items()))
    fits = mem.total <= budget
    print(f"  {'fits' if fits else 'does NOT fit'}: {_gib(mem.total)} of {_gib(budget)} GiB usable")
    try:
        best = search(shape, cluster, cfg.data.seq_len, global_batch, optimizer=cfg.optim.name,
                      precision=layout.precision, loss=layout.loss, compiled=layout.compiled,
                      diloco_inner_steps=layout.diloco_inner_steps, op_checkpointing=cfg.model.dropout == 0,
                      diloco_stream=(layout.diloco_fragments, layout.diloco_sync_delay, layout.diloco_wire_bytes),
                      grad_wire_bytes=layout.grad_wire_bytes, top=1)[0]
    except KilnError as e:
        print(f"  the search finds no layout to compare with: {e}")
    else:
        print(f"  the search's fastest at this batch: {best.layout.describe()}, step {best.time.total:.4g} s, "
              f"{_gib(best.memory.total)} GiB: the configured step is {t.total / best.time.total:.2f}x its time")
    return 0 if fits else 1


def run(args: argparse.Namespace) -> int:
    from kiln.config import load_config
    from kiln.io import atomic_write_text
    from kiln.plan import scaling
    from kiln.plan.cluster import load_cluster
    from kiln.plan.interval import young_daly_interval
    from kiln.plan.memory import OPTIM_STATE_BYTES, ModelShape
    from kiln.plan.diloco import WIRE_BYTES, check_islands
    from kiln.plan.search import kiln_refusal, model_for_params, plan_toml, search
    from kiln.plan.memory import vocab_estimate

    cluster = load_cluster(args.cluster, args.nodes, args.islands)
    if args.calibrate or args.time_collectives or args.collectives:
        return _calibrate(args, cluster)
    cfg = load_config(args.config, args.overrides)
    inner_steps = cfg.parallel.diloco_inner_steps
    replicas = check_islands(cluster, inner_steps)
    world = cluster.world_size
    law = scaling.CHINCHILLA
    if args.fit_sweep:
        points = scaling.sweep_points(args.fit_sweep)
        law = scaling.fit_loss_law(points)
        print(f"loss law fitted to {len(points)} runs of {args.fit_sweep}: L = {law.E:.3f} + {law.A:.4g}/N^{law.alpha:.3f}"
              f" + {law.B:.4g}/D^{law.beta:.3f}")
    vocab, _ = vocab_estimate(cfg)
    vocab = vocab or cfg.data.vocab_size
    seq = cfg.data.seq_len

    flops = args.budget_flops
    if args.gpu_hours is not None:
        if not (0 < args.mfu <= 1) or args.gpu_hours <= 0:
            raise KilnError(f"--gpu-hours {args.gpu_hours} must be > 0 and --mfu {args.mfu} in (0, 1]")
        flops = scaling.flops_from_gpu_hours(1, args.gpu_hours, cluster.device.peak_flops(args.precision), args.mfu)
    tokens = args.tokens
    if flops is not None:
        rows = scaling.allocations(flops, law)
        print(f"budget {flops:.3g} FLOPs (C = 6ND):")
        print(f"  {'law':<14}{'params':>12}{'tokens':>12}{'tokens/param':>14}{'pred. loss':>12}")
        for r in rows:
            print(f"  {r.law:<14}{r.params:>12.3g}{r.tokens:>12.3g}{r.tokens / r.params:>14.1f}{r.loss:>12.3f}")
        chosen = next(r for r in rows if r.law == args.law)
        if chosen.params < SMALLEST_PARAMS:
            need = 6 * SMALLEST_PARAMS * scaling.tokens_for_params(SMALLEST_PARAMS)
            raise KilnError(f"budget {flops:.3g} FLOPs is too small: {args.law} gives a {chosen.params:.3g}-parameter "
                            f"model; the smallest model kiln plans ({SMALLEST_PARAMS:.0e} parameters) needs "
                            f"about {need:.2g} FLOPs")
        m = model_for_params(chosen.params, vocab, max(seq, cfg.model.max_seq_len))
        m.name, m.vocab_size = cfg.model.name, cfg.model.vocab_size
        cfg.model = m
        tokens = tokens or chosen.tokens
        print(f"model for {args.law}: dim={m.dim} n_layers={m.n_layers} n_heads={m.n_heads}")
    shape = ModelShape.from_config(cfg.model, vocab)
    tokens = tokens or scaling.tokens_for_params(shape.params, 1)
    print(f"model: {shape.params / 1e6:,.1f}M parameters; {tokens:.3g} tokens "
          f"(Chinchilla-optimal for it: {scaling.tokens_for_params(shape.params, 1):.3g}); "
          f"predicted loss {law.loss(shape.params, tokens):.3f}")

    if args.as_configured:
        return _as_configured(cfg, cluster, shape, args)

    global_batch = args.global_batch or cfg.train.global_batch_size or cfg.train.batch_size * cfg.train.grad_accum * world
    if global_batch <= 0:
        raise KilnError(f"--global-batch {global_batch} must be > 0")
    plans = search(shape, cluster, seq, global_batch, optimizer=cfg.optim.name, precision=args.precision,
                   loss="chunked" if cfg.train.loss == "chunked" else "full",
                   compiled=cfg.train.compile and cfg.train.compile_scope in ("auto", "model"),
                   diloco_inner_steps=inner_steps, op_checkpointing=cfg.model.dropout == 0,
                   diloco_stream=(cfg.parallel.diloco_fragments, cfg.parallel.diloco_sync_delay,
                                  WIRE_BYTES[cfg.parallel.diloco_comm_dtype]),
                   grad_wire_bytes=2 if cfg.parallel.reduce_dtype == "bf16" else 4,
                   **{f"max_{d}": getattr(args, f"max_{d}") for d in ("tp", "pp", "cp") if getattr(args, f"max_{d}")})
    # The search's model knows no kiln rules: keep only the layouts `kiln train` runs as is.
    refusals = [kiln_refusal(cfg, plan.layout, world) for plan in plans]
    runnable = [plan for plan, why in zip(plans, refusals) if why is None]
    refused = [(plan.layout.describe(), why) for plan, why in zip(plans, refusals) if why is not None]
    if not runnable:
        raise KilnError(f"every layout that fits is one kiln train refuses (e.g. {refused[0][0]}: {refused[0][1]})")
    if refused:
        print(f"left out {len(refused)} fitting layouts kiln train refuses (e.g. {refused[0][0]}: {refused[0][1]})")
    plans = runnable
    print(f"\n{len(plans)} layouts fit {cluster.nodes} x {cluster.gpus_per_node} {cluster.device.name} "
          f"({_gib(cluster.device.usable_bytes)} GiB usable); global batch {global_batch} x {seq} tokens. Fastest:")
    outer = f"{'outer':>8}" if inner_steps else ""  # DiLoCo: the outer step's share of each step
    width = max([58] + [len(p.layout.describe()) + 1 for p in plans[:args.top]])  # the longest layout's
    print(f"  {'layout':<{width}}{'step s':>9}{'compute':>9}{'comm':>8}{'bubble':>8}{outer}{'MFU':>6}{'GiB':>8}")
    for p in plans[:args.top]:
        t = p.time
        outer = f"{t.outer_sync:>8.2g}" if inner_steps else ""
        print(f"  {p.layout.describe():<{width}}{t.total:>9.4g}{t.compute:>9.3g}{t.comm_exposed:>8.2g}{t.bubble:>8.2g}"
              f"{outer}{t.mfu(cluster, args.precision, world):>6.0%}{_gib(p.memory.total):>8}")
    best = plans[0]
    print("  best plan, per rank: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in best.memory.as_dict().items()))
    if inner_steps:
        lay = best.layout
        fragments, every = lay.diloco_fragments, inner_steps // lay.diloco_fragments
        sent = best.memory.parameters / fragments * lay.diloco_wire_bytes / 4  # one sync's, this rank's (scales aside)
        what = (f"{'1/' + str(fragments) + ' of its ' if fragments > 1 else ''}"
                f"{ {4: 'fp32', 2: 'bf16', 1: 'float8 (block-scaled)'}[lay.diloco_wire_bytes]} outer gradient")
        hidden = f" under {lay.diloco_sync_delay} inner steps" if lay.diloco_sync_delay else ""
        print(f"  DiLoCo: {replicas} replicas, one per island of {cluster.nodes_per_island} nodes; every {every} "
              f"steps each rank exchanges {_gib(sent)} GiB ({what}) with the other replicas{hidden}, the "
              f"island link ({cluster.island_link_gbps:g} GB/s) {_gib(sent * lay.replica.world_size)} GiB: "
              f"{best.time.outer_sync * every:.4g} s exposed, {best.time.outer_sync:.4g} s per step")

    steps = max(1, math.ceil(tokens / (global_batch * seq)))
    # DiLoCo: every replica's own model and inner optimizer state, and the anchor and outer momentum once
    ckpt_bytes = shape.params * ((4 + OPTIM_STATE_BYTES.get(cfg.optim.name, 8)) * replicas + (8 if inner_steps else 0))
    save_s = ckpt_bytes / (cluster.nodes * cluster.storage_write_gbps * 1e9)
    mtbf_s = cluster.mtbf_hours * 3600
    interval_s = young_daly_interval(save_s, mtbf_s)
    every = max(1, round(interval_s / best.time.total))
    work_s = steps * best.time.total
    # expected overhead: one save per interval, half an interval lost per failure (Young's model)
    wall_s = work_s * (1 + save_s / interval_s + interval_s / (2 * mtbf_s))
    cost = wall_s / 3600 * world * cluster.cost_per_gpu_hour
    print(f"\ncheckpoint: {ckpt_bytes / 2**30:,.1f} GiB, ~{_fmt_s(save_s)} to save; cluster MTBF {_fmt_s(mtbf_s)}; "
          f"Young/Daly interval {_fmt_s(interval_s)} = every {every} steps")
    print(f"training: {steps:,} steps x {best.time.total:.4g} s = {_fmt_s(work_s)} of compute; expected wall time "
          f"{_fmt_s(wall_s)} with checkpoints and failures; cost ~${cost:,.0f} at ${cluster.cost_per_gpu_hour}/GPU-hour")

    out_cfg = cfg
    out_cfg.train.steps, out_cfg.checkpoint.every = steps, min(every, steps)
    text = plan_toml(out_cfg, best)
    if best.layout.pp > 1:
        text = f"# pipeline schedule: {best.layout.schedule} (virtual stages {best.layout.virtual_stages})\n" + text
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}: kiln train {args.out}")
    return 0
