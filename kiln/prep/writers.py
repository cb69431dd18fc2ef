"""Writers: kept documents to JSONL(.zst)/Parquet, and kept documents to kiln token shards.

Every file is written under a temporary name and renamed when complete (`kiln.io.AtomicFile`),
so a killed run leaves either a whole file or none. Documents are stored as `{"id", "text", "meta"}` records; the
executor also uses this format for the documents it stores between the stages of global steps.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from kiln.data.corpus import is_val
from kiln.prep.base import Doc
from kiln.data.shards import DEFAULT_SHARD_TOKENS, ShardInfo, ShardWriter, write_meta, write_token_shards
from kiln.data.tokenizer import Tokenizer
from kiln.errors import DataError
from kiln.io import AtomicFile

DOC_FORMATS = ("jsonl", "jsonl.zst", "parquet")


def doc_suffix(fmt: str) -> str:
    return "." + fmt


class DocWriter:
    """Streams documents to one file (JSONL, zstd-compressed JSONL or Parquet), atomically."""

    def __init__(self, path: str | Path, fmt: str = "jsonl.zst", parquet_rows: int = 2048):
        if fmt not in DOC_FORMATS:
            raise DataError(f"document format {fmt!r} is not one of {', '.join(DOC_FORMATS)}")
        self.path = Path(path)
        self.fmt, self.count = fmt, 0
        self._rows: list[dict[str, Any]] = []
        self._parquet_rows = parquet_rows
        self._pq_writer = None
        self._file = AtomicFile(self.path, "wb")
        self._raw = self._file.file
        self._zst = None
        if fmt == "jsonl.zst":
            import zstandard

            self._zst = zstandard.ZstdCompressor(level=3).stream_writer(self._raw, closefd=False)
        self._out = self._zst or self._raw

    def write(self, doc: Doc) -> None:
        self.count += 1
        if self.fmt == "parquet":
            self._rows.append({"id": doc.id, "text": doc.text, "meta": json.dumps(doc.meta, default=str)})
            if len(self._rows) >= self._parquet_rows:
                self._flush_parquet()
            return
        record = {"id": doc.id, "text": doc.text, "meta": doc.meta}
        self._out.write(json.dumps(record, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass") + b"\n")

    def _flush_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self._rows, schema=pa.schema(
            [("id", pa.string()), ("text", pa.string()), ("meta", pa.string())]))
        if self._pq_writer is None:
            self._pq_writer = pq.ParquetWriter(self._raw, table.schema, compression="zstd")
        self._pq_writer.write_table(table)
        self._rows = []

    def close(self) -> Path:
        """Finish the file and move it into place; returns its path."""
        if self.fmt == "parquet":
            if self._rows or self._pq_writer is None:
                self._flush_parquet()
            self._pq_writer.close()
        if self._zst is not None:
            self._zst.close()  # closefd=False: ends the zstd frame, leaves the file open
        return self._file.commit()

    def abort(self) -> None:
        """Discard the partial file; the target path is left as it was."""
        self._file.abort()


def read_docs(path: str | Path) -> Iterator[Doc]:
    """Documents written by `DocWriter`, in order."""
    path = Path(path)
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
            for row in batch.to_pylist():
                yield Doc(row["id"], row["text"], json.loads(row["meta"]))
        return
    raw = open(path, "rb")
    if path.name.endswith(".zst"):
        import zstandard

        f: Any = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    else:
        f = raw
    with f:
        for line in f:
            rec = json.loads(line)
            yield Doc(rec["id"], rec["text"], rec["meta"])


# ---------------------------------------------------------------------------- token shards


def tokenize_docs(docs: Iterable[Doc], tokenizer: Tokenizer, out_dir: str | Path, val_fraction: float,
                  batch_bytes: int = 4 << 20, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict[str, Any]:
    """Tokenize documents into `out_dir/{train,val}-*.npy` with `kiln train`'s shard-writing loop;
    the split is `is_val(doc.id)`. Returns what `write_token_shards` returns."""
    return write_token_shards(docs, tokenizer, out_dir, lambda d: "val" if is_val(d.id, val_fraction) else "train",
                              batch_bytes, shard_tokens)


def merge_token_parts(part_dirs: list[Path], parts: list[dict[str, Any]], out_dir: str | Path,
                      tokenizer: Tokenizer, extra: dict[str, Any] | None = None) -> dict[str, int]:
    """Move per-shard token files into `out_dir` with one global numbering; write tokenizer.json
    and meta.json (last, so its presence marks a complete directory). Returns tokens per split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / "tokenizer.json")
    writers = []
    totals: dict[str, int] = {}
    for split in ("train", "val"):
        w = ShardWriter(out, split, tokenizer.vocab_size, tokenizer.eos_id)
        for part_dir, part in zip(part_dirs, parts):
            for info in part["splits"][split]:
                i = len(w.shards)
                tokens, docs = f"{split}-{i:05d}.tokens.npy", f"{split}-{i:05d}.docs.npy"
                src_t, src_d = part_dir / info["tokens"], part_dir / info["docs"]
                if src_t.exists():  # a rerun after a crash mid-merge finds some files already moved
                    os.replace(src_t, out / tokens)
                    os.replace(src_d, out / docs)
                w.shards.append(ShardInfo(tokens, docs, info["n_tokens"], info["n_docs"]))
        totals[split] = sum(s.n_tokens for s in w.shards)
        writers.append(w)
    write_meta(out, writers, extra)
    return totals
