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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["cache"])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--windows-per-shard", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--granularity", choices=["shard", "window"], default="shard")
    args = ap.parse_args()
    print(json.dumps(cache_hit_rates(args.shards, args.windows_per_shard, args.epochs,
                                     granularity=args.granularity), indent=1))


if __name__ == "__main__":
    main()
