"""Calibrate a cluster description from measured kiln runs (`kiln plan --calibrate RUN_DIR...`).

Each run directory gives its config (config.toml), its layout and world size (the "run" row of
metrics.jsonl) and its measured step time (tokens_per_step / median tokens_per_s). The device
efficiency curve (max_efficiency, half_efficiency_work), the link bandwidth of the links those
runs used and the overlap efficiency are fitted by least squares on log step time over a
log-spaced grid, then a finer grid around its best point (up to five parameters, a few thousand
points each: exhaustive search is simpler and more robust here than a gradient method on a
piecewise model). Timed collectives (`CollectiveSample`, e.g. benchmarks/parallel_memory.py's
gloo micro-benchmark) fix the link's latency and bandwidth first (`fit_link`, a linear
least-squares fit), which frees the step times to fit the per-collective launch cost.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.plan.cluster import Cluster
from kiln.plan.memory import Layout, ModelShape
from kiln.plan.timing import all_gather, all_reduce, broadcast, reduce_scatter, step_time

GRID = {
    "max_efficiency": [0.02 * 1.25 ** k for k in range(18)] + [1.0],  # up to the field's bound
    "half_efficiency_work": [10 ** (k / 3) for k in range(9, 22)],
    "bandwidth_gbps": [0.05 * 1.6 ** k for k in range(24)],  # 50 MB/s .. ~2 TB/s
    "overlap_efficiency": [0.0, 0.3, 0.6, 0.9],
}
LAUNCH_GRID_US = [0.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0]


@dataclass
class Measurement:
    name: str
    shape: ModelShape
    layout: Layout
    seq_len: int
    step_s: float
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"  # fused | foreach | single (kiln/train/optim.py adamw_implementation)


def measured_run(run_dir: str | Path) -> Measurement:
    """A kiln run directory's layout and median step time."""
    from kiln.config import load_config
    from kiln.report.run_metrics import read_metrics, summarize
    from kiln.plan.memory import vocab_estimate

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
    if cfg.parallel.diloco_inner_steps:  # its step time holds outer syncs the fit would read as link time
        raise KilnError(f"{run_dir}: a DiLoCo run (parallel.diloco_inner_steps={cfg.parallel.diloco_inner_steps}) "
                        f"cannot calibrate the cluster; calibrate on runs without DiLoCo")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    runs = metrics.of("run")
    tps = summarize(metrics)["tokens_per_s_median"]
    if not runs or not tps:
        raise KilnError(f"{run_dir}/metrics.jsonl has no run row or no timed steps; train a few steps first")
    row = runs[-1]
    try:
        world, rep, shard = int(row["world_size"]), int(row["dp_replicate"]), int(row["dp_shard"])
        tokens_per_step = float(row["tokens_per_step"])
    except (KeyError, TypeError, ValueError):
        raise KilnError(f"{run_dir}/metrics.jsonl: the run row lacks world_size/dp_replicate/dp_shard/"
                        f"tokens_per_step") from None
    vocab, _ = vocab_estimate(cfg)
    mode = row.get("dp_mode", "none")
    dtype = row.get("dtype") if row.get("dtype") in ("fp32", "bf16", "fp16") else "fp32"
    layout = Layout(dp_replicate=rep, dp_shard=shard, tp=cfg.parallel.tp, pp=cfg.parallel.pp, cp=cfg.parallel.cp,
                    cp_mode=str(row.get("cp_mode", "ring")), ulysses_degree=int(row.get("ulysses_degree", 0)),
                    ulysses_rounds=int(row.get("ulysses_rounds", 1)),
                    dp_mode="ddp" if mode in ("none", None) else str(mode), micro_batch=cfg.train.batch_size,
                    grad_accum=cfg.train.grad_accum, ac=cfg.train.activation_checkpointing, precision=dtype)
    if layout.world_size != world:
        raise KilnError(f"{run_dir}: layout {layout.describe()} does not match world_size={world}")
    # optim.implementation "auto" is fused on cpu and cuda (kiln/train/optim.py FUSED_ADAMW_FASTER)
    impl = cfg.optim.implementation if cfg.optim.implementation != "auto" else "fused"
    return Measurement(str(run_dir), ModelShape.from_config(cfg.model, vocab), layout, cfg.data.seq_len,
                       tokens_per_step / tps, cfg.optim.name, impl)


@dataclass
class CollectiveSample:
    """One timed gloo/NCCL collective: `op` (all_reduce | all_gather | reduce_scatter | broadcast)
    over `ranks` ranks of a tensor of `nbytes` (the full, unsharded size), taking `seconds`; or
    op "copy": a copy of `nbytes` on each of `ranks` ranks at once."""
    op: str
    ranks: int
    nbytes: float
    seconds: float


def _collective(cluster: Cluster, s: CollectiveSample) -> float:
    op = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
          "broadcast": broadcast}.get(s.op)
    if op is None:
        raise KilnError(f"collective sample: unknown op {s.op!r} (all_reduce, all_gather, reduce_scatter, broadcast)")
    return op(cluster, s.ranks, s.nbytes)


