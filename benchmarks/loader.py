"""Shard-cache hit rates of kiln's policies under the Loader's own random-order epochs.

The access sequence is the real one: the shard of every window the Loader reads, epoch by epoch,
in `epoch_order` (the sampler `kiln train` uses), replayed against `LRUPolicy` and `StaticPolicy`
(CoorDL) from kiln/data/cache.py with a cache of half the dataset's bytes.

    python benchmarks/loader.py cache [--shards 40] [--windows-per-shard 200] [--epochs 3]
                                     [--granularity shard|window]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.data.cache import LRUPolicy, StaticPolicy, epoch_hit_rates  # noqa: E402
from kiln.data.loader import TokenWindows, epoch_order  # noqa: E402


def cache_hit_rates(n_shards: int, windows_per_shard: int, epochs: int, cache_fraction: float = 0.5,
                    seq_len: int = 256, seed: int = 0, granularity: str = "shard") -> dict:
    """granularity "shard": the cache holds shard files (what ShardCache does); "window": it holds
    single windows, each read once per epoch (CoorDL's item cache setting)."""
    streams = [np.zeros(windows_per_shard * seq_len + 1, dtype=np.uint16) for _ in range(n_shards)]
    windows = TokenWindows(streams, seq_len)
    sizes = [int(s.nbytes) for s in streams]
    if granularity == "window":
        sizes = [(seq_len + 1) * 2] * len(windows)
        orders = [epoch_order(len(windows), seed, e).tolist() for e in range(epochs)]
    else:
        orders = [windows._locate(epoch_order(len(windows), seed, e))[0].tolist() for e in range(epochs)]
    capacity = int(sum(sizes) * cache_fraction)
    out = {"granularity": granularity, "shards": n_shards, "windows": len(windows), "epochs": epochs, "cache_fraction": cache_fraction}
    for name, policy in (("lru", LRUPolicy(capacity)), ("static", StaticPolicy(capacity))):
        rates = epoch_hit_rates(policy, sizes, orders)
        out[name] = {"per_epoch": [round(r, 4) for r in rates], "total_hits": round(sum(rates) * len(windows))}
    out["static_over_lru"] = round(out["static"]["total_hits"] / max(1, out["lru"]["total_hits"]), 2)
    return out


def s3_throughput(n_shards: int, shard_windows: int, batches: int, latency_s: float, cache_fraction: float,
                  seq_len: int = 256, batch_size: int = 8, workers: int = 2) -> dict:
    """Batches/s of kiln's Loader and of a plain torch DataLoader (one range request per window)
    from a moto S3 server on 127.0.0.1, with `latency_s` added to every S3 request (client side,
    in s3fs's request path, so both loaders pay it)."""
    import asyncio
    import tempfile
    import time

    import s3fs
    import torch
    from moto.server import ThreadedMotoServer

    from kiln.data.loader import Loader
    from kiln.data.shards import ShardSet, ShardWriter, write_meta
    from kiln.data.storage import ShardStore

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{server._server.server_port}", "key": "k", "secret": "s"}
    real_call = s3fs.S3FileSystem._call_s3

    async def slow_call(self, *a, **k):
        await asyncio.sleep(latency_s)
        return await real_call(self, *a, **k)

    s3fs.S3FileSystem._call_s3 = slow_call
    out: dict = {"latency_ms": 1000 * latency_s, "shards": n_shards, "cache_fraction": cache_fraction}
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "local"
        w = ShardWriter(local, "train", vocab_size=1000, eos_id=999, shard_tokens=shard_windows * seq_len)
        rng = np.random.default_rng(0)
        for _ in range(n_shards * shard_windows // 4):
            w.add(rng.integers(0, 999, 4 * seq_len - 1))
        w.finish()
        write_meta(local, [w])
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.mkdir("bench")
        for f in local.iterdir():
            fs.put_file(str(f), f"bench/d/{f.name}")
        total = sum(f.stat().st_size for f in local.glob("*.tokens.npy"))
        store = ShardStore("s3://bench/d", cache_dir=Path(tmp) / "cache", cache_bytes=int(total * cache_fraction),
                           storage_options=opts)
        windows = TokenWindows(ShardSet("s3://bench/d", "train", store), seq_len)
        loader = Loader(windows, batch_size, seed=0)
        t0 = time.perf_counter()
        for _ in range(batches):
            loader.next()
        out["kiln_batches_per_s"] = round(batches / (time.perf_counter() - t0), 2)
        loader.close()
        out["kiln_cache"] = {"hits": store.cache.hits, "misses": store.cache.misses}

        header = len(fs.cat_file("bench/d/train-00000.tokens.npy", start=0, end=128).split(b"\n")[0]) + 1
        dtype = np.dtype(ShardSet(local, "train").meta["dtype"])

        class RangeWindows(torch.utils.data.Dataset):  # the straightforward map-style dataset
            def __len__(self):
                return len(windows)

            def __getitem__(self, i):
                s, start = windows._locate(np.array([i]))
                name = f"bench/d/{windows.shards.shard_files(int(s[0]))[0]}"
                fs_ = s3fs.S3FileSystem(**opts)
                a = header + int(start[0]) * dtype.itemsize
                data = fs_.cat_file(name, start=a, end=a + (seq_len + 1) * dtype.itemsize)
                return torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.int64))

        for nw in sorted({0, workers}):
            dl = torch.utils.data.DataLoader(RangeWindows(), batch_size=batch_size, shuffle=True, num_workers=nw)
            it = iter(dl)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            out[f"dataloader_workers{nw}_batches_per_s"] = round(batches / (time.perf_counter() - t0), 2)
            del it
    s3fs.S3FileSystem._call_s3 = real_call
    server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["cache", "s3"])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--windows-per-shard", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--granularity", choices=["shard", "window"], default="shard")
    args = ap.parse_args()
    if args.what == "s3":
        print(json.dumps(s3_throughput(args.shards, args.windows_per_shard, args.batches,
                                       args.latency_ms / 1000, args.cache_fraction)))
        return
    print(json.dumps(cache_hit_rates(args.shards, args.windows_per_shard, args.epochs,
                                     granularity=args.granularity), indent=1))


if __name__ == "__main__":
    main()
