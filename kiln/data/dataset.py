"""Turn `[data]` into token shards and a tokenizer for a run (cached by a fingerprint).

`data.source` may already be a shard directory (from `kiln prep`); otherwise the raw source is
read, split into train/validation, a tokenizer is trained or loaded, and shards are written to
RUN_DIR/data (or data.shards_dir). A second run with the same data settings reuses them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from kiln.config import DataConfig
from kiln.data.corpus import split_documents
from kiln.data.shards import ShardWriter, is_shard_dir, read_meta, write_meta
from kiln.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe
from kiln.errors import DataError

TOKENIZER_FILE = "tokenizer.json"


def data_fingerprint(cfg: DataConfig) -> str:
    keys = ("source", "glob", "text_field", "max_bytes", "tokenizer", "vocab_size", "val_fraction")
    blob = json.dumps({k: getattr(cfg, k) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tokenizer(cfg: DataConfig, train_texts: list[str]) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return train_bpe(iter(train_texts), cfg.vocab_size)
    try:
        return load_tokenizer(cfg.tokenizer)
    except DataError as e:  # name the key that pointed at the file
        raise DataError(f"data.tokenizer: {e}") from None


def prepare_shards(cfg: DataConfig, run_dir: Path, log=print) -> tuple[Path, Tokenizer]:
    """Return (shard_dir, tokenizer), writing shards if they are not there yet."""
    if is_shard_dir(cfg.source):
        shard_dir = Path(cfg.source)
        return shard_dir, load_tokenizer(shard_dir / TOKENIZER_FILE)
    shard_dir = Path(cfg.shards_dir) if cfg.shards_dir else run_dir / "data"
    fingerprint = data_fingerprint(cfg)
    if is_shard_dir(shard_dir) and read_meta(shard_dir).get("fingerprint") == fingerprint:
        return shard_dir, load_tokenizer(shard_dir / TOKENIZER_FILE)
    if shard_dir.exists():  # stale (other settings) or half-written: rebuild from scratch
        ours = all(p.name == "meta.json" or p.name == TOKENIZER_FILE or ".tokens.npy" in p.name
                   or ".docs.npy" in p.name for p in shard_dir.iterdir())
        if not ours:  # never delete files kiln did not write
            raise DataError(f"data.shards_dir {shard_dir} holds files that are not kiln shards; "
                            f"point it at an empty or kiln-written directory")
        shutil.rmtree(shard_dir)

    log(f"reading {cfg.source} ...")
    train_texts, val_texts = split_documents(cfg.source, cfg.val_fraction, cfg.max_bytes,
                                             cfg.glob, cfg.text_field)
    log(f"tokenizer: {cfg.tokenizer} ...")
    tokenizer = build_tokenizer(cfg, train_texts)
    shard_dir.mkdir(parents=True, exist_ok=True)
    writers = []
    for split, texts in (("train", train_texts), ("val", val_texts)):
        writer = ShardWriter(shard_dir, split, tokenizer.vocab_size, tokenizer.eos_id)
        for i in range(0, len(texts), 256):
            for ids in tokenizer.encode_batch(texts[i:i + 256]):
                writer.add(ids)
        writer.finish()
        writers.append(writer)
    tokenizer.save(shard_dir / TOKENIZER_FILE)
    write_meta(shard_dir, writers, {"fingerprint": fingerprint, "source": cfg.source,
                                    "train_bytes": sum(len(t.encode()) for t in train_texts),
                                    "val_bytes": sum(len(t.encode()) for t in val_texts)})
    return shard_dir, tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits-per-byte.

    Byte-level BPE tokens are strings over GPT-2's byte-to-unicode alphabet, so each character
    maps back to exactly one byte; other tokenizers fall back to decoding ids one by one.
    """
    if isinstance(tokenizer, ByteTokenizer):
        lengths = np.ones(256, dtype=np.int64)
        lengths[tokenizer.eos_id] = 0
        return lengths
    assert isinstance(tokenizer, HFTokenizer)
    alphabet = set(_byte_level_alphabet())
    special = {t.content for t in tokenizer.tok.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for token, i in tokenizer.tok.get_vocab().items():
        if i >= tokenizer.vocab_size or token in special:
            continue
        if all(c in alphabet for c in token):
            lengths[i] = len(token)
        else:
            lengths[i] = len(tokenizer.tok.decode([i]).encode("utf-8"))
    return lengths


def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()
