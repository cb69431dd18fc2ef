"""Readers: input files -> `Doc`s, streaming, with every unusable record rejected and counted.

Input shards are units of parallel work: each JSONL/Parquet file is one shard; plain-text files
(one document per file) are grouped `text_files_per_shard` to a shard. Reading never holds more
than one record (one JSONL line up to `max_doc_bytes`, one Parquet batch) in memory.

A rejected record (bad JSON, not UTF-8, binary, missing text field, too large, empty, corrupt
compressed stream) never stops the run: it is passed to `reject(file, line, reason, detail)` and
counted under the pseudo-step `read` with reason `read:<reason>`.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from kiln.prep.base import Doc, StepContext, text_bytes
from kiln.errors import ConfigError, DataError

READ_STEP = "read"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".py", ".html", ".htm")

Reject = Callable[[str, int | None, str, str], None]


@dataclass
class ReaderConfig:
    path: str = ""  # a file or a directory of input files
    format: str = "auto"  # auto (by suffix) | jsonl | parquet | text
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
        if self.format not in ("auto", "jsonl", "parquet", "text"):
            raise ConfigError(f"{source}: input.format={self.format!r} is not one of auto, jsonl, parquet, text")
        if self.max_doc_bytes <= 0 or self.text_files_per_shard <= 0 or self.parquet_batch_rows <= 0:
            raise ConfigError(f"{source}: input.max_doc_bytes, text_files_per_shard, parquet_batch_rows must be > 0")


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


def file_format(path: Path, configured: str) -> str | None:
    if configured != "auto":
        return configured
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


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
                        f"(expected {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES)})")
    return shards


class _Counter:
    """Counts the `read` pseudo-step and forwards rejects."""

    def __init__(self, ctx: StepContext, reject: Reject):
        self.stats = ctx.step_stats(READ_STEP)
        self.ctx, self.reject_fn = ctx, reject

    # bytes_in = bytes_kept (UTF-8 text of kept documents) + dropped bytes (raw size of rejected
    # records), so the funnel does not show JSON quoting overhead as a loss.
    def seen(self, nbytes: int) -> None:
        self.stats["docs_in"] += 1

    def reject(self, file: str, line: int | None, reason: str, detail: str, nbytes: int) -> None:
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
        self.stats["docs_kept"] += 1
        self.stats["bytes_kept"] += nbytes
        self.stats["bytes_in"] += nbytes
        return doc


def read_shard(shard: InputShard, cfg: ReaderConfig, ctx: StepContext, reject: Reject) -> Iterator[Doc]:
    counter = _Counter(ctx, reject)
    for file in shard.files:
        rel = _relative(file, shard.root)
        if shard.format == "jsonl":
            yield from _read_jsonl(Path(file), rel, cfg, counter)
        elif shard.format == "parquet":
            yield from _read_parquet(Path(file), rel, cfg, counter)
        else:
            yield from _read_text_file(Path(file), rel, cfg, counter)


def _relative(file: str, root: str) -> str:
    try:
        return str(Path(file).relative_to(root))
    except ValueError:
        return str(file)


def _decode(data: bytes) -> tuple[str | None, str, str]:
    """(text, reason, detail); text None when the bytes are not usable UTF-8 text."""
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return None, "not_utf8", "UTF-16 (byte-order mark); expected UTF-8"
    if data[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark is not part of the text
        data = data[3:]
    if b"\x00" in data[:8192]:
        return None, "binary", "NUL bytes in the first 8 KiB"
    try:
        return data.decode("utf-8"), "", ""
    except UnicodeDecodeError as e:
        return None, "not_utf8", f"invalid UTF-8 at byte {e.start}"


def _read_text_file(path: Path, rel: str, cfg: ReaderConfig, counter: _Counter) -> Iterator[Doc]:
    try:
        size = path.stat().st_size
        counter.seen(size)
        if size > cfg.max_doc_bytes:
            counter.reject(rel, None, "too_large", f"{size} bytes > input.max_doc_bytes={cfg.max_doc_bytes}", size)
            return
        data = path.read_bytes()
    except OSError as e:
        counter.reject(rel, None, "unreadable", str(e.strerror), 0)
        return
    text, reason, detail = _decode(data)
    if text is None:
        counter.reject(rel, None, reason, detail, size)
    elif not text.strip():
        counter.reject(rel, None, "empty", "no text", size)
    else:
        yield counter.kept(Doc(rel, text, {"source": rel}))


def _open_binary(path: Path) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) pairs; line is None for a line longer than `limit`, skipped without reading it whole."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            size = len(line)
            while True:  # drain the rest of the over-long line in bounded chunks
                chunk = f.readline(1 << 20)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield None, size
        else:
            yield line, len(line)


def _read_jsonl(path: Path, rel: str, cfg: ReaderConfig, counter: _Counter) -> Iterator[Doc]:
    lineno = 0
    any_line = False
    try:
        with _open_binary(path) as f:
            for lineno, (raw, size) in enumerate(_lines(f, cfg.max_doc_bytes), 1):
                any_line = True
                if raw is not None and not raw.strip():
                    continue
                counter.seen(size)
                if raw is None:
                    counter.reject(rel, lineno, "too_large", f"line of {size} bytes > input.max_doc_bytes", size)
                    continue
                text, reason, detail = _decode(raw)
                if text is None:
                    counter.reject(rel, lineno, reason, detail, size)
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    counter.reject(rel, lineno, "bad_json", f"{e}: {text[:200]}", size)
                    continue
                doc = _record_to_doc(row, rel, lineno, cfg, counter, size)
                if doc is not None:
                    yield counter.kept(doc)
    except (OSError, EOFError, ValueError) as e:  # gzip/zstd corruption or truncation
        counter.seen(0)
        counter.reject(rel, lineno + 1, "corrupt_file", f"{type(e).__name__}: {e}", 0)
        return
    except Exception as e:  # zstandard raises its own ZstdError (not an OSError)
        if type(e).__name__ != "ZstdError":
            raise
        counter.seen(0)
        counter.reject(rel, lineno + 1, "corrupt_file", f"ZstdError: {e}", 0)
        return
    if not any_line:
        counter.seen(0)
        counter.reject(rel, None, "empty", "empty file", 0)


def _record_to_doc(row: Any, rel: str, line: int, cfg: ReaderConfig, counter: _Counter, size: int) -> Doc | None:
    if not isinstance(row, dict):
        counter.reject(rel, line, "not_object", f"expected a JSON object, got {type(row).__name__}", size)
        return None
    text = row.get(cfg.text_field)
    if not isinstance(text, str):
        what = "missing" if text is None else f"a {type(text).__name__}, not a string"
        counter.reject(rel, line, "missing_text_field",
                       f"field {cfg.text_field!r} is {what}; fields: {sorted(row)[:20]}", size)
        return None
    if not text.strip():
        counter.reject(rel, line, "empty", f"field {cfg.text_field!r} is empty", size)
        return None
    if "\x00" in text:
        counter.reject(rel, line, "binary", "NUL characters in the text", size)
        return None
    doc_id = row.get(cfg.id_field) if cfg.id_field else None
    doc_id = f"{rel}:{line}" if doc_id is None else str(doc_id)
    skip = {cfg.text_field, cfg.id_field}
    names = cfg.meta_fields or [k for k in row if k not in skip]
    meta = {k: row[k] for k in names if k in row}
    meta.setdefault("source", rel)
    meta.setdefault("line", line)
    return Doc(doc_id, text, meta)


def _read_parquet(path: Path, rel: str, cfg: ReaderConfig, counter: _Counter) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        counter.seen(0)
        counter.reject(rel, None, "corrupt_file", f"not a readable Parquet file: {e}", 0)
        return
    names = pf.schema_arrow.names
    if cfg.text_field not in names:
        counter.seen(0)
        counter.reject(rel, None, "missing_text_field", f"no column {cfg.text_field!r}; columns: {names[:20]}", 0)
        return
    row_no = 0
    try:
        for batch in pf.iter_batches(batch_size=cfg.parquet_batch_rows):
            for row in batch.to_pylist():
                row_no += 1
                text = row.get(cfg.text_field)
                size = text_bytes(text) if isinstance(text, str) else 0
                counter.seen(size)
                if size > cfg.max_doc_bytes:
                    counter.reject(rel, row_no, "too_large", f"{size} bytes > input.max_doc_bytes", size)
                    continue
                doc = _record_to_doc(row, rel, row_no, cfg, counter, size)
                if doc is not None:
                    yield counter.kept(doc)
    except (pa.ArrowException, OSError) as e:
        counter.seen(0)
        counter.reject(rel, row_no + 1, "corrupt_file", f"{type(e).__name__}: {e}", 0)
    if row_no == 0:
        counter.seen(0)
        counter.reject(rel, None, "empty", "no rows", 0)
