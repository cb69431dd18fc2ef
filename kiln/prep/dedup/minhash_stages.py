"""MinHash-LSH dedup in on-disk stages, so corpora larger than one process's memory work.

1. signatures  per input shard (parallel): `sig-{shard:05d}.npy`, (docs, num_perm) uint32;
               for verify="exact" also the shingle sets `sets-{shard:05d}.npy` (flat uint32)
               and `setoff-{shard:05d}.npy` (offsets).
2. band edges  per group of bands (parallel): for each band, the band keys of all shards
               (read column-wise from the memory-mapped signatures), bucketed by sorting,
               -> `edges-band{band:04d}.npy` with global (u, v) document ids.
3. clusters    once: unique edges, verification (exact Jaccard from the memory-mapped
               shingle sets, or signature agreement), connected components (scipy), lowest
               global id kept
               -> `drop-{shard:05d}.npy`, the positions to drop in each shard.
               With `cluster_parts` > 0 instead: each band task verifies its own pairs
               (`verified-band{band:04d}.npy`) and sharded_components.py clusters them in
               executor tasks; `write_drop_ids` writes the same drop files.
4. filter      per shard (parallel): drop those positions.

Global ids number documents in shard order (shard offsets from the signature files' lengths).
Peak memory per document: stage 2 holds, for one band at a time, a key (8 B), an id (8 B) and
the sort order (8 B): ~24 B/doc, whatever num_perm is; stage 3 holds ~8 B/doc of component
labels plus 16 B per candidate edge. Signatures (num_perm x 4 B/doc) and shingle sets
(~4 B per shingle) stay on disk; only candidate documents' rows are read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.prep.dedup.components import components_keep_lowest
from kiln.prep.dedup.jaccard import pair_jaccard, ranges
from kiln.prep.dedup.minhash import (MinHashConfig, MinHasher, band_keys, bucket_edges,
                                          signature_agreement, unique_edges)
from kiln.errors import DataError
from kiln.io import atomic_file

BYTES_PER_DOC_GLOBAL = 24


def signature_path(work_dir: Path, shard: int) -> Path:
    return Path(work_dir) / f"sig-{shard:05d}.npy"


def edges_path(work_dir: Path, band: int) -> Path:
    return Path(work_dir) / f"edges-band{band:04d}.npy"


def drop_path(work_dir: Path, shard: int) -> Path:
    return Path(work_dir) / f"drop-{shard:05d}.npy"


def sets_paths(work_dir: Path, shard: int) -> tuple[Path, Path]:
    return Path(work_dir) / f"sets-{shard:05d}.npy", Path(work_dir) / f"setoff-{shard:05d}.npy"


def save_atomic(path: Path, array: np.ndarray) -> None:
    """np.save under a temporary name, then rename: a crashed worker leaves no truncated file."""
    with atomic_file(path, "wb") as f:
        np.save(f, array)


def write_signatures(texts: list[str], hasher: MinHasher, work_dir: Path, shard: int) -> int:
    """Stage 1: signatures (and shingle sets for exact verification) of one shard's documents."""
    save_stage1(work_dir, shard, *hasher.signatures_and_sets(texts, hasher.config.verify == "exact"))
    return len(texts)


def save_stage1(work_dir: Path, shard: int, sig: np.ndarray, flat: np.ndarray | None,
                offsets: np.ndarray | None) -> None:
    if flat is not None and offsets is not None:
        sets_file, offsets_file = sets_paths(work_dir, shard)
        save_atomic(sets_file, flat)
        save_atomic(offsets_file, offsets)
    save_atomic(signature_path(work_dir, shard), sig)  # last: its presence marks the shard done


def _open_signatures(work_dir: Path, n_shards: int) -> tuple[list[np.ndarray], np.ndarray]:
    sigs = []
    for shard in range(n_shards):
        path = signature_path(work_dir, shard)
        if not path.exists():
            raise DataError(f"{path}: missing MinHash signatures of shard {shard} (stage 1 did not finish)")
        sigs.append(np.load(path, mmap_mode="r"))
    offsets = np.zeros(n_shards + 1, dtype=np.int64)
    np.cumsum([len(s) for s in sigs], out=offsets[1:])
    return sigs, offsets


