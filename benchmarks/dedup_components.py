"""Connected components of near-duplicate edges: scipy in one process vs kiln's sharded
large-star/small-star tasks (kiln/prep/dedup/sharded_components.py).

    python benchmarks/dedup_components.py [--edges 10000,100000,1000000] [--parts 8]

Graphs look like MinHash output: as many nodes as edges, clusters of 2..50 members (a few
members each linked to a random earlier member, so chains and stars both occur), spread over the
id space, split into --files edge files ("bands", 4). Memory is the tracemalloc peak (numpy and scipy
arrays are traced) of the scipy call including loading its edges, and the largest peak of any
single sharded task: init tasks (one per edge file) and star tasks (one per part and phase).
Writes benchmarks/results/dedup_components.json (other --parts/--files: a suffixed name). Both results are checked equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.prep.dedup import sharded_components as sc  # noqa: E402
from kiln.prep.dedup.components import components_keep_lowest  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "dedup_components{}.json"


def clustered_edges(n_edges: int, seed: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = n_edges
    perm = rng.permutation(n)  # cluster members are scattered over the id space
    sizes = rng.integers(2, 51, n)
    us, vs, start, made = [], [], 0, 0
    while made < n_edges and start + 2 <= n:
        size = int(min(sizes[start % n], n - start))
        members = perm[start:start + size]
        parents = rng.integers(0, np.arange(1, size))  # member i links to an earlier member
        us.append(members[1:])
        vs.append(members[parents])
        made += size - 1
        start += size
    return n, np.concatenate(us)[:n_edges], np.concatenate(vs)[:n_edges]


def traced(fn, *args):
    tracemalloc.start()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="10000,100000,1000000")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--files", type=int, default=4, help="edge files the graph is split into (LSH bands)")
    args = parser.parse_args()
    rows = []
    components_keep_lowest(2, np.array([0]), np.array([1]))  # import scipy outside the timings
    for n_edges in [int(x) for x in args.edges.split(",")]:
        n, u, v = clustered_edges(n_edges)
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for i, (a, b) in enumerate(zip(np.array_split(u, args.files), np.array_split(v, args.files))):
                files.append(Path(tmp) / f"edges-band{i:04d}.npy")
                np.save(files[-1], np.stack([a, b]))

            def scipy_run():
                edges = np.concatenate([np.load(f) for f in files], axis=1)
                return components_keep_lowest(n, edges[0], edges[1])

            expected, scipy_s, scipy_peak = traced(scipy_run)
            task_peaks: dict[str, list[int]] = {"init_task": [], "large_task": [], "small_task": []}

            def measuring_map(fn, arg_list):  # each task traced on its own, run in turn
                out = []
                for a in arg_list:
                    result, _, peak = traced(fn, *a)
                    task_peaks[fn.__name__].append(peak)
                    out.append(result)
                return out

            t0 = time.perf_counter()
            (dup, info) = sc.sharded_duplicates(n, files, Path(tmp) / "cc", args.parts, measuring_map)
            sharded_s = time.perf_counter() - t0
            keep = np.ones(n, dtype=bool)
            keep[dup] = False
            assert np.array_equal(keep, expected), "sharded result differs from scipy"
        row = {"edges": n_edges, "nodes": n, "parts": args.parts, "rounds": info["rounds"],
               "scipy_seconds": round(scipy_s, 3), "scipy_peak_mb": round(scipy_peak / 2**20, 2),
               "sharded_seconds_serial": round(sharded_s, 3),
               "init_task_peak_mb": round(max(task_peaks["init_task"]) / 2**20, 2),
               "star_task_peak_mb": round(max(task_peaks["large_task"] + task_peaks["small_task"]) / 2**20, 2),
               "tasks": sum(map(len, task_peaks.values()))}
        rows.append(row)
        print(json.dumps(row))
    default = args.parts == 8 and args.files == 4
    results = Path(str(RESULTS).format("" if default else f"-p{args.parts}-f{args.files}"))
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