def fit_link(cluster: Cluster, samples: list[CollectiveSample]) -> Cluster:
    """`cluster` with the intra-node link latency (alpha) and bandwidth (1/beta) that best explain
    timed collectives: each sample's time is alpha * a + beta * b with a, b from timing.py's
    formulas, so this is a linear least-squares fit on relative error (scipy's non-negative
    least squares when scipy is installed, numpy's lstsq otherwise). "copy" samples (a tensor
    copy on every rank at once) set the device memory bandwidth the buffer copies and optimizer
    step run at: the median of 2 x bytes / seconds, at a full core's share."""
    import numpy as np

    copies = [s for s in samples if s.op == "copy" and s.seconds > 0]
    samples = [s for s in samples if s.op != "copy" and s.ranks > 1 and s.seconds > 0]
    if len({(s.ranks, s.nbytes) for s in samples}) < 2:
        raise KilnError("fitting a link needs collectives timed at two or more sizes or rank counts")
    unit = copy.deepcopy(cluster)
    rows = []
    for s in samples:
        unit.intra_node.latency_us, unit.intra_node.bandwidth_gbps = 1e6, 1e30  # alpha = 1 s, no bytes
        a = _collective(unit, s)
        unit.intra_node.latency_us, unit.intra_node.bandwidth_gbps = 0.0, 1e-9  # 1 s per byte
        b = _collective(unit, s)
        rows.append((a / s.seconds, b / s.seconds))
    matrix, ones = np.array(rows), np.ones(len(rows))
    try:
        from scipy.optimize import nnls

        (alpha, beta), _ = nnls(matrix, ones)
    except ImportError:
        alpha, beta = np.clip(np.linalg.lstsq(matrix, ones, rcond=None)[0], 0.0, None)
    out = copy.deepcopy(cluster)
    out.intra_node.latency_us = float(alpha) * 1e6
    out.intra_node.bandwidth_gbps = 1e-9 / float(beta) if beta > 0 else 1e6
    if copies:  # a copy reads and writes its bytes; ranks beyond the cores time-share them
        rates = sorted(2 * s.nbytes / s.seconds / _share(cluster, s.ranks) for s in copies)
        out.device.memory_bandwidth_gbps = rates[len(rates) // 2] / 1e9
    return out


def _share(cluster: Cluster, ranks: int) -> float:
    return min(1.0, cluster.cores_per_node / ranks) if cluster.cores_per_node > 0 else 1.0


def _apply(cluster: Cluster, params: tuple[float, ...]) -> Cluster:
    """Set the fitted fields on `cluster` in place: (max_efficiency, half_efficiency_work,
    bandwidth_gbps, overlap_efficiency, collective_launch_us), the order of the search grid."""
    c = cluster
    c.device.max_efficiency, c.device.half_efficiency_work, bw, c.overlap_efficiency, c.collective_launch_us = params
    c.intra_node.bandwidth_gbps = bw
    if c.nodes > 1:
        c.inter_node.bandwidth_gbps = bw
    return c


def predicted_step(m: Measurement, cluster: Cluster) -> float:
    """Predicted step time of a measured run (the cluster's `cores_per_node` covers CPU processes
    that share cores)."""
    return step_time(m.shape, m.layout, m.seq_len, cluster, m.optimizer, m.optimizer_impl).total


def fit_error(cluster: Cluster, measurements: list[Measurement]) -> float:
    """Sum of squared log errors of `cluster`'s predictions for `measurements`."""
    return sum(math.log(predicted_step(m, cluster) / m.step_s) ** 2 for m in measurements)


def _refined(axis: list[float], best: float) -> list[float]:
    """A finer grid between `best`'s neighbours on `axis` (geometric where the axis is)."""
    i = axis.index(best)
    lo, hi = axis[max(0, i - 1)], axis[min(len(axis) - 1, i + 1)]
    if lo > 0 and hi > 0:
        return sorted({lo * (hi / lo) ** (k / 8) for k in range(9)} | {best})
    return sorted({lo + (hi - lo) * k / 8 for k in range(9)} | {best})


def fit_cluster(cluster: Cluster, measurements: list[Measurement], overlap: float | None = None,
                links: list[CollectiveSample] | None = None, device_only: bool = False) -> Cluster:
    """`cluster` with the efficiency curve, link bandwidth, overlap and per-collective launch cost
    that best explain the runs. `links` (timed collectives) fixes the link's latency and bandwidth
    by `fit_link` first, and lets the launch cost be fitted (without them it stays the cluster's:
    latency and launch cost cannot be told apart from step times alone). `overlap` fixes the
    overlap efficiency instead of fitting it (0 for gloo, whose collectives run on the CPU cores
    the compute needs). `device_only` fits the efficiency curve alone (single-device runs have no
    link to fit). Search: the GRID exhaustively, then a finer grid around its best point."""
    if not measurements:
        raise KilnError("calibration needs at least one measured run")
    base = fit_link(cluster, links) if links else copy.deepcopy(cluster)
    grid = dict(GRID)
    grid["bandwidth_gbps"] = [base.intra_node.bandwidth_gbps] if links else GRID["bandwidth_gbps"]
    grid["overlap_efficiency"] = [overlap] if overlap is not None else GRID["overlap_efficiency"]
    grid["collective_launch_us"] = LAUNCH_GRID_US if links else [base.collective_launch_us]
    if device_only:
        grid["bandwidth_gbps"], grid["overlap_efficiency"] = [base.intra_node.bandwidth_gbps], [base.overlap_efficiency]
        grid["collective_launch_us"] = [base.collective_launch_us]
    work = copy.deepcopy(base)
    best, best_err = None, math.inf
    for refine in (True, False):
        for params in itertools.product(*grid.values()):
            if params[0] > 1:
                continue
            err = fit_error(_apply(work, params), measurements)
            if err < best_err:
                best, best_err = params, err
        if refine:
            grid = {k: _refined(axis, v) if len(axis) > 1 else axis for (k, axis), v in zip(grid.items(), best)}
    return _apply(copy.deepcopy(base), best)


def cluster_toml(cluster: Cluster) -> str:
    import dataclasses

    import tomli_w

    return tomli_w.dumps(dataclasses.asdict(cluster))
