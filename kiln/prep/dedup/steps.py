"""The dedup methods as `kiln prep` pipeline steps (global steps: index -> prepare -> run).

Every step drops or edits documents with a specific reason: `dedup:exact`, `dedup:bloom`
(whole documents), `dedup:exact_paragraph`/`dedup:bloom_line`/... (all units were repeats),
`dedup:minhash`, `dedup:simhash`, `dedup:suffix_array` (nothing left after removing repeated
spans). Units/spans removed from documents that survive are counted under `modified`.
Stage-1 files are named by shard; a stage's output is written to a temporary name and renamed,
so an interrupted run never reads a half-written file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator

import numpy as np

from kiln.prep.base import Doc, GlobalStep, StepContext, register
from kiln.prep.dedup import minhash_stages
from kiln.prep.dedup.minhash_stages import save_atomic
from kiln.prep.dedup.bloom import BloomFilter
from kiln.prep.dedup.components import components_keep_lowest
from kiln.prep.dedup.exact import ExactConfig, first_occurrences, join_kept, split_hash, unit_hashes
from kiln.prep.dedup.lsh_params import format_s_curve, s_curve
from kiln.prep.dedup.minhash import MinHashConfig, MinHasher
from kiln.prep.dedup.simhash import SimHashConfig, fingerprints, identical_pairs, near_pairs, table_pairs
from kiln.prep.dedup.suffix_array import SEPARATOR, SuffixArrayConfig, duplicate_mask
from kiln.errors import ConfigError, DataError
from kiln.io import atomic_file, atomic_write_json
from kiln.prep.dedup.sharded_components import sharded_duplicates


def _work_dir(ctx: StepContext, step: str) -> Path:
    if ctx.work_dir is None:
        raise ConfigError(f"step {step!r} is a global dedup step and needs a work directory")
    Path(ctx.work_dir).mkdir(parents=True, exist_ok=True)
    return Path(ctx.work_dir)


def _load(path: Path, what: str) -> np.ndarray:
    if not path.exists():
        raise DataError(f"{path}: missing {what} (an earlier dedup stage did not finish)")
    return np.load(path)


def _batches(docs: Iterator[Doc], max_bytes: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc.text)
        size += len(doc.text)
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _DropListStep(GlobalStep):
    """A global step whose `prepare` decides, per shard, the positions of documents to drop."""

    reason: ClassVar[str] = ""

    def setup(self, ctx: StepContext) -> None:
        self._drops = set(minhash_stages.load_drops(_work_dir(ctx, self.name), ctx.shard_index).tolist())

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        for position, doc in enumerate(docs):
            if position in self._drops:
                ctx.drop(self.name, doc, self.reason)
            else:
                yield doc

    def _write_drops(self, work_dir: Path, dup: np.ndarray, counts: list[int]) -> None:
        offsets = np.r_[0, np.cumsum(counts)]
        for shard in range(len(counts)):
            save_atomic(minhash_stages.drop_path(work_dir, shard), np.flatnonzero(dup[offsets[shard]:offsets[shard + 1]]))


# ---------------------------------------------------------------------------- exact / bloom


@dataclass
class ExactDedupConfig(ExactConfig):
    filter: str = "exact"  # exact: sorted 128-bit hashes | bloom: fixed-memory Bloom filter
    capacity: int = 0  # bloom: expected distinct units; 0 = the number of units indexed
    fp_rate: float = 0.001  # bloom: false-positive rate (unique units wrongly dropped)

    def validate(self, where: str = "dedup_exact") -> None:
        super().validate(where)
        if self.filter not in ("exact", "bloom"):
            raise ConfigError(f"{where}.filter={self.filter!r} is not one of exact, bloom")
        if self.capacity < 0 or not 0.0 < self.fp_rate < 1.0:
            raise ConfigError(f"{where}: capacity={self.capacity} must be >= 0 and fp_rate={self.fp_rate} in (0, 1)")


@register
class ExactDedup(GlobalStep):
    """Drop documents (or remove paragraphs/lines) whose normalized content appeared before."""

    type = "dedup_exact"
    Config = ExactDedupConfig
    # per unit in `prepare`: the 16-byte hash, the sort order (8) and sorted copies (16)
    state_bytes_per_doc = 40

    def __init__(self, config: ExactDedupConfig | None = None, name: str | None = None):
        super().__init__(config, name)
        self.config.validate(f"step {self.name!r}")

    def _hash_path(self, work_dir: Path, shard: int) -> Path:
        return work_dir / f"hashes-{shard:05d}.npy"

    def _keep_path(self, work_dir: Path, shard: int) -> Path:
        return work_dir / f"keep-{shard:05d}.npy"

    def index(self, docs: Iterator[Doc], ctx: StepContext) -> None:
        self.config.validate(f"step {self.name!r}")  # again: --set may have edited the config
        halves: list[tuple[int, int]] = []
        for doc in docs:
            _, hashes = unit_hashes(doc.text, self.config)
            halves += [split_hash(h) for h in hashes if h is not None]
        array = np.array(halves, dtype=np.uint64).reshape(-1, 2)
        save_atomic(self._hash_path(_work_dir(ctx, self.name), ctx.shard_index), array)

    def prepare(self, ctx: StepContext, n_shards: int) -> None:
        work_dir = _work_dir(ctx, self.name)
        shards = [_load(self._hash_path(work_dir, s), f"unit hashes of shard {s}") for s in range(n_shards)]
        total = sum(len(s) for s in shards)
        if self.config.filter == "exact":
            everything = np.concatenate(shards) if total else np.zeros((0, 2), np.uint64)
            first = first_occurrences(everything[:, 0], everything[:, 1])
            offsets = np.r_[0, np.cumsum([len(s) for s in shards])]
            keeps = [first[offsets[s]:offsets[s + 1]] for s in range(n_shards)]
        else:  # one streaming pass in shard order: memory is the filter, not the corpus
            bloom = BloomFilter(self.config.capacity or max(total, 1), self.config.fp_rate)
            keeps = [bloom.add_new(s[:, 0], s[:, 1]) for s in shards]
            ctx.note(self.name, "bloom_bytes", bloom.nbytes)
        for shard, keep in enumerate(keeps):
            save_atomic(self._keep_path(work_dir, shard), keep)
        ctx.note(self.name, "units_indexed", total)
        ctx.note(self.name, "units_repeated", int(sum((~k).sum() for k in keeps)))

    def setup(self, ctx: StepContext) -> None:
        self._keep = _load(self._keep_path(_work_dir(ctx, self.name), ctx.shard_index), "dedup decisions").tolist()

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        flags = iter(self._keep)
        unit = self.config.unit
        reason = f"dedup:{self.config.filter}" + ("" if unit == "document" else f"_{unit}")
        for doc in docs:
            pieces, hashes = unit_hashes(doc.text, self.config)
            keep = [True if h is None else next(flags) for h in hashes[::2]]
            removed = keep.count(False)
            if removed == 0:
                yield doc
            elif unit == "document":
                ctx.drop(self.name, doc, reason)
            else:
                text = join_kept(pieces, keep)
                if not text.strip():
                    ctx.drop(self.name, doc, reason)
                    continue
                ctx.modified(self.name, reason, removed)
                ctx.doc_modified(self.name)
                yield Doc(doc.id, text, doc.meta)


# ---------------------------------------------------------------------------- MinHash-LSH


@register
class MinHashDedup(_DropListStep):
    """Drop near-duplicates: MinHash-LSH clusters, the lowest global id of each kept."""

    type = "dedup_minhash"
    Config = MinHashConfig
    reason = "dedup:minhash"
    state_bytes_per_doc = minhash_stages.BYTES_PER_DOC_GLOBAL

    def __init__(self, config: MinHashConfig | None = None, name: str | None = None):
        super().__init__(config, name)
        self.config.validate(f"step {self.name!r}")

    def index(self, docs: Iterator[Doc], ctx: StepContext) -> None:
        self.config.validate(f"step {self.name!r}")  # again: --set may have edited the config
        hasher = MinHasher(self.config)
        texts = [doc.text for doc in docs]  # one shard's text; hashed in batch_bytes batches
        minhash_stages.write_signatures(texts, hasher, _work_dir(ctx, self.name), ctx.shard_index)

    def prepare_parts(self, n_shards: int) -> int:
        return self.config.bands_rows()[0]  # LSH bands are independent: one task each

    def prepare_part(self, ctx: StepContext, n_shards: int, part: int, n_parts: int) -> None:
        bands, rows = self.config.bands_rows()
        band_group = minhash_stages.bands_for_worker(bands, part, n_parts)
        work_dir = _work_dir(ctx, self.name)
        minhash_stages.write_band_edges(work_dir, n_shards, band_group, rows)
        if self.config.cluster_parts:  # verify here too, so that verification is parallel as well
            for band in band_group:
                counts = minhash_stages.write_verified_band(work_dir, n_shards, band, self.config.threshold,
                                                            self.config.verify)
                atomic_write_json(work_dir / f"verified-band{band:04d}.json", counts)

    def prepare_sharded(self, ctx: StepContext, n_shards: int, map_fn) -> None:
        """Sharded connected components over the verified band edges, each phase's tasks run by
        `map_fn` (the executor's runner.map); writes the drop files and `clusters.json`."""
        if not self.config.cluster_parts:
            return
        work_dir = _work_dir(ctx, self.name)
        bands, rows = self.config.bands_rows()
        counts = {"band_candidate_pairs": 0, "band_verified_pairs": 0}
        for band in range(bands):  # bands no prepare_part task finished, one at a time
            if not minhash_stages.edges_path(work_dir, band).exists():
                minhash_stages.write_band_edges(work_dir, n_shards, [band], rows)
            marker = work_dir / f"verified-band{band:04d}.json"
            if not (marker.exists() and minhash_stages.verified_path(work_dir, band).exists()):
                atomic_write_json(marker, minhash_stages.write_verified_band(
                    work_dir, n_shards, band, self.config.threshold, self.config.verify))
            for key, value in json.loads(marker.read_text(encoding="utf-8")).items():
                counts[key] += value
        _, offsets = minhash_stages._open_signatures(work_dir, n_shards)
        files = [minhash_stages.verified_path(work_dir, b) for b in range(bands)]
        dup, info = sharded_duplicates(int(offsets[-1]), files, work_dir / "components",
                                       self.config.cluster_parts, map_fn)
        minhash_stages.write_drop_ids(work_dir, n_shards, dup)
        atomic_write_json(work_dir / "clusters.json", {**counts, "clusters_dropped": int(len(dup)),
                                                       "component_rounds": info["rounds"]})

    def prepare(self, ctx: StepContext, n_shards: int) -> None:
        work_dir = _work_dir(ctx, self.name)
        bands, rows = self.config.bands_rows()
        if self.config.cluster_parts:
            if not (work_dir / "clusters.json").exists():  # not run by the executor: run it here
                self.prepare_sharded(ctx, n_shards, lambda fn, args: [fn(*a) for a in args])
            counts = json.loads((work_dir / "clusters.json").read_text(encoding="utf-8"))
        else:
            # Bands the executor did not already write in parallel (prepare_part), one at a time.
            missing = [b for b in range(bands) if not minhash_stages.edges_path(work_dir, b).exists()]
            minhash_stages.write_band_edges(work_dir, n_shards, missing, rows)
            counts = minhash_stages.write_drops(work_dir, n_shards, bands, self.config.threshold, self.config.verify)
        (work_dir / "s_curve.txt").write_text(format_s_curve(bands, rows, self.config.threshold) + "\n")
        for key, value in counts.items():
            ctx.note(self.name, key, value)
        # the LSH S-curve in the report: P(candidate) at Jaccard 0.50 .. 1.00
        ctx.note(self.name, "lsh_bands", bands)
        ctx.note(self.name, "lsh_rows", rows)
        for similarity, probability in s_curve(bands, rows):
            ctx.note(self.name, f"p_candidate@{similarity:.2f}", round(probability, 4))


# ---------------------------------------------------------------------------- SimHash


@register
class SimHashDedup(_DropListStep):
    """Drop near-duplicates whose 64-bit SimHash is within max_distance bits of another's."""

    type = "dedup_simhash"
    Config = SimHashConfig
    reason = "dedup:simhash"
    state_bytes_per_doc = 8 + 16  # fingerprint + (key, id) of the table being scanned

    def __init__(self, config: SimHashConfig | None = None, name: str | None = None):
        super().__init__(config, name)
        self.config.validate(f"step {self.name!r}")

    def index(self, docs: Iterator[Doc], ctx: StepContext) -> None:
        self.config.validate(f"step {self.name!r}")  # again: --set may have edited the config
        parts = [fingerprints(batch, self.config) for batch in _batches(docs, self.config.batch_bytes)]
        fps = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        save_atomic(_work_dir(ctx, self.name) / f"simhash-{ctx.shard_index:05d}.npy", fps)

    def _fingerprints(self, work_dir: Path, n_shards: int) -> tuple[np.ndarray, list[int]]:
        shards = [_load(work_dir / f"simhash-{s:05d}.npy", f"SimHash fingerprints of shard {s}") for s in range(n_shards)]
        return (np.concatenate(shards) if shards else np.zeros(0, np.uint64)), [len(s) for s in shards]

    def prepare_parts(self, n_shards: int) -> int:
        # sharded clustering only: one task per block table, one for identical fingerprints
        return self.config.max_distance + 2 if self.config.cluster_parts else 0

    def _edges_path(self, work_dir: Path, part: int) -> Path:
        return work_dir / f"simhash-edges-k{self.config.max_distance:02d}-{part:03d}.npy"

    def _write_edges(self, work_dir: Path, fps: np.ndarray, part: int) -> None:
        k = self.config.max_distance
        u, v = identical_pairs(fps) if part == k + 1 else table_pairs(fps, k, part)
        save_atomic(self._edges_path(work_dir, part), np.stack([u, v]))

    def prepare_part(self, ctx: StepContext, n_shards: int, part: int, n_parts: int) -> None:
        work_dir = _work_dir(ctx, self.name)
        self._write_edges(work_dir, self._fingerprints(work_dir, n_shards)[0], part)

    def prepare_sharded(self, ctx: StepContext, n_shards: int, map_fn) -> None:
        """Sharded connected components over the per-table pair files, each phase's tasks run by
        `map_fn` (the executor's runner.map); writes the drop files and `clusters.json`."""
        if not self.config.cluster_parts:
            return
        work_dir = _work_dir(ctx, self.name)
        fps, counts = self._fingerprints(work_dir, n_shards)
        files = []
        for part in range(self.prepare_parts(n_shards)):  # tables no prepare_part task finished
            if not self._edges_path(work_dir, part).exists():
                self._write_edges(work_dir, fps, part)
            files.append(self._edges_path(work_dir, part))
        dup, info = sharded_duplicates(len(fps), files, work_dir / "components", self.config.cluster_parts, map_fn)
        mask = np.zeros(len(fps), dtype=bool)
        mask[dup] = True
        self._write_drops(work_dir, mask, counts)
        # pairs summed over the tables (a pair sharing several blocks counts in each); files checked above
        table_pairs_found = sum(int(np.load(f, mmap_mode="r", allow_pickle=False).shape[1]) for f in files)
        atomic_write_json(work_dir / "clusters.json", {"table_pairs": table_pairs_found, "clusters_dropped": int(len(dup)),
                                                       "component_rounds": info["rounds"]})

    def prepare(self, ctx: StepContext, n_shards: int) -> None:
        work_dir = _work_dir(ctx, self.name)
        if self.config.cluster_parts:
            if not (work_dir / "clusters.json").exists():  # not run by the executor: run it here
                self.prepare_sharded(ctx, n_shards, lambda fn, args: [fn(*a) for a in args])
            for key, value in json.loads((work_dir / "clusters.json").read_text(encoding="utf-8")).items():
                ctx.note(self.name, key, value)
            return
        fps, counts = self._fingerprints(work_dir, n_shards)
        u, v = near_pairs(fps, self.config.max_distance)
        dup = ~components_keep_lowest(len(fps), u, v)
        self._write_drops(work_dir, dup, counts)
        ctx.note(self.name, "near_pairs", len(u))
        ctx.note(self.name, "clusters_dropped", int(dup.sum()))


# ---------------------------------------------------------------------------- suffix array


@register
class SuffixArrayDedup(GlobalStep):
    """Remove byte spans of >= min_length repeated anywhere in the corpus (Lee et al. 2021)."""

    type = "dedup_suffix_array"
    Config = SuffixArrayConfig
    reason = "dedup:suffix_array"
    state_bytes_per_doc = 0  # memory scales with corpus bytes (~10-14 B per byte), not documents

    def __init__(self, config: SuffixArrayConfig | None = None, name: str | None = None):
        super().__init__(config, name)
        self.config.validate(f"step {self.name!r}")

    def index(self, docs: Iterator[Doc], ctx: StepContext) -> None:
        self.config.validate(f"step {self.name!r}")  # again: --set may have edited the config
        work_dir = _work_dir(ctx, self.name)
        lengths = []
        with atomic_file(work_dir / f"text-{ctx.shard_index:05d}.bin", "wb") as f:
            for doc in docs:
                data = doc.text.encode("utf-8", errors="surrogatepass")
                f.write(data)
                f.write(bytes([SEPARATOR]))
                lengths.append(len(data))
        save_atomic(work_dir / f"lengths-{ctx.shard_index:05d}.npy", np.array(lengths, dtype=np.int64))

    def prepare(self, ctx: StepContext, n_shards: int) -> None:
        work_dir = _work_dir(ctx, self.name)
        paths = [work_dir / f"text-{s:05d}.bin" for s in range(n_shards)]
        for path in paths:
            if not path.exists():
                raise DataError(f"{path}: missing text of a shard (stage 1 did not finish)")
        sizes = [p.stat().st_size for p in paths]
        corpus = np.empty(sum(sizes), dtype=np.uint8)
        pos = 0
        for path, size in zip(paths, sizes):
            with open(path, "rb") as f:
                f.readinto(memoryview(corpus[pos:pos + size]))
            pos += size
        mask = duplicate_mask(corpus, self.config)
        pos = 0
        for shard, size in enumerate(sizes):
            save_atomic(work_dir / f"removed-{shard:05d}.npy", np.packbits(mask[pos:pos + size]))
            pos += size
        ctx.note(self.name, "corpus_bytes", int(len(corpus)))
        ctx.note(self.name, "removed_bytes", int(mask.sum()))

    def setup(self, ctx: StepContext) -> None:
        work_dir = _work_dir(ctx, self.name)
        lengths = _load(work_dir / f"lengths-{ctx.shard_index:05d}.npy", "document lengths")
        packed = _load(work_dir / f"removed-{ctx.shard_index:05d}.npy", "removed spans")
        self._mask = np.unpackbits(packed, count=int(lengths.sum() + len(lengths))).astype(bool)
        self._starts = (np.r_[0, np.cumsum(lengths + 1)][:-1]).tolist()

    def run(self, docs: Iterator[Doc], ctx: StepContext) -> Iterator[Doc]:
        for position, doc in enumerate(docs):
            data = doc.text.encode("utf-8", errors="surrogatepass")
            start = self._starts[position]
            doc_mask = self._mask[start:start + len(data)]
            removed = int(doc_mask.sum())
            if removed == 0:
                yield doc
                continue
            text = np.frombuffer(data, dtype=np.uint8)[~doc_mask].tobytes().decode("utf-8", errors="surrogatepass")
            if not text.strip():
                ctx.drop(self.name, doc, self.reason)
                continue
            ctx.modified(self.name, "dedup:suffix_array_bytes", removed)
            ctx.doc_modified(self.name)
            yield Doc(doc.id, text, doc.meta)
