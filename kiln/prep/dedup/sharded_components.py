"""Connected components of a duplicate-candidate graph, sharded by node id, for graphs larger
than one process's memory.

The algorithm is alternating large-star / small-star (Kiveris et al. 2014, "Connected Components
in MapReduce and Beyond"), written here with numpy sorts (`np.unique`, `np.minimum.reduceat`);
each phase is `n_parts` independent tasks that any `map` runs (in-process, a process pool, Ray):

    init       one task per input edge file: route each edge, both directions, to the part
               that owns its key node (`node % n_parts`).
    large r    part p, for each of its nodes u with neighbours N(u): m = min(N(u) + u);
               link every neighbour v > u to m.
    small r    part p, for each of its nodes u with smaller neighbours S(u): m = min(S(u) + u);
               link u and every v in S(u) to m.

The graph stops changing exactly when it is a forest of stars centred on each component's lowest
id, so a node is a duplicate iff it keeps a smaller neighbour: the same documents as scipy's
`components_keep_lowest` (the lowest id of each cluster is kept). Rounds: O(log^2 n) in theory,
a handful in practice (chains included, see tests).

Memory per task: the edges of its part (16 B per directed edge, x ~3 while sorting), not the
graph. One skew remains: a cluster's lowest id gathers an edge from every member, so the part
owning it holds the whole cluster (a million-member cluster is ~50 MB in one task).

Files live in `work_dir/P{n_parts}/`: `{phase}-from{src}-to{dst}.npy` and a done marker
`{phase}-{task}.json` written last (atomically), so a rerun skips finished tasks and redoes any
task whose marker is missing or whose files do not match it (an interrupted run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from kiln.errors import ConfigError, DataError
from kiln.io import atomic_file, atomic_write_json

MapFn = Callable[[Callable[..., Any], list[tuple]], Iterable[Any]]
_EMPTY = np.zeros((2, 0), dtype=np.int64)


def check_cluster_parts(value: int, where: str) -> None:
    """The `cluster_parts` option of the dedup steps that can cluster sharded (0 = scipy)."""
    if not isinstance(value, int) or not 0 <= value <= 65536:
        raise ConfigError(f"{where}.cluster_parts={value!r} must be an integer in [0, 65536]")


def _serial_map(fn: Callable[..., Any], args: list[tuple]) -> Iterable[Any]:
    return [fn(*a) for a in args]


def _save(path: Path, array: np.ndarray) -> None:
    # no fsync (it dominated the wall time): a file lost to a power cut no longer matches its
    # task's marker, and `_task_done` then reruns the task
    with atomic_file(path, "wb", fsync=False) as f:
        np.save(f, array)


def _phase_dir(work_dir: Path, n_parts: int) -> Path:
    return Path(work_dir) / f"P{n_parts}"


def _out_path(d: Path, phase: str, src: int) -> Path:
    """One file per task, its edges grouped by destination part (offsets in the marker): n_parts
    files per phase rather than n_parts^2 (creating files dominated the time on a shared disk)."""
    return d / f"{phase}-from{src:05d}.npy"


def _marker(d: Path, phase: str, task: int) -> Path:
    return d / f"{phase}-{task:05d}.json"


def _task_done(d: Path, phase: str, task: int, n_parts: int) -> dict | None:
    """The marker of a finished task, if it and every file it lists are intact."""
    try:
        marker = json.loads(_marker(d, phase, task).read_text(encoding="utf-8"))
        if np.load(_out_path(d, phase, task), mmap_mode="r").shape != (2, sum(marker["counts"])):
            return None
        return marker if len(marker["counts"]) == n_parts and (not phase.startswith("large") or
                                                                "changed" in marker) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_edge_file(path: Path, n_nodes: int) -> np.ndarray:
    """A (2, E) int64 edge array from an input file, checked: ids in [0, n_nodes)."""
    try:
        edges = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: missing edge file (the stage that writes it did not finish)") from None
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: unreadable edge file ({e}); rerun the previous stage") from None
    if edges.ndim != 2 or edges.shape[0] != 2 or not np.issubdtype(edges.dtype, np.integer):
        raise DataError(f"{path}: expected a (2, E) integer array of edges, got {edges.dtype} {edges.shape}")
    edges = edges.astype(np.int64, copy=False)
    if edges.size and (edges.min() < 0 or edges.max() >= n_nodes):
        raise DataError(f"{path}: node ids outside [0, {n_nodes})")
    return edges


def _unique_pairs(key: np.ndarray, nbr: np.ndarray, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (key, nbr) pairs sorted by key then nbr (packed into one int64 when ids allow)."""
    if n_nodes < 3_000_000_000:
        packed = np.unique(key * n_nodes + nbr)
        return packed // n_nodes, packed % n_nodes
    pairs = np.unique(np.stack([key, nbr], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def _route(d: Path, phase: str, task: int, n_parts: int, key: np.ndarray, nbr: np.ndarray,
           **extra: Any) -> dict:
    """Write (key, nbr) pairs to the part owning each key; then this task's done marker."""
    owner = key % n_parts
    order = np.argsort(owner, kind="stable")
    _save(_out_path(d, phase, task), np.stack([key[order], nbr[order]]))
    counts = np.bincount(owner, minlength=n_parts).tolist()
    marker = {"counts": counts, **extra}
    atomic_write_json(_marker(d, phase, task), marker, fsync=False)
    return marker


def _gather(d: Path, phase: str, n_sources: int, part: int) -> tuple[np.ndarray, np.ndarray]:
    arrays = []
    for src in range(n_sources):
        counts = json.loads(_marker(d, phase, src).read_text(encoding="utf-8"))["counts"]
        lo = sum(counts[:part])
        arrays.append(np.array(np.load(_out_path(d, phase, src), mmap_mode="r")[:, lo:lo + counts[part]]))
    edges = np.concatenate(arrays, axis=1) if arrays else _EMPTY
    return edges[0], edges[1]


def init_task(work_dir: str, n_parts: int, n_nodes: int, task: int, edge_file: str) -> int:
    d = _phase_dir(Path(work_dir), n_parts)
    if _task_done(d, "init", task, n_parts) is None:
        u, v = read_edge_file(Path(edge_file), n_nodes)
        keep = u != v
        u, v = u[keep], v[keep]
        _route(d, "init", task, n_parts, np.concatenate([u, v]), np.concatenate([v, u]))
    return task


def _group_min(key: np.ndarray, nbr: np.ndarray) -> np.ndarray:
    """For pairs sorted by key: min(key, min nbr of its group) for every pair."""
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    group_min = np.minimum(np.minimum.reduceat(nbr, starts), key[starts])
    return np.repeat(group_min, np.diff(np.r_[starts, len(key)]))


def large_task(work_dir: str, n_parts: int, n_nodes: int, rnd: int, part: int, n_sources: int) -> dict:
    """Large-star over this part's nodes; returns whether its edge set changed since last round."""
    d = _phase_dir(Path(work_dir), n_parts)
    phase = f"large{rnd:03d}"
    marker = _task_done(d, phase, part, n_parts)
    if marker is not None:
        return marker
    source = "init" if rnd == 0 else f"small{rnd - 1:03d}"
    key, nbr = _unique_pairs(*_gather(d, source, n_sources, part), n_nodes)
    own = np.stack([key[nbr < key], nbr[nbr < key]])  # this round's graph, each edge at its larger end
    previous = d / f"own{rnd - 1:03d}-{part:05d}.npy"
    changed = rnd == 0 or not previous.exists() or not np.array_equal(np.load(previous), own)
    _save(d / f"own{rnd:03d}-{part:05d}.npy", own)
    if len(key):
        m = _group_min(key, nbr)
        sel = nbr > key
        key, nbr = nbr[sel], m[sel]  # v -> m, owned by v (the larger end)
    return _route(d, phase, part, n_parts, key, nbr, changed=bool(changed), edges=int(own.shape[1]))


def small_task(work_dir: str, n_parts: int, n_nodes: int, rnd: int, part: int) -> dict:
    """Small-star over this part's nodes (each pair is (node, smaller neighbour))."""
    d = _phase_dir(Path(work_dir), n_parts)
    phase = f"small{rnd:03d}"
    marker = _task_done(d, phase, part, n_parts)
    if marker is None:
        key, nbr = _unique_pairs(*_gather(d, f"large{rnd:03d}", n_parts, part), n_nodes)
        if len(key):
            m = _group_min(key, nbr)
            starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            sel = nbr != m  # every smaller neighbour but the minimum, plus the node itself
            a = np.concatenate([nbr[sel], key[starts]])
            b = np.concatenate([m[sel], m[starts]])
            key, nbr = np.concatenate([a, b]), np.concatenate([b, a])
        marker = _route(d, phase, part, n_parts, key, nbr)
    return marker


def sharded_duplicates(n_nodes: int, edge_files: list[str | Path], work_dir: str | Path, n_parts: int,
                       map_fn: MapFn = _serial_map, max_rounds: int = 64) -> tuple[np.ndarray, dict]:
    """Sorted ids of the nodes that are not the lowest of their component, and counts
    ({"rounds", "parts", "edges"}). `map_fn(fn, list_of_arg_tuples)` runs one phase's tasks."""
    if n_parts < 1:
        raise ValueError("n_parts must be >= 1")
    work_dir = Path(work_dir)
    _phase_dir(work_dir, n_parts).mkdir(parents=True, exist_ok=True)
    wd = str(work_dir)
    list(map_fn(init_task, [(wd, n_parts, n_nodes, i, str(f)) for i, f in enumerate(edge_files)]))
    n_sources = len(edge_files)
    for rnd in range(max_rounds):
        markers = list(map_fn(large_task, [(wd, n_parts, n_nodes, rnd, p, n_sources) for p in range(n_parts)]))
        if rnd > 0 and not any(m["changed"] for m in markers):
            d = _phase_dir(work_dir, n_parts)
            dup = [np.unique(np.load(d / f"own{rnd:03d}-{p:05d}.npy")[0]) for p in range(n_parts)]
            dup_ids = np.sort(np.concatenate(dup)) if dup else np.zeros(0, np.int64)
            return dup_ids, {"rounds": rnd, "parts": n_parts, "edges": sum(m["edges"] for m in markers)}
        list(map_fn(small_task, [(wd, n_parts, n_nodes, rnd, p) for p in range(n_parts)]))
        n_sources = n_parts
    raise DataError(f"{work_dir}: connected components did not converge in {max_rounds} rounds")


def sharded_keep_lowest(n_nodes: int, edge_files: list[str | Path], work_dir: str | Path, n_parts: int,
                        map_fn: MapFn = _serial_map) -> np.ndarray:
    """Boolean mask of the nodes to keep, equal to components.components_keep_lowest's."""
    keep = np.ones(n_nodes, dtype=bool)
    keep[sharded_duplicates(n_nodes, edge_files, work_dir, n_parts, map_fn)[0]] = False
    return keep
