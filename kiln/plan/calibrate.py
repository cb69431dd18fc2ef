"""Calibrate a cluster description from measured kiln runs (`kiln plan --calibrate RUN_DIR...`).

Each run directory gives its config (config.toml), its layout and world size (the "run" row of
metrics.jsonl) and its measured step time (tokens_per_step / median tokens_per_s). The device
efficiency curve (max_efficiency, half_efficiency_work), the link bandwidth of the links those
runs used and the overlap efficiency are fitted by least squares on log step time over a
log-spaced grid (four parameters, a few thousand points: exhaustive search is simpler and more
robust here than a gradient method on a piecewise model).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.errors import KilnError
from kiln.plan.cluster import Cluster
from kiln.plan.memory import Layout, ModelShape
from kiln.plan.timing import step_time

GRID = {
    "max_efficiency": [0.02 * 1.25 ** k for k in range(18)],  # up to ~0.9
    "half_efficiency_work": [10 ** (k / 3) for k in range(9, 22)],
    "bandwidth_gbps": [0.05 * 1.6 ** k for k in range(24)],  # 50 MB/s .. ~2 TB/s
    "overlap_efficiency": [0.0, 0.3, 0.6, 0.9],
}


@dataclass
class Measurement:
    name: str
    shape: ModelShape
    layout: Layout
    seq_len: int
    step_s: float


def measured_run(run_dir: str | Path) -> Measurement:
    """A kiln run directory's layout and median step time."""
    from kiln.config import load_config
    from kiln.report.run_page import read_metrics, summarize
    from kiln.train.memory import vocab_estimate

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
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
                    dp_mode="ddp" if mode in ("none", None) else str(mode), micro_batch=cfg.train.batch_size,
                    grad_accum=cfg.train.grad_accum, ac=cfg.train.activation_checkpointing, precision=dtype)
    if layout.world_size != world:
        raise KilnError(f"{run_dir}: layout {layout.describe()} does not match world_size={world}")
    return Measurement(str(run_dir), ModelShape.from_config(cfg.model, vocab), layout, cfg.data.seq_len,
                       tokens_per_step / tps)


def _apply(cluster: Cluster, params: tuple[float, float, float, float]) -> Cluster:
    c = copy.deepcopy(cluster)
    c.device.max_efficiency, c.device.half_efficiency_work, bw, c.overlap_efficiency = params
    c.intra_node.bandwidth_gbps = bw
    if c.nodes > 1:
        c.inter_node.bandwidth_gbps = bw
    return c


def predicted_step(m: Measurement, cluster: Cluster, compute_share: Callable[[Layout], float] | None = None) -> float:
    """Predicted step time; `compute_share(layout)` is the fraction of a device each rank gets
    (1 on GPUs; cores / processes when CPU processes outnumber cores)."""
    t = step_time(m.shape, m.layout, m.seq_len, cluster)
    share = compute_share(m.layout) if compute_share else 1.0
    return (t.compute + t.optimizer) / share + t.comm_exposed + t.bubble / share


def fit_error(cluster: Cluster, measurements: list[Measurement],
              compute_share: Callable[[Layout], float] | None = None) -> float:
    """Sum of squared log errors of `cluster`'s predictions for `measurements`."""
    return sum(math.log(predicted_step(m, cluster, compute_share) / m.step_s) ** 2 for m in measurements)


def fit_cluster(cluster: Cluster, measurements: list[Measurement],
                compute_share: Callable[[Layout], float] | None = None, overlap: float | None = None) -> Cluster:
    """`cluster` with the efficiency curve, link bandwidth and overlap that best explain the runs.
    `overlap` fixes the overlap efficiency instead of fitting it (0 for gloo, whose collectives
    run on the CPU cores the compute needs, so nothing is hidden)."""
    if not measurements:
        raise KilnError("calibration needs at least one measured run")
    best, best_err = None, math.inf
    grid = dict(GRID, overlap_efficiency=[overlap]) if overlap is not None else GRID
    for params in itertools.product(*grid.values()):
        if params[0] > 1:
            continue
        c = _apply(cluster, params)
        err = fit_error(c, measurements, compute_share)
        if err < best_err:
            best, best_err = params, err
    return _apply(cluster, best)


def cluster_toml(cluster: Cluster) -> str:
    import dataclasses

    import tomli_w

    return tomli_w.dumps(dataclasses.asdict(cluster))
