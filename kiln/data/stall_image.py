"""The stall analyzer for image-text data: preprocessing in CPU workers vs on the device.

`kiln loader-bench --image-text SHARDS --step-ms C` (kiln/commands/loader_bench.py). kiln has no
image model, so the compute time per step C is given. For each configuration - mode "cpu" with
0, 1, 2, ... DataLoader workers, mode "device" with the same worker counts (workers read and
tokenize, the main process decodes and transforms on the device) - it times `batches` batches
of `ImageTextLoader` back to back (wall clock, `time.perf_counter`; the first batch, which
starts the workers, is timed apart, and the batches the workers prepared meanwhile are not timed), once warm and once with the shards' page cache dropped
(`posix_fadvise(POSIX_FADV_DONTNEED)`; remote shards: a fresh download cache).

Derived (our model): W is the wall time per batch back to back, M the part spent in the
main process (the device decode, `ImageTextLoader.device_s`; everything with 0 workers). With 0
workers nothing overlaps compute: a step takes C + W. With workers they prepare batches while
the step computes, but the main-process part does not overlap: a step takes max(C + M, W).
Stall = step - C, as a fraction of the step, split between fetch (cold W - warm W) and
preprocessing (warm W) in proportion. The recommendation is the first configuration, fewest
workers first and CPU before device, whose cold stall is at most `max_stall` of the step; the
workers a CPU path would need are ceil(W0 / C) (W0: one process's cold time per batch), the
prefetch per worker ceil(slowest batch / C) + 1 (at least DataLoader's default 2).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from typing import TYPE_CHECKING

from kiln.errors import KilnError

if TYPE_CHECKING:  # imported where used: the run page imports this module without torch
    from kiln.data.image_ops import ImageSpec
    from kiln.data.image_text import TarIndex


def time_loader(index: TarIndex, tokenizer, *, mode: str, workers: int, batches: int, cold: bool,
                **loader_kw) -> dict:
    """Seconds per batch over `batches` batches, back to back, after the first batch (timed apart:
    it starts the workers) and the workers * prefetch batches they prepared meanwhile (untimed, so
    the timed ones measure the steady rate); page cache dropped before the timed ones when `cold`."""
    from kiln.data.image_text import ImageTextLoader
    from kiln.data.storage import drop_page_cache

    loader = ImageTextLoader(index, tokenizer, mode=mode, workers=workers, log=lambda _m: None, **loader_kw)
    try:
        t0 = time.perf_counter()
        loader.next()
        first = time.perf_counter() - t0
        for _ in range(workers * loader.prefetch):
            loader.next()
        if cold and not index.store.remote:
            drop_page_cache([Path(index.store.root) / s for s in index.shards])
        loader.wait_s = loader.device_s = 0.0
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            loader.next()
            times.append(time.perf_counter() - t0)
        wall = sum(times) / batches
        main = wall if workers == 0 else loader.device_s / batches
        return {"first_batch_s": first, "batch_s": wall, "main_s": main, "slowest_batch_s": max(times)}
    finally:
        loader.close()


def step_time(compute_s: float, wall_s: float, main_s: float, workers: int) -> float:
    """Modelled seconds per training step with the loader beside a step of compute_s."""
    return compute_s + wall_s if workers == 0 else max(compute_s + main_s, wall_s)


def analyze_image(url: str, tokenizer, *, compute_s: float, batch_size: int, spec: ImageSpec,
                  caption_len: int = 32, device: str = "cpu", workers: tuple[int, ...] = (0, 1, 2),
                  batches: int = 10, max_stall: float = 0.05, skip_bad: bool = False, store_kw: dict | None = None,
                  log=print) -> dict:
    """Measure every (mode, workers) configuration warm and cold; the report as a dict."""
    import torch

    from kiln.data.image_text import TarIndex
    from kiln.data.storage import ShardStore

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():  # before any measuring
        raise KilnError(f"loader-bench --image-text --device {device}: torch sees no CUDA device")
    if compute_s <= 0 or batches < 1 or not workers or min(workers) < 0:
        raise KilnError(f"loader-bench --image-text: need --step-ms > 0, --steps >= 1 and worker counts >= 0 "
                        f"(got {compute_s * 1e3:g} ms, {batches}, {list(workers)})")
    store_kw = dict(store_kw or {})
    index = TarIndex(url, store=ShardStore(url, **store_kw), skip_bad=skip_bad, log=log)
    kw = {"batch_size": batch_size, "spec": spec, "caption_len": caption_len, "device": device}
    rows = []
    for mode in ("cpu", "device"):
        for w in workers:
            log(f"loader-bench: image-text, {mode} preprocessing, {w} worker(s)")
            warm = time_loader(index, tokenizer, mode=mode, workers=w, batches=batches, cold=False, **kw)
            if index.store.remote:  # cold = a fresh download cache
                with tempfile.TemporaryDirectory(prefix="kiln-cold-cache-") as fresh:
                    cold_index = TarIndex(url, store=ShardStore(url, **{**store_kw, "cache_dir": fresh}),
                                          skip_bad=skip_bad, log=lambda _m: None)
                    cold = time_loader(cold_index, tokenizer, mode=mode, workers=w, batches=batches, cold=True, **kw)
                    cold_index.store.close()
            else:
                cold = time_loader(index, tokenizer, mode=mode, workers=w, batches=batches, cold=True, **kw)
            step = step_time(compute_s, cold["batch_s"], cold["main_s"], w)
            stall = step - compute_s
            fetch = max(0.0, cold["batch_s"] - warm["batch_s"])
            prep = warm["batch_s"]
            rows.append({"mode": mode, "workers": w, "warm_batch_s": warm["batch_s"], "cold_batch_s": cold["batch_s"],
                         "main_s": cold["main_s"], "first_batch_s": cold["first_batch_s"],
                         "slowest_batch_s": cold["slowest_batch_s"], "step_s": step,
                         "stall_fraction": stall / step,
                         "fetch_stall_fraction": stall * fetch / (fetch + prep) / step if fetch + prep else 0.0,
                         "prep_stall_fraction": stall * prep / (fetch + prep) / step if fetch + prep else 0.0})
    index.store.close()
    fits = [r for r in rows if r["stall_fraction"] <= max_stall]
    single = next((r for r in rows if r["mode"] == "cpu" and r["workers"] == 0), None)
    needed = math.ceil(single["cold_batch_s"] / compute_s) if single else None
    if fits:
        best = fits[0]
        verdict = (f"{best['mode']} preprocessing with {best['workers']} worker(s) keeps the stall at "
                   f"{best['stall_fraction']:.1%} of a {compute_s * 1e3:.1f} ms step")
    else:
        best = min(rows, key=lambda r: r["step_s"])
        verdict = (f"no measured configuration removes the stall; the best, {best['mode']} preprocessing with "
                   f"{best['workers']} worker(s), still stalls {best['stall_fraction']:.1%} of the step")
    return {
        "kind": "image-text", "url": str(url), "device": device, "samples": len(index), "shards": len(index.shards),
        "skipped": len(index.skipped), "batch_size": batch_size, "image_size": spec.size, "batches": batches,
        "compute_s_per_step": compute_s, "max_stall": max_stall, "configs": rows,
        "recommended": {"mode": best["mode"], "workers": best["workers"], "prefetch": max(2, math.ceil(best["slowest_batch_s"] / compute_s) + 1),
                        "cpu_workers_needed": needed, "verdict": verdict},
    }
