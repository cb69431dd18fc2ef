"""`kiln train`'s raw source -> shards path: formats read, skips reported, cache invalidation."""

import gzip
import json
import os

import pytest
import zstandard

from kiln.config import DataConfig
from kiln.data.corpus import files_fingerprint, is_val
from kiln.data.documents import Doc
from kiln.data.raw_to_shards import prepare_shards
from kiln.data.shards import ShardSet, read_meta, write_token_shards
from kiln.data.tokenizer import ByteTokenizer, build_tokenizer, token_byte_lengths
from kiln.errors import DataError


def prepare(source, run_dir, **kw):
    lines = []
    shard_dir, tok = prepare_shards(DataConfig(source=str(source), tokenizer="byte", **kw), run_dir,
                                    log=lines.append)
    return shard_dir, lines


def n_docs(shard_dir):
    return ShardSet(shard_dir, "train").n_docs + ShardSet(shard_dir, "val").n_docs


def test_directory_reads_every_format_and_reports_skips(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha text")
    (src / "B.TXT").write_text("upper-case suffix")
    (src / "c.json").write_text(json.dumps({"text": "json object"}))
    (src / "d.html").write_text("<p>html</p>")
    (src / "e.markdown").write_text("# markdown")
    (src / "f.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gz one"}\n{"text": "gz two"}\n'))
    (src / "g.bin").write_bytes(b"\x00\x01")
    (src / "h.txt").write_bytes(b"\x00binary after all")
    (src / "i.md").write_text("   \n")
    (src / "j.json").write_text(json.dumps({"name": "a config file", "version": 2}))
    shard_dir, lines = prepare(src, tmp_path / "run")
    assert n_docs(shard_dir) == 7
    summary = next(line for line in lines if line.startswith("read "))
    assert summary == ("read 6 files (json 1, jsonl 1, text 4); skipped 4: g.bin (unsupported suffix), "
                       "h.txt (binary), i.md (empty), j.json (JSON without a string 'text')")


def test_bad_record_after_good_ones_is_an_error_naming_file_and_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text(json.dumps([{"text": "fine"}, {"body": "no text"}]))
    with pytest.raises(DataError, match=r"a\.json:2: expected an object with a string field 'text'"):
        prepare(src, tmp_path / "run")


def test_compressed_file_given_directly(tmp_path):
    path = tmp_path / "d.JSONL.ZST"
    path.write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(20))))
    shard_dir, _ = prepare(path, tmp_path / "run")
    assert n_docs(shard_dir) == 20


@pytest.mark.parametrize("cut", [4, 40, -9])
def test_truncated_compressed_source_is_one_clear_error(tmp_path, cut):
    rows = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(2000))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("fine")
    whole = zstandard.ZstdCompressor().compress(rows)
    (src / "b.jsonl.zst").write_bytes(whole[:cut])
    with pytest.raises(DataError, match=r"b\.jsonl\.zst: truncated zstd stream .* after \d+ records"):
        prepare(src, tmp_path / "run")
    assert not (tmp_path / "run" / "data" / "meta.json").exists()


def test_rewritten_corpus_rebuilds_shards_and_unchanged_one_is_reused(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("old text " * 1000)
    shard_dir, lines = prepare(corpus, tmp_path / "run")
    old = read_meta(shard_dir)
    _, lines = prepare(corpus, tmp_path / "run")
    assert lines == []  # reused: nothing read
    corpus.write_text("new, longer text " * 4000)
    _, lines = prepare(corpus, tmp_path / "run")
    new = read_meta(shard_dir)
    assert lines and new["fingerprint"] != old["fingerprint"]
    assert new["train_bytes"] + new["val_bytes"] == len("new, longer text " * 4000)


def test_fingerprint_sees_same_size_same_mtime_edits(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * (3 << 20))
    st = path.stat()
    before = files_fingerprint([path])
    for offset in (10, (3 << 20) - 10):  # in the first MiB, then in the last
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"b")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = files_fingerprint([path])
        assert after != before
        before = after


def test_one_shard_loop_splits_by_caller_rule(tmp_path):
    docs = [Doc(f"d{i}", f"text {i} " * (i + 1)) for i in range(50)]
    tok = build_tokenizer("byte", 0, iter(()))
    assert isinstance(tok, ByteTokenizer) and token_byte_lengths(tok)[tok.eos_id] == 0
    result = write_token_shards(docs, tok, tmp_path, lambda d: "val" if is_val(d.id, 0.3) else "train",
                                batch_bytes=64, shard_tokens=200)
    n_val = sum(is_val(d.id, 0.3) for d in docs)
    assert result["docs"] == {"train": 50 - n_val, "val": n_val} and 0 < n_val < 50
    assert result["tokens"]["train"] == sum(len(d.text) + 1 for d in docs if not is_val(d.id, 0.3))
    assert len(result["splits"]["train"]) > 1  # rolled over shards
