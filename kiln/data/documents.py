"""Documents and the file-format readers shared by `kiln train` (raw sources) and `kiln prep`.

One document type, `Doc(id, text, meta)`, and one reader per format:

    text     .txt .md .markdown .rst .text .py .html .htm     one document per file
    jsonl    .jsonl .ndjson .json.gz .json.zst                 one JSON object per line
    json     .json                                             one object, or an array of objects
    parquet  .parquet                                          one row per document (pyarrow)

Suffixes are matched case-insensitively; text and JSONL files may be gzip (`.gz`, stdlib `gzip`)
or zstd (`.zst`, the `zstandard` package) compressed. Nothing is lost silently: every record
that cannot be used goes to the caller's `reject(file, line, reason, detail, nbytes)` callback,
and records read before a damaged spot are kept. `kiln prep` turns rejects into rejects.jsonl;
`kiln train` (kiln/data/corpus.py) turns them into errors or a printed summary.

A truncated zstd stream does not raise in `zstandard`'s stream reader, so zstd is decompressed
here with `ZstdDecompressionObj` and the frame end is checked at end of input (`eof`); gzip's
own reader raises EOFError. Both are reported as reason `truncated`; undecodable bytes as `corrupt`.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from kiln.errors import DataError

NO_LIMIT = 1 << 40
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text", ".py", ".html", ".htm")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json.gz", ".json.zst")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".zst")
JSON_MAX_BYTES = 1 << 30  # a .json file is parsed whole; larger corpora belong in JSONL

# reject(file, line or None, reason, detail, bytes of the rejected record)
Reject = Callable[[str, "int | None", str, str, int], None]


@dataclass
class Doc:
    """One document. `id` is stable across runs (it decides the train/val split); `meta` is
    passed through untouched (url, source file, line, fields of the input record)."""

    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadOptions:
    text_field: str = "text"  # JSON/JSONL/Parquet: the field holding the document text
    id_field: str = ""  # field with a stable id; "" = file:line
    meta_fields: list[str] = field(default_factory=list)  # fields kept as metadata; [] = all others
    max_doc_bytes: int = NO_LIMIT  # larger documents are rejected (too_large)
    parquet_batch_rows: int = 1024


def supported_suffixes() -> tuple[str, ...]:
    return TEXT_SUFFIXES + JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


def file_format(path: str | Path, configured: str = "auto") -> str | None:
    """text | jsonl | json | parquet by (case-insensitive) suffix; None when not a document file."""
    if configured != "auto":
        return configured
    name = Path(path).name.lower()
    if name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + JSON_SUFFIXES):
        return "jsonl" if name.endswith(JSONL_SUFFIXES) else "parquet" if name.endswith(".parquet") else "json"
    base = name.removesuffix(".gz").removesuffix(".zst")
    if base.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if base.endswith(TEXT_SUFFIXES):
        return "text"
    return None


class DamagedStream(Exception):
    """A compressed stream ended early (`truncated`) or holds undecodable bytes (`corrupt`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class _ZstdReader(io.RawIOBase):
    """zstd frames -> bytes, raising DamagedStream when the input ends inside a frame.

    Input goes to the decompressor 4 KiB at a time: a zstd block (>= 4 bytes) expands to at most
    128 KiB, so one call never produces more than 128 MiB, however hostile the file. (Measured on
    12.6 MB of stdlib JSONL on a shared 2-core EPYC: 200-275 MB/s; `stream_reader` ~240 MB/s.)
    """

    def __init__(self, raw: BinaryIO):
        zstandard = _optional("zstandard", ".zst files")
        self._raw, self._zstd, self._error = raw, zstandard.ZstdDecompressor(), zstandard.ZstdError
        self._obj = self._zstd.decompressobj()
        self._in_frame = False
        self._pending, self._fed = b"", 0  # compressed bytes read, and how many went to the decoder
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._pos >= len(self._out):
            if self._fed >= len(self._pending):
                self._pending, self._fed = self._raw.read(1 << 16), 0
                if not self._pending:
                    if self._in_frame:
                        raise DamagedStream("truncated", "truncated zstd stream (it ends inside a frame)")
                    return 0
            data = self._pending[self._fed:self._fed + 4096]
            self._fed += len(data)
            out = []
            while data:
                self._in_frame = True
                try:
                    out.append(self._obj.decompress(data))
                except self._error as e:
                    raise DamagedStream("corrupt", f"corrupt zstd stream ({e})") from None
                if not self._obj.eof:
                    break
                data, self._in_frame = self._obj.unused_data, False  # the next frame, if any
                self._obj = self._zstd.decompressobj()
            self._out, self._pos = b"".join(out), 0
        n = min(len(buf), len(self._out) - self._pos)
        buf[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _optional(module: str, what: str) -> Any:
    """Import a package of the `prep` extra, or say in one line how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {module.split('.')[0]} package: "
                        f"pip install 'kiln-lm[prep]'") from None


def open_binary(path: Path) -> BinaryIO:
    """The decompressed bytes of a file (.gz/.zst by suffix, case-insensitive)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(open(path, "rb")), 1 << 16)  # type: ignore[return-value]
    return open(path, "rb")


def _damage(e: BaseException) -> DamagedStream:
    """What an exception of a decompressing reader means (gzip raises its own kinds)."""
    if isinstance(e, DamagedStream):
        return e
    if isinstance(e, EOFError):  # gzip: "Compressed file ended before the end-of-stream marker"
        return DamagedStream("truncated", f"truncated gzip stream ({e})")
    return DamagedStream("corrupt", f"corrupt gzip stream ({e})")  # zlib.error, BadGzipFile


def decode_text(data: bytes) -> tuple[str | None, str, str]:
    """(text, reason, detail); text None when the bytes are not usable UTF-8 text."""
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return None, "not_utf8", "UTF-16 (byte-order mark); expected UTF-8"
    if data[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark is not part of the text
        data = data[3:]
    if b"\x00" in data[:8192]:
        return None, "binary", "looks binary (NUL bytes in the first 8 KiB); expected UTF-8 text"
    try:
        return data.decode("utf-8"), "", ""
    except UnicodeDecodeError as e:
        return None, "not_utf8", f"not UTF-8 at byte {e.start}; expected UTF-8 text"


def read_file(path: Path, name: str, fmt: str, opts: ReadOptions, reject: Reject) -> Iterator[Doc]:
    """The documents of one file; `name` is what ids and rejects call it (e.g. a relative path)."""
    if fmt == "parquet":
        yield from _read_parquet(path, name, opts, reject)
        return
    count = [0]  # records yielded so far, for the damage report
    try:
        if fmt == "jsonl":
            yield from _read_jsonl(path, name, opts, reject, count)
        elif fmt == "json":
            yield from _read_json(path, name, opts, reject, count)
        else:
            yield from _read_text(path, name, opts, reject, count)
    except (DamagedStream, EOFError, zlib.error, gzip.BadGzipFile) as e:
        damage = _damage(e)
        reject(name, None, damage.reason, f"{damage} after {count[0]} records", 0)
    except OSError as e:  # the file itself cannot be read (permissions, vanished, an I/O error)
        reject(name, None, "unreadable", str(e.strerror or e), 0)


def _read_text(path: Path, name: str, opts: ReadOptions, reject: Reject, count: list[int]) -> Iterator[Doc]:
    compressed = path.name.lower().endswith(COMPRESSION_SUFFIXES)
    size = path.stat().st_size
    if not compressed and size > opts.max_doc_bytes:
        reject(name, None, "too_large", f"{size} bytes > max_doc_bytes={opts.max_doc_bytes}", size)
        return
    with open_binary(path) as f:
        data = f.read() if not compressed else _read_at_most(f, opts.max_doc_bytes + 1)
    if len(data) > opts.max_doc_bytes:
        reject(name, None, "too_large", f"more than max_doc_bytes={opts.max_doc_bytes} bytes", len(data))
        return
    text, reason, detail = decode_text(data)
    if text is None:
        reject(name, None, reason, detail, len(data))
    elif not text.strip():
        reject(name, None, "empty", "no text", len(data))
    else:
        count[0] += 1
        yield Doc(name, text, {"source": name})


def _read_at_most(f: BinaryIO, limit: int) -> bytes:
    """Up to `limit` bytes, in 1 MiB reads (`read(limit)` would allocate `limit` up front)."""
    chunks, n = [], 0
    while n < limit:
        chunk = f.read(min(1 << 20, limit - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


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


def _read_jsonl(path: Path, name: str, opts: ReadOptions, reject: Reject, count: list[int]) -> Iterator[Doc]:
    any_line = False
    with open_binary(path) as f:
        for lineno, (raw, size) in enumerate(_lines(f, opts.max_doc_bytes), 1):
            any_line = True
            if raw is not None and not raw.strip():
                continue
            if raw is None:
                reject(name, lineno, "too_large", f"line of {size} bytes > max_doc_bytes={opts.max_doc_bytes}", size)
                continue
            text, reason, detail = decode_text(raw)
            if text is None:
                reject(name, lineno, reason, detail, size)
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                reject(name, lineno, "bad_json", f"not valid JSON ({e}): {text[:200]}", size)
                continue
            doc = record_to_doc(row, name, lineno, opts, reject, size)
            if doc is not None:
                count[0] += 1
                yield doc
    if not any_line:
        reject(name, None, "empty", "empty file", 0)


def _read_json(path: Path, name: str, opts: ReadOptions, reject: Reject, count: list[int]) -> Iterator[Doc]:
    """A .json file: one object, or an array of objects (record i is 'line' i + 1); a file of
    several values one per line is read as JSONL."""
    with open_binary(path) as f:
        data = _read_at_most(f, JSON_MAX_BYTES + 1)
    size = len(data)
    if size > JSON_MAX_BYTES:
        reject(name, None, "too_large", f"a .json file over {JSON_MAX_BYTES} bytes (parsed whole); use JSONL", size)
        return
    text, reason, detail = decode_text(data)
    if text is None:
        reject(name, None, reason, detail, size)
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines under a .json name
            yield from _read_jsonl(path, name, opts, reject, count)
        else:
            reject(name, e.lineno, "bad_json", f"not valid JSON ({e})", size)
        return
    rows = value if isinstance(value, list) else [value]
    if not rows:
        reject(name, None, "empty", "an empty JSON array", size)
    for i, row in enumerate(rows, 1):
        nbytes = len(json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        doc = record_to_doc(row, name, i, opts, reject, nbytes)
        if doc is not None:
            count[0] += 1
            yield doc


def record_to_doc(row: Any, name: str, line: int, opts: ReadOptions, reject: Reject, size: int) -> Doc | None:
    if not isinstance(row, dict):
        reject(name, line, "not_object", f"expected a JSON object, got {type(row).__name__}", size)
        return None
    text = row.get(opts.text_field)
    if not isinstance(text, str):
        what = "missing" if text is None else f"a {type(text).__name__}, not a string"
        reject(name, line, "missing_text_field",
               f"expected an object with a string field {opts.text_field!r}; it is {what}; "
               f"fields: {sorted(row)[:20]}", size)
        return None
    if not text.strip():
        reject(name, line, "empty", f"field {opts.text_field!r} is empty", size)
        return None
    if "\x00" in text:
        reject(name, line, "binary", "NUL characters in the text", size)
        return None
    doc_id = row.get(opts.id_field) if opts.id_field else None
    doc_id = f"{name}:{line}" if doc_id is None else str(doc_id)
    skip = {opts.text_field, opts.id_field}
    names = opts.meta_fields or [k for k in row if k not in skip]
    meta = {k: row[k] for k in names if k in row}
    meta.setdefault("source", name)
    meta.setdefault("line", line)
    return Doc(doc_id, text, meta)


def _read_parquet(path: Path, name: str, opts: ReadOptions, reject: Reject) -> Iterator[Doc]:
    """Streams row batches with pyarrow (`ParquetFile.iter_batches`)."""
    pa = _optional("pyarrow", "Parquet files")
    pq = _optional("pyarrow.parquet", "Parquet files")

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        reject(name, None, "corrupt", f"not a readable Parquet file: {e}", 0)
        return
    names = pf.schema_arrow.names
    if opts.text_field not in names:
        reject(name, None, "missing_text_field", f"no column {opts.text_field!r}; columns: {names[:20]}", 0)
        return
    row_no = kept = 0
    try:
        for batch in pf.iter_batches(batch_size=opts.parquet_batch_rows):
            for row in batch.to_pylist():
                row_no += 1
                text = row.get(opts.text_field)
                size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
                if size > opts.max_doc_bytes:
                    reject(name, row_no, "too_large", f"{size} bytes > max_doc_bytes={opts.max_doc_bytes}", size)
                    continue
                doc = record_to_doc(row, name, row_no, opts, reject, size)
                if doc is not None:
                    kept += 1
                    yield doc
    except (pa.ArrowException, OSError) as e:
        reject(name, row_no + 1, "corrupt", f"corrupt Parquet data ({type(e).__name__}: {e}) after {kept} records", 0)
    if row_no == 0:
        reject(name, None, "empty", "no rows", 0)