def write_band_edges(work_dir: Path, n_shards: int, bands: list[int], rows: int) -> int:
    """Stage 2 for some bands; returns the number of edges written."""
    sigs, offsets = _open_signatures(work_dir, n_shards)
    ids = np.arange(offsets[-1], dtype=np.int64)
    total = 0
    for band in bands:
        # only this band's columns are read from each memory-mapped signature file
        keys = np.concatenate([band_keys(np.asarray(s[:, band * rows:(band + 1) * rows]), 0, rows)
                               for s in sigs]) if len(ids) else np.zeros(0, np.uint64)
        u, v = bucket_edges(keys, ids)
        # atomic: a killed run must never leave an edges file that looks complete
        save_atomic(edges_path(work_dir, band), np.stack([u, v]))
        total += len(u)
    return total


def verified_path(work_dir: Path, band: int) -> Path:
    return Path(work_dir) / f"verified-band{band:04d}.npy"


def write_verified_band(work_dir: Path, n_shards: int, band: int, threshold: float, verify: str) -> dict[str, int]:
    """One band's candidate pairs, verified on their own (for the sharded clustering), saved
    atomically to `verified-band{band}.npy`; returns this band's counts."""
    sigs, offsets = _open_signatures(work_dir, n_shards)
    path = edges_path(work_dir, band)
    if not path.exists():
        raise DataError(f"{path}: missing LSH edges of band {band} (stage 2 did not finish)")
    edges = np.load(path)
    u, v = unique_edges(edges[0], edges[1])
    candidates = len(u)
    u, v = _verify(work_dir, n_shards, sigs, offsets, u, v, threshold, verify)
    save_atomic(verified_path(work_dir, band), np.stack([u, v]))
    return {"band_candidate_pairs": candidates, "band_verified_pairs": len(u)}


def write_drop_ids(work_dir: Path, n_shards: int, dup_ids: np.ndarray) -> None:
    """Per-shard drop positions from sorted global ids of duplicates."""
    _, offsets = _open_signatures(work_dir, n_shards)
    for shard in range(n_shards):
        lo, hi = np.searchsorted(dup_ids, [offsets[shard], offsets[shard + 1]])
        save_atomic(drop_path(work_dir, shard), dup_ids[lo:hi] - offsets[shard])


def _verify(work_dir: Path, n_shards: int, sigs: list[np.ndarray], offsets: np.ndarray, u: np.ndarray,
            v: np.ndarray, threshold: float, verify: str) -> tuple[np.ndarray, np.ndarray]:
    if verify == "exact" and len(u):
        return _exact_verified(work_dir, n_shards, offsets, u, v, threshold)
    if verify == "signature" and len(u):
        ok = np.zeros(len(u), dtype=bool)
        for lo in range(0, len(u), 65536):  # verify in chunks: bounded memory
            cu, cv = u[lo:lo + 65536], v[lo:lo + 65536]
            ok[lo:lo + 65536] = signature_agreement(_rows(sigs, offsets, cu), _rows(sigs, offsets, cv)) >= threshold
        return u[ok], v[ok]
    return u, v


def write_drops(work_dir: Path, n_shards: int, bands: int, threshold: float, verify: str) -> dict[str, int]:
    """Stage 3: clusters over all bands' edges -> per-shard positions to drop; returns counts."""
    sigs, offsets = _open_signatures(work_dir, n_shards)
    us, vs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for band in range(bands):
        path = edges_path(work_dir, band)
        if not path.exists():
            raise DataError(f"{path}: missing LSH edges of band {band} (stage 2 did not finish)")
        edges = np.load(path)
        us.append(edges[0])
        vs.append(edges[1])
    u, v = unique_edges(np.concatenate(us), np.concatenate(vs))
    candidates = len(u)
    u, v = _verify(work_dir, n_shards, sigs, offsets, u, v, threshold, verify)
    keep = components_keep_lowest(int(offsets[-1]), u, v)
    for shard in range(n_shards):
        np.save(drop_path(work_dir, shard), np.flatnonzero(~keep[offsets[shard]:offsets[shard + 1]]))
    return {"candidate_pairs": candidates, "verified_pairs": len(u), "clusters_dropped": int((~keep).sum())}


