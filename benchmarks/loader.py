"""The loader's cache and remote reads: hit rates per policy, and batches/s from loopback S3.

cache: the access sequence is the real one (every window the Loader reads, epoch by epoch, in
`epoch_order`, the sampler `kiln train` uses), replayed against kiln's caches with a cache of half
the dataset's bytes: at window granularity (what the store caches when the cache is smaller than
the data) through `WindowCache` itself, at shard granularity through the file policies.

s3: kiln's Loader vs a plain torch DataLoader from a moto S3 server with added request latency,
in interleaved rounds (medians). hits: the Loader's own per-epoch hit rates from that server.

    python benchmarks/loader.py cache [--shards 40] [--windows-per-shard 200] [--epochs 3]
                                     [--granularity window|shard]
    python benchmarks/loader.py s3 [--shards 16] [--windows-per-shard 200] [--batches 40]
                                  [--cache-fraction 0.5] [--latency-ms 20] [--rounds 3]
    python benchmarks/loader.py hits [--shards 8] [--windows-per-shard 100] [--epochs 3]
    python benchmarks/loader.py stall [--steps 5] [--latency-ms 20] [--corpus-mb 4]

stall: `kiln loader-bench` on a ~10M-parameter model, shards local and on loopback S3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.data.cache import LRUPolicy, StaticPolicy, WindowCache, epoch_hit_rates  # noqa: E402
from kiln.data.loader import TokenWindows, epoch_order  # noqa: E402


def cache_hit_rates(n_shards: int, windows_per_shard: int, epochs: int, cache_fraction: float = 0.5,
                    seq_len: int = 256, seed: int = 0, granularity: str = "window") -> dict:
    """granularity "window": the cache holds single windows (`WindowCache`, what ShardStore uses
    when the cache is smaller than the data); "shard": it holds shard files (ShardCache's policies)."""
    import tempfile

    streams = [np.zeros(windows_per_shard * seq_len + 1, dtype=np.uint16) for _ in range(n_shards)]
    windows = TokenWindows(streams, seq_len)
    out = {"granularity": granularity, "shards": n_shards, "windows": len(windows), "epochs": epochs,
           "cache_fraction": cache_fraction}
    if granularity == "window":
        window_bytes = (seq_len + 1) * 2
        capacity = int(len(windows) * window_bytes * cache_fraction)
        orders = [epoch_order(len(windows), seed, e) for e in range(epochs)]
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("lru", "static"):
                cache = WindowCache(tmp, capacity, window_bytes, name)
                rates = []
                for order in orders:
                    stream, start = windows._locate(order)
                    hits = 0
                    for key in zip(stream.tolist(), start.tolist()):
                        if cache.get(key) is not None:
                            hits += 1
                        else:  # what ShardStore does on a miss: fetch, then offer it to the cache
                            cache.put(key, bytes(window_bytes))
                    rates.append(hits / len(order))
                out[name] = {"per_epoch": [round(r, 4) for r in rates], "total_hits": round(sum(rates) * len(windows))}
                cache.close()
    else:
        sizes = [int(s.nbytes) for s in streams]
        orders = [windows._locate(epoch_order(len(windows), seed, e))[0].tolist() for e in range(epochs)]
        capacity = int(sum(sizes) * cache_fraction)
        for name, policy in (("lru", LRUPolicy(capacity)), ("static", StaticPolicy(capacity))):
            rates = epoch_hit_rates(policy, sizes, orders)
            out[name] = {"per_epoch": [round(r, 4) for r in rates], "total_hits": round(sum(rates) * len(windows))}
    out["static_over_lru"] = round(out["static"]["total_hits"] / max(1, out["lru"]["total_hits"]), 2)
    return out


def interleaved_rounds(runners: dict, rounds: int, out: dict, digits: int) -> list[str]:
    """Run every runner(round) once per round, rotating who goes first, and record in `out` each
    one's median batches/s and its samples; returns the runners' names in order."""
    names = list(runners)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(round(runners[name](r), digits))
    for name, xs in samples.items():
        out[f"{name}_batches_per_s"] = float(np.median(xs))
        out[f"{name}_samples"] = xs
    return names


def write_bench_shards(local: Path, n_shards: int, shard_windows: int, seq_len: int) -> None:
    """A train split of about n_shards x shard_windows windows of random tokens (uint16)."""
    from kiln.data.shards import ShardWriter, write_meta

    w = ShardWriter(local, "train", vocab_size=1000, eos_id=999, shard_tokens=shard_windows * seq_len)
    rng = np.random.default_rng(0)
    for _ in range(n_shards * shard_windows // 4):
        w.add(rng.integers(0, 999, 4 * seq_len - 1))
    w.finish()
    write_meta(local, [w])


def local_throughput(n_shards: int, shard_windows: int, batches: int, seq_len: int = 256, batch_size: int = 8,
                     workers: int = 2, rounds: int = 3) -> dict:
    """Batches/s from local shards (page cache warm): kiln's Loader (memory maps, a background
    thread) against a plain torch DataLoader (shuffle=True) over a map-style dataset that reads one
    window from the same memory-mapped shards, with 0 and `workers` workers, each timed after its first
    batch (started, workers forked); `batches` must fit one epoch; interleaved rounds
    whose order rotates, medians and every sample."""
    import tempfile
    import time

    import torch

    from kiln.data.loader import Loader
    from kiln.data.shards import ShardSet

    out: dict = {"shards": n_shards, "windows_per_shard": shard_windows, "batches": batches,
                 "batch_size": batch_size, "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "local"
        write_bench_shards(local, n_shards, shard_windows, seq_len)
        windows = TokenWindows(ShardSet(local, "train"), seq_len)
        shards = ShardSet(local, "train")
        arrays = [np.load(local / shards.shard_files(i)[0], mmap_mode="r") for i in range(len(shards.tokens))]

        class MappedWindows(torch.utils.data.Dataset):  # the straightforward map-style dataset
            def __len__(self):
                return len(windows)

            def __getitem__(self, i):
                s, start = windows._locate(np.array([i]))
                a = int(start[0])
                return torch.from_numpy(np.asarray(arrays[int(s[0])][a:a + seq_len + 1], dtype=np.int64))

        def run_kiln(r: int) -> float:
            loader = Loader(TokenWindows(ShardSet(local, "train"), seq_len), batch_size, seed=r)
            loader.next()  # started: the first batch is not timed (for either loader)
            t0 = time.perf_counter()
            for _ in range(batches - 1):
                loader.next()
            rate = (batches - 1) / (time.perf_counter() - t0)
            loader.close()
            return rate

        def run_dataloader(nw: int) -> float:
            it = iter(torch.utils.data.DataLoader(MappedWindows(), batch_size=batch_size, shuffle=True,
                                                  num_workers=nw))
            next(it)  # workers started and warm
            t0 = time.perf_counter()
            for _ in range(batches - 1):
                next(it)
            rate = (batches - 1) / (time.perf_counter() - t0)
            del it
            return rate

        names = interleaved_rounds({"kiln": run_kiln, "dataloader_workers0": lambda r: run_dataloader(0),
                                    f"dataloader_workers{workers}": lambda r: run_dataloader(workers)},
                                   rounds, out, digits=1)
        for name in names[1:]:
            out[f"kiln_over_{name}"] = round(out["kiln_batches_per_s"] / out[f"{name}_batches_per_s"], 2)
    return out


@contextlib.contextmanager
def s3_dataset(n_shards: int, shard_windows: int, latency_s: float, seq_len: int = 256):
    """(storage options, s3 URL, local copy, dataset bytes) of a shard directory on a moto S3 server
    on 127.0.0.1, with `latency_s` added to every S3 request (client side, in s3fs's request path,
    so every reader pays it, DataLoader worker processes included: they fork with the patch)."""
    import asyncio
    import tempfile

    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{server._server.server_port}", "key": "k", "secret": "s"}
    real_call = s3fs.S3FileSystem._call_s3

    async def slow_call(self, *a, **k):
        await asyncio.sleep(latency_s)
        return await real_call(self, *a, **k)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "local"
            write_bench_shards(local, n_shards, shard_windows, seq_len)
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
            fs.mkdir("bench")
            for f in local.iterdir():
                fs.put_file(str(f), f"bench/d/{f.name}")
            total = sum(f.stat().st_size for f in local.glob("train-*.npy"))
            s3fs.S3FileSystem._call_s3 = slow_call
            yield opts, "s3://bench/d", local, total, Path(tmp)
    finally:
        s3fs.S3FileSystem._call_s3 = real_call
        server.stop()


def kiln_loader(url: str, opts: dict, cache_dir: Path, cache_bytes: int, seq_len: int, batch_size: int,
                policy: str = "auto"):
    from kiln.data.loader import Loader
    from kiln.data.shards import ShardSet
    from kiln.data.storage import ShardStore

    store = ShardStore(url, cache_dir=cache_dir, cache_bytes=cache_bytes, cache_policy=policy, storage_options=opts)
    return Loader(TokenWindows(ShardSet(url, "train", store), seq_len), batch_size, seed=0), store


def s3_throughput(n_shards: int, shard_windows: int, batches: int, latency_s: float, cache_fraction: float,
                  seq_len: int = 256, batch_size: int = 8, workers: int = 2, rounds: int = 3) -> dict:
    """Batches/s of kiln's Loader (default settings, a fresh cache each round) and of a plain torch
    DataLoader (shuffle=True, one range request per window) over `batches` batches, in `rounds`
    interleaved rounds whose order rotates; medians and every sample."""
    import time

    import s3fs
    import torch

    from kiln.data.shards import ShardSet

    out: dict = {"latency_ms": 1000 * latency_s, "shards": n_shards, "windows_per_shard": shard_windows,
                 "batches": batches, "batch_size": batch_size, "cache_fraction": cache_fraction, "rounds": rounds}
    with s3_dataset(n_shards, shard_windows, latency_s, seq_len) as (opts, url, local, total, tmp):
        local_windows = TokenWindows(ShardSet(local, "train"), seq_len)
        fs = s3fs.S3FileSystem(**opts)
        header = len(fs.cat_file("bench/d/train-00000.tokens.npy", start=0, end=128).split(b"\n")[0]) + 1
        dtype = np.dtype(ShardSet(local, "train").meta["dtype"])

        class RangeWindows(torch.utils.data.Dataset):  # the straightforward map-style dataset
            def __len__(self):
                return len(local_windows)

            def __getitem__(self, i):
                s, start = local_windows._locate(np.array([i]))
                name = f"bench/d/{local_windows.shards.shard_files(int(s[0]))[0]}"
                a = header + int(start[0]) * dtype.itemsize
                data = s3fs.S3FileSystem(**opts).cat_file(name, start=a, end=a + (seq_len + 1) * dtype.itemsize)
                return torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.int64))

        def run_kiln(r: int) -> float:
            loader, store = kiln_loader(url, opts, tmp / f"cache{r}", int(total * cache_fraction), seq_len, batch_size)
            t0 = time.perf_counter()
            for _ in range(batches):
                loader.next()
            rate = batches / (time.perf_counter() - t0)
            loader.close()
            out.setdefault("kiln_cache", []).append({"mode": store.mode, "hits_misses": store.counts()})
            store.close()
            return rate

        def run_dataloader(nw: int) -> float:
            it = iter(torch.utils.data.DataLoader(RangeWindows(), batch_size=batch_size, shuffle=True, num_workers=nw))
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            rate = batches / (time.perf_counter() - t0)
            del it
            return rate

        interleaved_rounds({"kiln": run_kiln, "dataloader_workers0": lambda r: run_dataloader(0),
                            f"dataloader_workers{workers}": lambda r: run_dataloader(workers)}, rounds, out, digits=2)
        out[f"kiln_over_dataloader_workers{workers}"] = round(
            out["kiln_batches_per_s"] / out[f"dataloader_workers{workers}_batches_per_s"], 2)
    return out


def s3_hit_rates(n_shards: int, shard_windows: int, epochs: int, latency_s: float, cache_fraction: float = 0.5,
                 seq_len: int = 256, batch_size: int = 8) -> dict:
    """The Loader's own per-epoch cache hit rates (`Loader.cache_hit_rates`) over `epochs` epochs
    from loopback S3, LRU vs static, with a cache of `cache_fraction` of the data (window mode)."""
    import time

    out: dict = {"latency_ms": 1000 * latency_s, "shards": n_shards, "windows_per_shard": shard_windows,
                 "epochs": epochs, "cache_fraction": cache_fraction}
    with s3_dataset(n_shards, shard_windows, latency_s, seq_len) as (opts, url, local, total, tmp):
        for policy in ("lru", "static"):
            loader, store = kiln_loader(url, opts, tmp / policy, int(total * cache_fraction), seq_len, batch_size,
                                        policy)
            steps = epochs * (len(loader.windows) // batch_size)
            t0 = time.perf_counter()
            for _ in range(steps):
                loader.next()
            seconds = time.perf_counter() - t0
            loader.close()
            rates = {e: r for e, r in loader.cache_hit_rates().items() if e < epochs}  # not the thread's lead
            out[policy] = {"mode": store.mode, "per_epoch": [round(r, 4) for r in rates.values()],
                           "batches_per_s": round(steps / seconds, 2),
                           "resident_windows": len(store.windows.where) if store.windows else None}
            store.close()
        out["static_over_lru"] = round(sum(out["static"]["per_epoch"]) / max(1e-9, sum(out["lru"]["per_epoch"])), 2)
    return out


def stall_10m(root: Path, steps: int, latency_s: float, corpus_bytes: int, fixed_step_ms: float = 20.0,
              fixed_steps: int = 200) -> dict:
    """`kiln loader-bench` (kiln/train/stall.py) on a ~10M-parameter model at default [data] loader
    settings, shards (a) local and (b) on a loopback moto S3 server with `latency_s` per request:
    the live stall (data wait / step time) of the threaded Loader feeding real steps, cold and warm."""
    import dataclasses
    import os
    import sysconfig

    from kiln.config import load_config
    from kiln.train.stall import analyze
    from kiln.plan.memory import ModelShape, vocab_estimate

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    if not corpus.is_file():  # standard-library source: real text, present on every machine
        parts, size = [], 0
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
            size += len(parts[-1])
            if size >= corpus_bytes:
                break
        corpus.write_text("\n\n".join(parts), encoding="utf-8")
    overrides = ["model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.max_seq_len=256",
                 "data.tokenizer=\"byte\"", "data.seq_len=256", f"data.source=\"{corpus}\"", "data.max_bytes=0",
                 "train.batch_size=8", "train.device=\"cpu\""]
    cfg = load_config(None, overrides)
    out: dict = {"params": ModelShape.from_config(cfg.model, vocab_estimate(cfg)[0]).params, "overrides": overrides,
                 "steps": steps, "latency_ms": 1000 * latency_s, "torch_threads": torch_threads()}
    local = analyze(cfg, root / "local", steps=steps, log=lambda m: None)
    out["local"] = summary(local)
    shard_dir = root / "local" / "data"
    out["local"]["fixed_step"] = fixed_step_stall(cfg, str(shard_dir), root / "fixed-local", fixed_step_ms, fixed_steps)
    n_shards = len(list(shard_dir.glob("train-*.tokens.npy")))
    with s3_dataset(1, 1, latency_s) as (opts, _url, _local, _total, _tmp):
        import s3fs

        fs = s3fs.S3FileSystem(**opts)
        for f in shard_dir.iterdir():
            if f.is_file():
                fs.put_file(str(f), f"bench/stall/{f.name}")
        env = {"AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            remote_cfg = load_config(None, overrides + ["data.source=\"s3://bench/stall\"",
                                                        f"data.cache_dir=\"{root / 'cache'}\""])
            out["s3"] = summary(analyze(remote_cfg, root / "s3", steps=steps, log=lambda m: None))
            out["s3"]["fixed_step"] = fixed_step_stall(remote_cfg, "s3://bench/stall", root / "fixed-s3",
                                                       fixed_step_ms, fixed_steps)
            half = dataclasses.replace(remote_cfg, data=dataclasses.replace(
                remote_cfg.data, cache_gb=out["s3"]["data_bytes"] / 2 / (1 << 30)))  # not default: window mode
            out["s3"]["fixed_step_half_cache"] = fixed_step_stall(half, "s3://bench/stall", root / "fixed-s3-half",
                                                                  fixed_step_ms, fixed_steps)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    out["train_shards"] = n_shards
    return out


def fixed_step_stall(cfg, shard_dir: str, cache_dir: Path, step_ms: float, steps: int) -> dict:
    """The same live measurement (`stall.live_stall`: threaded Loader, default settings, data wait
    over step time), but each step is `time.sleep(step_ms)`: a stand-in for a GPU step of that
    length, which leaves the CPU (and the GIL) to the loader, as a CUDA step mostly does. The step is
    not a model; the loader, the store and the storage are the real ones. Cold (fresh cache), then
    warm (the same store)."""
    import dataclasses
    import time

    import torch

    from kiln.data.shards import ShardSet
    from kiln.data.storage import drop_page_cache
    from kiln.train.stall import live_stall
    from kiln.data.storage import open_store

    store = open_store(shard_dir, dataclasses.replace(cfg.data, cache_dir=str(cache_dir)))
    try:
        windows = TokenWindows(ShardSet(shard_dir, "train", store), cfg.data.seq_len)
        step = lambda micro: time.sleep(step_ms / 1000)  # noqa: E731
        out = {"step_ms": step_ms, "steps": steps, "cache_mode": store.mode}
        if not store.remote:  # local shards: cold = not in the page cache
            drop_page_cache([Path(shard_dir) / f for s in range(len(windows.tokens))
                             for f in windows.shards.shard_files(s)])
        for phase in ("cold", "warm"):
            live = live_stall(cfg, windows, step, torch.device("cpu"), steps)
            out[phase] = {"stall_fraction": round(live["stall_fraction"], 5),
                          "steady_stall_fraction": round(live["steady_stall_fraction"], 5),
                          "first_wait_ms": round(1e3 * live["wait_s"][0], 2),
                          "max_steady_wait_ms": round(1e3 * max(live["wait_s"][1:]), 2)}
    finally:
        store.close()
    return out


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def summary(report: dict) -> dict:
    """The loader-bench figures this benchmark reports (ms per step, stall fractions)."""
    live = report["live"]
    return {"data_bytes": report["data_bytes"], "compute_ms_per_step": round(1e3 * report["compute_s_per_step"], 1),
            "modelled_stall_fraction": round(report["stall_fraction"], 5),
            "slowest_cold_batch_ms": round(1e3 * report["slowest_cold_batch_s"], 2),
            **{f"live_{phase}": {"stall_fraction": round(live[phase]["stall_fraction"], 5),
                                 "steady_stall_fraction": round(live[phase]["steady_stall_fraction"], 5),
                                 "wait_ms": [round(1e3 * w, 2) for w in live[phase]["wait_s"]],
                                 "step_ms": [round(1e3 * w, 1) for w in live[phase]["step_s"]],
                                 "cache_hit_rates": live[phase]["cache_hit_rates"]} for phase in ("cold", "warm")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["cache", "s3", "local", "hits", "stall"])
    ap.add_argument("--root", default="/tmp/kiln-loader-stall", help="stall: corpus, run dirs and cache")
    ap.add_argument("--steps", type=int, default=5, help="stall: steps per phase")
    ap.add_argument("--corpus-mb", type=float, default=4.0, help="stall: MB of standard-library text")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--shards", type=int, default=None, help="default: 40 (cache), 16 (s3, local), 8 (hits)")
    ap.add_argument("--windows-per-shard", type=int, default=None, help="default: 200 (cache, s3), 100 (hits)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--granularity", choices=["window", "shard"], default="window")
    args = ap.parse_args()
    if args.what == "s3":
        result = s3_throughput(args.shards or 16, args.windows_per_shard or 200, args.batches,
                               args.latency_ms / 1000, args.cache_fraction, rounds=args.rounds)
    elif args.what == "local":
        result = local_throughput(args.shards or 16, args.windows_per_shard or 200, args.batches, rounds=args.rounds)
    elif args.what == "stall":
        result = stall_10m(Path(args.root), args.steps, args.latency_ms / 1000, int(args.corpus_mb * 1e6))
    elif args.what == "hits":
        result = s3_hit_rates(args.shards or 8, args.windows_per_shard or 100, args.epochs, args.latency_ms / 1000,
                              args.cache_fraction)
    else:
        result = cache_hit_rates(args.shards or 40, args.windows_per_shard or 200, args.epochs,
                                 args.cache_fraction, granularity=args.granularity)
    from common import RESULTS_DIR, machine_info

    result = {**result, "machine": machine_info(), "load_average": os.getloadavg(),
              "command": "python benchmarks/loader.py " + " ".join(sys.argv[1:])}
    suffix = {"s3": f"-cache{args.cache_fraction}", "cache": f"-{args.granularity}"}.get(args.what, "")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"loader_{args.what}{suffix}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
