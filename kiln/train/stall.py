"""Where a training step waits on data, in the spirit of DS-Analyzer (Mohan et al. 2021, "Analyzing
and Mitigating Data Stalls in DNN Training"): measure compute alone, the loader from a warm cache
and the loader from cold storage, then derive the stall and the `[data]` settings that remove it.

Measured (wall clock, `time.perf_counter`): (a) a training step on synthetic in-memory batches
(the trainer's `build_model` + `train_step`, random tokens of the config's shape); (b) the
loader's batch preparation (`Loader._make`: window gathering and collation) with the shards warm;
(c) the same batches from cold storage: a fresh download cache for remote shards, for local ones
the page cache dropped with `os.posix_fadvise(POSIX_FADV_DONTNEED)`. Fetch = cold - warm.

Measured too (`live_stall`): the threaded Loader at the config's settings feeding real training
steps, cold and then warm; its stall is the data wait over the step time, what the trainer logs.

Derived (our model, not a torch API): the loader thread overlaps one step's data time D = fetch +
prep with the step's compute C, so the stall per step is max(0, D - C), split between fetch and
preprocessing in proportion. Settings: lookahead covers the slowest cold batch's latency with
compute; fetch_workers sustains the fetch rate in the compute time left by preprocessing; prefetch
holds the batches that absorb the slowest batch; cache_gb holds the shards one epoch reads.
A recommended value is never below the configured one.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kiln.config import JobConfig
from kiln.data.loader import Loader, TokenWindows
from kiln.data.raw_to_shards import prepare_shards
from kiln.data.shards import ShardSet
from kiln.data.storage import drop_page_cache, open_store
from kiln.errors import KilnError
from kiln.parallel.dims import ParallelDims, pick_device
from kiln.train.evaluate import autocast_context
from kiln.train.optim import build_optimizer
from kiln.train.step import train_step
from kiln.train.system import resolve_dtype
from kiln.train.trainer import build_model


def build_step(cfg: JobConfig):
    """(step(micro_batches), device): one training step of the trainer's model (`build_model`,
    `build_optimizer`, `train_step`), waiting for the device at its end."""
    dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0, local_world_size=1,
                                    seq_len=cfg.data.seq_len)
    if dims.world_size > 1:
        raise KilnError("loader-bench measures one process: set parallel.* to 1")
    device = pick_device(cfg.train.device, dims)
    dtype = resolve_dtype(cfg.train.dtype, device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, dims, device)
    model.train()
    optimizer = build_optimizer(model, cfg.optim, device.type)

    def step(micro) -> None:
        loss, _, _ = train_step(model, optimizer, micro, autocast=autocast_context(device, dtype), scaler=None,
                                clip=cfg.train.clip_grad_norm)
        loss.item()  # wait for the device: the step is done

    return step, device


def time_compute(cfg: JobConfig, steps: int, warmup: int = 2, step=None) -> list[float]:
    """Seconds of each of `steps` training steps on random in-memory tokens (compute only)."""
    step, device = step or build_step(cfg)
    gen = torch.Generator(device="cpu").manual_seed(cfg.train.seed)
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)
    micro = []
    for _ in range(cfg.train.grad_accum):
        batch = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
        micro.append((batch[:, :-1], batch[:, 1:]))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step(micro)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def live_stall(cfg: JobConfig, windows: TokenWindows, step, device, steps: int) -> dict:
    """Train `steps` steps on the threaded Loader at the config's settings (prefetch, lookahead)
    and measure what the trainer measures: the time `Loader.next` blocks (data wait) over the
    step's wall time. The first step includes starting the loader thread and the first fetch;
    `steady_stall_fraction` leaves it out (as the trainer's stall warning does)."""
    loader = Loader(windows, cfg.train.batch_size, seed=cfg.train.seed, prefetch=cfg.data.prefetch,
                    lookahead=cfg.data.lookahead, device=device)
    waits, walls = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            loader.wait_s = 0.0
            step([loader.next() for _ in range(cfg.train.grad_accum)])
            walls.append(time.perf_counter() - t0)
            waits.append(loader.wait_s)
    finally:
        loader.close()
    steady = slice(1, None) if steps > 1 else slice(None)
    return {"stall_fraction": sum(waits) / sum(walls),
            "steady_stall_fraction": sum(waits[steady]) / sum(walls[steady]),
            "wait_s": waits, "step_s": walls,
            "cache_hit_rates": {str(e): round(r, 4) for e, r in loader.cache_hit_rates().items()}}


def time_batches(loader: Loader, batches: list[np.ndarray]) -> list[float]:
    """Seconds `Loader._make` takes for each batch of window indices, synchronously."""
    times = []
    for idx in batches:
        t0 = time.perf_counter()
        loader._make(idx)
        times.append(time.perf_counter() - t0)
    return times


def recommend(compute_s: float, prep_s: float, fetch_s: float, slowest_cold_s: float, data_bytes: int,
              cfg: JobConfig) -> dict:
    """The `[data]` settings that remove the measured stall (per training step times, seconds)."""
    accum = cfg.train.grad_accum
    spare = compute_s - prep_s  # compute time left for fetching once preprocessing overlaps
    out: dict = {}
    if prep_s > compute_s:
        out["note"] = (f"preprocessing ({prep_s * 1e3:.2f} ms/step) exceeds compute ({compute_s * 1e3:.2f} "
                       f"ms/step): the single loader thread is the bottleneck; no data.* setting removes it")
    out["prefetch"] = max(cfg.data.prefetch, math.ceil(slowest_cold_s / max(compute_s / accum, 1e-9)) + 1)
    out["lookahead"] = max(cfg.data.lookahead, math.ceil(slowest_cold_s / max(compute_s / accum, 1e-9)))
    needed = min(256, math.ceil(fetch_s / spare)) if spare > 0 and fetch_s > 0 else 0
    out["fetch_workers"] = max(cfg.data.fetch_workers, needed)
    out["cache_gb"] = max(cfg.data.cache_gb, round(data_bytes * 1.1 / (1 << 30), 3))  # 10% headroom
    return out


def analyze(cfg: JobConfig, run_dir: str | Path, *, steps: int = 10, log=print) -> dict:
    """Measure (a) compute, (b) warm and (c) cold loading for `steps` steps; the report as a dict."""
    if cfg.data.mixture:
        raise KilnError("loader-bench measures data.source's shards; unset data.mixture")
    if steps < 1:
        raise KilnError(f"--steps={steps} must be >= 1")
    cfg.train.grad_accum = cfg.train.accumulation(1)  # one process: train.global_batch_size all its own
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    shard_dir, _ = prepare_shards(cfg.data, run_dir, log=log)
    store = open_store(shard_dir, cfg.data)
    shards = ShardSet(shard_dir, "train", store)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = shards.vocab_size
    n_batches = steps * cfg.train.grad_accum
    windows_kw = {"doc_starts": cfg.data.windows == "doc_start", "doc_ids": cfg.data.windows == "packed_masked"}
    windows = TokenWindows(shards, cfg.data.seq_len, **windows_kw)
    loader = Loader(windows, cfg.train.batch_size, seed=cfg.train.seed, prefetch=cfg.data.prefetch)
    batches, epoch, position = [], loader.epoch, loader.position
    for _ in range(n_batches):
        epoch, position, idx = loader._advance(epoch, position)
        batches.append(idx)
    files = [f for s in range(len(shards.tokens)) for f in shards.shard_files(s)]
    data_bytes = sum(_size(store, f) for f in files)

    log(f"loader-bench: (a) compute, {steps} steps of synthetic batches")
    step, device = build_step(cfg)
    compute = time_compute(cfg, steps, step=(step, device))
    log("loader-bench: (c) cold loading")
    if store.remote:
        with tempfile.TemporaryDirectory(prefix="kiln-cold-cache-") as fresh:
            cold_cfg = dataclasses.replace(cfg.data, cache_dir=fresh)
            cold_store = open_store(shard_dir, cold_cfg)
            try:
                cold_windows = TokenWindows(ShardSet(shard_dir, "train", cold_store), cfg.data.seq_len, **windows_kw)
                cold = time_batches(Loader(cold_windows, cfg.train.batch_size, seed=cfg.train.seed), batches)
            finally:
                cold_store.close()
            log("loader-bench: live training from a fresh download cache")
            live_store = open_store(shard_dir, dataclasses.replace(cfg.data, cache_dir=str(Path(fresh) / "live")))
            try:
                live_windows = TokenWindows(ShardSet(shard_dir, "train", live_store), cfg.data.seq_len, **windows_kw)
                live = {"cold": live_stall(cfg, live_windows, step, device, steps),
                        "warm": live_stall(cfg, live_windows, step, device, steps)}  # same store: cache warm
            finally:
                live_store.close()
        cold_how = "fresh download cache"
    else:
        drop_page_cache([Path(shard_dir) / f for f in files])
        cold = time_batches(loader, batches)
        cold_how = "page cache dropped (posix_fadvise DONTNEED)"
        log("loader-bench: live training, page cache dropped, then warm")
        drop_page_cache([Path(shard_dir) / f for f in files])
        live = {"cold": live_stall(cfg, windows, step, device, steps),
                "warm": live_stall(cfg, windows, step, device, steps)}
    log("loader-bench: (b) warm loading")
    time_batches(loader, batches)  # make sure every shard is resident
    warm = time_batches(loader, batches)
    loader.close()

    per_step = lambda xs: float(np.sum(xs)) / steps  # noqa: E731
    compute_s = float(np.median(compute))
    prep_s, cold_s = per_step(warm), per_step(cold)
    fetch_s = max(0.0, cold_s - prep_s)
    data_s = prep_s + fetch_s
    stall_s = max(0.0, data_s - compute_s)
    share = (lambda part: stall_s * part / data_s) if data_s > 0 else (lambda part: 0.0)
    report = {
        "device": str(pick_device_name(cfg)), "steps": steps, "batch_size": cfg.train.batch_size,
        "grad_accum": cfg.train.grad_accum, "seq_len": cfg.data.seq_len, "windows": cfg.data.windows,
        "storage": "remote" if store.remote else "local", "cold": cold_how, "data_bytes": data_bytes,
        "compute_s_per_step": compute_s, "prep_s_per_step": prep_s, "fetch_s_per_step": fetch_s,
        "cold_s_per_step": cold_s, "slowest_cold_batch_s": float(max(cold)),
        "stall_fraction": stall_s / (compute_s + stall_s),
        "fetch_stall_fraction": share(fetch_s) / (compute_s + stall_s),
        "prep_stall_fraction": share(prep_s) / (compute_s + stall_s),
        "settings": {k: getattr(cfg.data, k) for k in ("prefetch", "fetch_workers", "lookahead", "cache_gb")},
        "live": live,  # the threaded Loader feeding real steps: data wait / step time, cold and warm
        "recommended": recommend(compute_s, prep_s, fetch_s, float(max(cold)), data_bytes, cfg),
        "samples": {"compute_s": compute, "warm_batch_s": warm, "cold_batch_s": cold},
    }
    return report


def pick_device_name(cfg: JobConfig) -> str:
    if cfg.train.device in ("cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def _size(store, name: str) -> int:
    if store.remote:
        return int(store.fs.size(f"{store.root}/{name}"))
    return (Path(store.root) / name).stat().st_size