def _exact_verified(work_dir: Path, n_shards: int, doc_offsets: np.ndarray, u: np.ndarray, v: np.ndarray,
                    threshold: float, chunk: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """Edges whose exact shingle-set Jaccard is >= threshold (sets read from memory-mapped files)."""
    sets, set_offsets = [], []
    for shard in range(n_shards):
        sets_file, offsets_file = sets_paths(work_dir, shard)
        if not sets_file.exists() or not offsets_file.exists():
            raise DataError(f"{sets_file}: missing shingle sets of shard {shard} (stage 1 ran without "
                            "verify='exact', or did not finish)")
        sets.append(np.load(sets_file, mmap_mode="r"))
        set_offsets.append(np.load(offsets_file))

    def gather(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(concatenated shingle sets of the documents `ids`, their lengths)."""
        shard_of = np.searchsorted(doc_offsets, ids, side="right") - 1
        local = ids - doc_offsets[shard_of]
        starts = np.empty(len(ids), dtype=np.int64)
        lengths = np.empty(len(ids), dtype=np.int64)
        shards = np.unique(shard_of)
        for shard in shards:
            sel = shard_of == shard
            starts[sel] = set_offsets[shard][local[sel]]
            lengths[sel] = set_offsets[shard][local[sel] + 1] - starts[sel]
        flat = np.empty(int(lengths.sum()), dtype=np.uint32)
        dest = np.cumsum(lengths) - lengths
        for shard in shards:
            sel = shard_of == shard
            flat[ranges(dest[sel], lengths[sel])] = sets[shard][ranges(starts[sel], lengths[sel])]
        return flat, lengths

    keep = np.zeros(len(u), dtype=bool)
    for lo in range(0, len(u), chunk):
        flat_u, len_u = gather(u[lo:lo + chunk])
        flat_v, len_v = gather(v[lo:lo + chunk])
        keep[lo:lo + chunk] = pair_jaccard(flat_u, len_u, flat_v, len_v) >= threshold
    return u[keep], v[keep]


def _rows(sigs: list[np.ndarray], offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Signature rows of global ids, gathered shard by shard from the memory-mapped files."""
    out = np.empty((len(ids), sigs[0].shape[1]), dtype=np.uint32)
    shard_of = np.searchsorted(offsets, ids, side="right") - 1
    for shard in np.unique(shard_of):
        sel = shard_of == shard
        out[sel] = sigs[shard][ids[sel] - offsets[shard]]
    return out


def load_drops(work_dir: Path, shard: int) -> np.ndarray:
    """Stage 4: sorted positions of the shard's documents to drop."""
    path = drop_path(work_dir, shard)
    if not path.exists():
        raise DataError(f"{path}: missing MinHash decisions for shard {shard} (stage 3 did not finish)")
    return np.load(path)


def bands_for_worker(bands: int, worker: int, n_workers: int) -> list[int]:
    """The bands stage-2 worker `worker` of `n_workers` handles."""
    return list(range(worker, bands, n_workers))


def run_stages(shards: list[list[str]], config: MinHashConfig, work_dir: Path) -> list[np.ndarray]:
    """All four stages in this process (for tests and small jobs): per-shard drop positions."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    hasher = MinHasher(config)
    for shard, texts in enumerate(shards):
        write_signatures(texts, hasher, work_dir, shard)
    bands, rows = config.bands_rows()
    write_band_edges(work_dir, len(shards), list(range(bands)), rows)
    write_drops(work_dir, len(shards), bands, config.threshold, config.verify)
    return [load_drops(work_dir, shard) for shard in range(len(shards))]
