"""`[data]` -> token shards and a tokenizer for a `kiln train` run (cached by a fingerprint).

`data.source` may already be a shard directory (from `kiln prep`); otherwise the raw source is
read and split (kiln/data/corpus.py), a tokenizer is built (`build_tokenizer`, the one `kiln prep`
uses too) and the documents go through `write_token_shards` (also `kiln prep`'s) into RUN_DIR/data
(or data.shards_dir). A second run reuses the shards while the settings and the source files
(size, mtime, hash of the first/last MiB: `corpus.files_fingerprint`) are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from kiln.config import DataConfig
from kiln.data.corpus import read_corpus, source_files, files_fingerprint
from kiln.data.shards import ShardInfo, ShardWriter, is_shard_dir, read_meta, write_meta, write_token_shards
from kiln.data.storage import is_url, open_store
from kiln.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
from kiln.errors import DataError
from kiln.privacy.canaries import CANARY_FILE, canary_docs, interleave, make_canaries, write_record

TOKENIZER_FILE = "tokenizer.json"


def data_fingerprint(cfg: DataConfig) -> str:
    """The settings that shape the shards plus `files_fingerprint` of the source files."""
    keys = ("source", "glob", "text_field", "max_bytes", "tokenizer", "vocab_size", "val_fraction")
    if cfg.canaries:  # only then, so runs without canaries keep their earlier fingerprints
        keys += ("canaries", "canary_repeats", "canary_digits", "canary_seed")
    settings = {k: getattr(cfg, k) for k in keys}
    settings["files"] = files_fingerprint([p for p, _ in source_files(cfg.source, cfg.glob)])
    if cfg.tokenizer not in ("bpe", "byte"):  # a tokenizer.json given by path is an input too
        settings["tokenizer_file"] = files_fingerprint([Path(cfg.tokenizer)]) if Path(cfg.tokenizer).is_file() else ""
    blob = json.dumps(settings, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_shards(cfg: DataConfig, run_dir: Path, log=print) -> tuple[Path, Tokenizer]:
    """Return (shard_dir, tokenizer), writing shards if they are not there yet."""
    if is_url(cfg.source):  # shards on object storage: the tokenizer comes through the shard cache
        return cfg.source, load_tokenizer(open_store(cfg.source, cfg).local_path(TOKENIZER_FILE))
    if is_shard_dir(cfg.source):
        if cfg.canaries:
            raise DataError(f"data.canaries={cfg.canaries}: data.source {cfg.source} is already tokenized; "
                            f"insert canaries with the prep step `canaries` instead")
        shard_dir = Path(cfg.source)
        return shard_dir, load_tokenizer(shard_dir / TOKENIZER_FILE)
    shard_dir = Path(cfg.shards_dir) if cfg.shards_dir else run_dir / "data"
    fingerprint = data_fingerprint(cfg)
    canaries = []
    if cfg.canaries:  # the record goes to the run directory, never into the shards' meta.json
        canaries = make_canaries(cfg.canaries, cfg.canary_repeats, cfg.canary_digits, cfg.canary_seed)
        write_record(run_dir / CANARY_FILE, canaries)
    if is_shard_dir(shard_dir) and read_meta(shard_dir).get("fingerprint") == fingerprint:
        return shard_dir, load_tokenizer(shard_dir / TOKENIZER_FILE)
    if shard_dir.exists():  # stale (other settings or files) or half-written: rebuild from scratch
        ours = all(p.name == "meta.json" or p.name == TOKENIZER_FILE or ".tokens.npy" in p.name
                   or ".docs.npy" in p.name for p in shard_dir.iterdir())
        if not ours:  # never delete files kiln did not write
            raise DataError(f"data.shards_dir {shard_dir} holds files that are not kiln shards; "
                            f"point it at an empty or kiln-written directory")
        shutil.rmtree(shard_dir)

    log(f"reading {cfg.source} ...")
    corpus = read_corpus(cfg.source, cfg.val_fraction, cfg.max_bytes, cfg.glob, cfg.text_field)
    log(corpus.report.summary())
    log(f"tokenizer: {cfg.tokenizer} ...")
    try:
        tokenizer = build_tokenizer(cfg.tokenizer, cfg.vocab_size, (d.text for d in corpus.train))
    except DataError as e:  # name the key that pointed at the file
        raise DataError(f"data.tokenizer: {e}") from None
    if canaries:  # after the tokenizer is built, so its vocabulary learns nothing from the secrets
        corpus.train = interleave(corpus.train, canary_docs(canaries, cfg.canary_seed), cfg.canary_seed)
        log(f"canaries: {cfg.canaries} x {cfg.canary_repeats} inserted, recorded in {run_dir / CANARY_FILE}")
    shard_dir.mkdir(parents=True, exist_ok=True)
    for d in corpus.train:
        d.meta["split"] = "train"
    for d in corpus.val:
        d.meta["split"] = "val"
    # Train documents first, then validation, each in corpus order: the shards of earlier releases.
    result = write_token_shards(corpus.train + corpus.val, tokenizer, shard_dir, lambda d: d.meta["split"])
    tokenizer.save(shard_dir / TOKENIZER_FILE)
    writers = []
    for split, infos in result["splits"].items():
        writers.append(ShardWriter(shard_dir, split, tokenizer.vocab_size, tokenizer.eos_id))
        writers[-1].shards = [ShardInfo(**i) for i in infos]
    write_meta(shard_dir, writers, {
        "fingerprint": fingerprint, "source": cfg.source,
        "train_bytes": sum(len(d.text.encode()) for d in corpus.train),
        "val_bytes": sum(len(d.text.encode()) for d in corpus.val)})
    return shard_dir, tokenizer
