"""Readers: input files -> `Doc`s, streaming, with every unusable record rejected and counted.

The formats themselves (text, JSONL plain/.gz/.zst, JSON, Parquet; case-insensitive suffixes) are
read by kiln/data/documents.py, the readers `kiln train` uses too. This module adds what only
`kiln prep` needs: input shards and the accounting of the `read` pseudo-step.

Input shards are units of parallel work: each JSONL/JSON/Parquet file is one shard; plain-text
files (one document per file) are grouped `text_files_per_shard` to a shard. Reading never holds
more than one record (one JSONL line up to `max_doc_bytes`, one Parquet batch) in memory, except
for a .json file, which is one JSON value.

A rejected record (bad JSON, not UTF-8, binary, missing text field, too large, empty, truncated or
corrupt compressed stream) never stops the run: it is passed to `reject(file, line, reason,
detail)` and counted under the pseudo-step `read` with reason `read:<reason>`. Records read before
a damaged spot of a compressed file are kept; the reject says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kiln.data.documents import ReadOptions, file_format, read_file, supported_suffixes
from kiln.prep.base import Doc, StepContext, text_bytes
from kiln.errors import ConfigError, DataError

READ_STEP = "read"

Reject = Callable[[str, int | None, str, str], None]


@dataclass
class ReaderConfig:
    path: str = ""  # a file or a directory of input files
    format: str = "auto"  # auto (by suffix, any case) | jsonl | json | parquet | text
    glob: str = "**/*"  # which files of a directory to read
    text_field: str = "text"  # JSONL/Parquet: the field holding the document text
    id_field: str = ""  # JSONL/Parquet: field with a stable id; "" = file:line
    meta_fields: list[str] = field(default_factory=list)  # fields kept as metadata; [] = all others
    max_doc_bytes: int = 10_000_000  # larger documents are rejected (read:too_large)
    text_files_per_shard: int = 256  # plain-text files grouped into one shard
    parquet_batch_rows: int = 1024

    def validate(self, source: str = "[input]") -> None:
        if not self.path:
            raise ConfigError(f"{source}: input.path is required (a file or directory of documents)")
        if self.format not in ("auto", "jsonl", "json", "parquet", "text"):
            raise ConfigError(f"{source}: input.format={self.format!r} is not one of auto, jsonl, json, parquet, text")
        if self.max_doc_bytes <= 0 or self.text_files_per_shard <= 0 or self.parquet_batch_rows <= 0:
            raise ConfigError(f"{source}: input.max_doc_bytes, text_files_per_shard, parquet_batch_rows must be > 0")

    def read_options(self) -> ReadOptions:
        return ReadOptions(self.text_field, self.id_field, self.meta_fields, self.max_doc_bytes,
                           self.parquet_batch_rows)


@dataclass
class InputShard:
    """One unit of work: its files (several only for plain text) and the root ids are relative to."""

    index: int
    files: list[str]
    root: str
    format: str

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"


def list_shards(cfg: ReaderConfig) -> list[InputShard]:
    """The input shards in a deterministic order (sorted paths)."""
    root = Path(cfg.path)
    if root.is_file():
        files, base = [root], root.parent
    elif root.is_dir():
        files, base = sorted(p for p in root.glob(cfg.glob) if p.is_file()), root
    else:
        raise DataError(f"input.path {cfg.path!r} not found; expected a file or a directory of documents")
    shards: list[InputShard] = []
    text_group: list[str] = []
    for path in files:
        fmt = file_format(path, cfg.format)
        if fmt is None:
            continue
        if fmt == "text":
            text_group.append(str(path))
            if len(text_group) == cfg.text_files_per_shard:
                shards.append(InputShard(len(shards), text_group, str(base), "text"))
                text_group = []
        else:
            shards.append(InputShard(len(shards), [str(path)], str(base), fmt))
    if text_group:
        shards.append(InputShard(len(shards), text_group, str(base), "text"))
    if not shards:
        raise DataError(f"input.path {cfg.path!r}: no input files matching {cfg.glob!r} "
                        f"(expected, any case: {' '.join(supported_suffixes())}; text/JSONL also .gz/.zst)")
    return shards


class _Counter:
    """Counts the `read` pseudo-step and forwards rejects (as `read:<reason>`)."""

    def __init__(self, ctx: StepContext, reject: Reject):
        self.stats = ctx.step_stats(READ_STEP)
        self.ctx, self.reject_fn = ctx, reject

    # bytes_in = bytes_kept (UTF-8 text of kept documents) + dropped bytes (raw size of rejected
    # records), so the funnel does not show JSON quoting overhead as a loss.
    def reject(self, file: str, line: int | None, reason: str, detail: str, nbytes: int) -> None:
        self.stats["docs_in"] += 1
        self.stats["bytes_in"] += nbytes
        key = f"read:{reason}"
        self.stats["dropped"][key] = self.stats["dropped"].get(key, 0) + 1
        self.stats["dropped_bytes"][key] = self.stats["dropped_bytes"].get(key, 0) + nbytes
        examples = self.stats["examples"].setdefault(key, [])
        where = f"{file}:{line}" if line is not None else file
        if len(examples) < self.ctx.max_examples:
            examples.append({"id": where, "text": detail[: self.ctx.example_chars]})
        self.reject_fn(file, line, key, detail)

    def kept(self, doc: Doc) -> Doc:
        nbytes = text_bytes(doc.text)
        self.stats["docs_in"] += 1
        self.stats["docs_kept"] += 1
        self.stats["bytes_kept"] += nbytes
        self.stats["bytes_in"] += nbytes
        return doc


def read_shard(shard: InputShard, cfg: ReaderConfig, ctx: StepContext, reject: Reject) -> Iterator[Doc]:
    counter = _Counter(ctx, reject)
    opts = cfg.read_options()
    for file in shard.files:
        for doc in read_file(Path(file), _relative(file, shard.root), shard.format, opts, counter.reject):
            yield counter.kept(doc)


def _relative(file: str, root: str) -> str:
    try:
        return str(Path(file).relative_to(root))
    except ValueError:
        return str(file)
