"""Packed token shards: the on-disk format `kiln train` reads.

A shard directory holds

    meta.json                      format, version, dtype, vocab size, eos id, shard list per split
    tokenizer.json                 the tokenizer that produced the ids
    {split}-{i:05d}.tokens.npy     flat 1-D array of token ids (uint16 if vocab <= 65536, else uint32)
    {split}-{i:05d}.docs.npy       int64 document start offsets into the token array, length n_docs + 1

Each document is written as its tokens followed by the EOS id, back to back, so a shard is one
long token stream that `np.load(..., mmap_mode="r")` maps without reading. Every file is written
under a temporary name and renamed, so a reader never sees a half-written shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from kiln.data.storage import LazyShard, ShardStore
from kiln.errors import DataError
from kiln.io import atomic_file, atomic_write_text, read_text_file

if TYPE_CHECKING:
    from kiln.data.documents import Doc
    from kiln.data.tokenizer import Tokenizer

FORMAT = "kiln-shards"
VERSION = 1
DEFAULT_SHARD_TOKENS = 64 * 1024 * 1024


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_file(path, "wb") as f:
        np.save(f, array)


@dataclass
class ShardInfo:
    tokens: str
    docs: str
    n_tokens: int
    n_docs: int


class ShardWriter:
    """Streams documents (lists/arrays of ids) into shards of at most `shard_tokens` tokens.

    Use one writer per split; call `finish()` for each, then `write_meta()` once.
    """

    def __init__(self, out_dir: str | Path, split: str, vocab_size: int, eos_id: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.split, self.vocab_size, self.eos_id = split, vocab_size, eos_id
        self.dtype = token_dtype(vocab_size)
        self.shard_tokens = shard_tokens
        self.shards: list[ShardInfo] = []
        self._chunks: list[np.ndarray] = []
        self._starts: list[int] = [0]
        self._buffered = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise DataError(f"token id out of range [0, {self.vocab_size}) in split {self.split}")
        doc = np.empty(arr.size + 1, dtype=self.dtype)
        doc[:-1] = arr
        doc[-1] = self.eos_id
        self._chunks.append(doc)
        self._buffered += doc.size
        self._starts.append(self._buffered)
        if self._buffered >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._chunks:
            return
        i = len(self.shards)
        tokens_name = f"{self.split}-{i:05d}.tokens.npy"
        docs_name = f"{self.split}-{i:05d}.docs.npy"
        _atomic_save_npy(self.out_dir / tokens_name, np.concatenate(self._chunks))
        _atomic_save_npy(self.out_dir / docs_name, np.asarray(self._starts, dtype=np.int64))
        self.shards.append(ShardInfo(tokens_name, docs_name, self._buffered, len(self._starts) - 1))
        self._chunks, self._starts, self._buffered = [], [0], 0

    def finish(self) -> list[ShardInfo]:
        self._flush()
        return self.shards


def write_token_shards(docs: Iterable[Doc], tokenizer: Tokenizer, out_dir: str | Path,
                       split_of: Callable[[Doc], str], batch_bytes: int = 4 << 20,
                       shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict[str, Any]:
    """The one shard-writing loop of `kiln train` and `kiln prep`: documents are tokenized in
    batches of ~batch_bytes of text (one Rust-side `encode_batch` call each, so per-document
    Python work stays small) and appended to the writer of `split_of(doc)` ("train" or "val").

    Returns {"splits": {split: [ShardInfo dicts]}, "docs": {split: n}, "tokens": {split: n}};
    the caller writes tokenizer.json and `write_meta`.
    """
    writers = {s: ShardWriter(out_dir, s, tokenizer.vocab_size, tokenizer.eos_id, shard_tokens)
               for s in ("train", "val")}
    counts: dict[str, dict[str, int]] = {"docs": {"train": 0, "val": 0}, "tokens": {"train": 0, "val": 0}}
    batch: list[Doc] = []
    size = 0

    def flush() -> None:
        for doc, ids in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
            split = split_of(doc)
            writers[split].add(ids)
            counts["docs"][split] += 1
            counts["tokens"][split] += len(ids) + 1
        batch.clear()

    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= batch_bytes:
            flush()
            size = 0
    if batch:
        flush()
    return {"splits": {s: [vars(i) for i in w.finish()] for s, w in writers.items()}, **counts}


def write_meta(out_dir: str | Path, writers: list[ShardWriter], extra: dict | None = None) -> None:
    """Write meta.json last: its presence marks the directory as complete."""
    w0 = writers[0]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": w0.dtype.name,
        "vocab_size": w0.vocab_size,
        "eos_id": w0.eos_id,
        "splits": {w.split: [vars(s) for s in w.shards] for w in writers},
        **(extra or {}),
    }
    atomic_write_text(Path(out_dir) / "meta.json", json.dumps(meta, indent=1))


def is_shard_dir(path: str | Path) -> bool:
    return (Path(path) / "meta.json").is_file()


class ShardSet:
    """Read-only, memory-mapped view of one split of a shard directory.

    `shard_dir` is a local path or any fsspec URL (`s3://bucket/prefix`). Local shards are mapped
    up front, as always; remote ones are `LazyShard`s that `store` downloads into its bounded
    on-disk cache on first read (the loader prefetches them ahead of its sampler).
    """

    def __init__(self, shard_dir: str | Path, split: str, store: ShardStore | None = None):
        self.store = store or ShardStore(shard_dir)
        self.dir = Path(shard_dir) if not self.store.remote else str(shard_dir)
        self.meta = parse_meta(self.store.read_text("meta.json"), f"{shard_dir}/meta.json")
        if split not in self.meta["splits"]:
            raise DataError(f"{self.dir}/meta.json has no split {split!r}; it has {sorted(self.meta['splits'])}")
        self.split = split
        self.vocab_size = int(self.meta["vocab_size"])
        self.eos_id = int(self.meta["eos_id"])
        try:
            dtype = np.dtype(str(self.meta["dtype"]))
            shards = list(self.meta["splits"][split])
        except (KeyError, TypeError) as e:
            raise DataError(f"{shard_dir}/meta.json: expected a token dtype and a shard list ({e})") from None
        self.tokens: list[np.ndarray] = []
        self.docs: list[np.ndarray] = []
        for i, info in enumerate(shards):
            try:
                names = (str(info["tokens"]), str(info["docs"]))
                n_tokens, n_docs = int(info["n_tokens"]), int(info["n_docs"])
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(f"{shard_dir}/meta.json: split {split!r} shard {i}: expected tokens, docs, "
                                f"n_tokens and n_docs ({type(e).__name__}: {e})") from None
            if any("/" in n or n.startswith(".") for n in names):  # a hostile meta.json must not reach out
                raise DataError(f"{shard_dir}/meta.json: shard {i}: file names must be plain names, got {names}")
            if self.store.remote:
                self.tokens.append(LazyShard(self.store, names[0], n_tokens, dtype))
                self.docs.append(LazyShard(self.store, names[1], n_docs + 1, np.int64))
            else:
                self.tokens.append(self.store.array(names[0], n_tokens))
                self.docs.append(self.store.array(names[1], n_docs + 1))

    def shard_files(self, shard: int) -> list[str]:
        """The file names of shard `shard` (what a prefetch asks the store for)."""
        info = self.meta["splits"][self.split][shard]
        return [info["tokens"], info["docs"]]

    @property
    def n_tokens(self) -> int:
        return sum(t.shape[0] for t in self.tokens)

    @property
    def n_docs(self) -> int:
        return sum(d.shape[0] - 1 for d in self.docs)

    def document(self, shard: int, doc: int) -> np.ndarray:
        """Token ids of one document, without its trailing EOS."""
        starts = self.docs[shard]
        return np.asarray(self.tokens[shard][starts[doc]:starts[doc + 1] - 1])


def read_meta(shard_dir: str | Path) -> dict:
    path = Path(shard_dir) / "meta.json"
    text = read_text_file(path, error=DataError, missing=f"{shard_dir} is not a kiln shard directory (no meta.json)")
    return parse_meta(text, path)


def parse_meta(text: str, path: str | Path) -> dict:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: expected format {FORMAT!r} version {VERSION}, got "
                        f"{meta.get('format')!r} version {meta.get('version')}")
    return meta
