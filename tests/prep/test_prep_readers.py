import gzip
import json

import pytest

from kiln.prep.base import StepContext
from kiln.prep.readers import ReaderConfig, list_shards, read_shard
from kiln.prep.writers import DocWriter, read_docs
from kiln.prep.base import Doc
from kiln.errors import DataError


def read_all(path, **kw):
    cfg = ReaderConfig(path=str(path), **kw)
    ctx, rejects, docs = StepContext(), [], []
    for shard in list_shards(cfg):
        docs.extend(read_shard(shard, cfg, ctx, lambda *r: rejects.append(r)))
    return docs, rejects, ctx.stats["read"]


def test_broken_jsonl_lines_are_rejected_with_file_and_line(tmp_path):
    lines = [json.dumps({"text": "good one", "id": "a", "url": "http://x"}).encode(), b"{not json",
             json.dumps({"body": "x"}).encode(), b"\xff\xfe bad utf8", json.dumps([1, 2]).encode(),
             json.dumps({"text": ""}).encode(), b"", json.dumps({"text": "x" * 500}).encode(),
             json.dumps({"text": 5}).encode(), json.dumps({"text": "good two"}).encode()]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    docs, rejects, stats = read_all(tmp_path, id_field="id", max_doc_bytes=200)
    assert [d.text for d in docs] == ["good one", "good two"]
    assert docs[0].id == "a" and docs[0].meta["url"] == "http://x" and docs[1].id == "d.jsonl:10"
    assert [(r[1], r[2]) for r in rejects] == [
        (2, "read:bad_json"), (3, "read:missing_text_field"), (4, "read:not_utf8"), (5, "read:not_object"),
        (6, "read:empty"), (8, "read:too_large"), (9, "read:missing_text_field")]
    assert all(r[0] == "d.jsonl" for r in rejects)
    assert stats["docs_in"] == 9 and stats["docs_kept"] == 2 and sum(stats["dropped"].values()) == 7
    assert stats["bytes_kept"] == len("good one") + len("good two")  # text bytes, not JSON lines
    assert stats["bytes_in"] == stats["bytes_kept"] + sum(stats["dropped_bytes"].values())


def test_text_files_binary_non_utf8_empty_and_too_large(tmp_path):
    (tmp_path / "ok.txt").write_text("hello world", encoding="utf-8")
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "big.txt").write_text("x" * 1000)
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    (tmp_path / "utf16.txt").write_bytes("hello".encode("utf-16"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfwith bom")
    docs, rejects, _ = read_all(tmp_path, max_doc_bytes=100)
    assert [(d.id, d.text) for d in docs] == [("bom.txt", "with bom"), ("ok.txt", "hello world")]
    assert sorted((r[0], r[2]) for r in rejects) == [
        ("big.txt", "read:too_large"), ("bin.txt", "read:binary"), ("empty.txt", "read:empty"),
        ("latin.txt", "read:not_utf8"), ("utf16.txt", "read:not_utf8")]


def test_compressed_jsonl_and_corrupt_stream(tmp_path):
    import zstandard

    rows = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(3))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(rows))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(rows)[:-12])  # truncated
    (tmp_path / "d.jsonl").write_bytes(b"")
    docs, rejects, _ = read_all(tmp_path)
    texts = [d.text for d in docs]
    assert texts[:6] == ["doc 0", "doc 1", "doc 2"] * 2
    assert {r[2] for r in rejects} == {"read:truncated", "read:empty"}
    assert [r[0] for r in rejects if r[2] == "read:truncated"] == ["c.jsonl.gz"]


def test_parquet_streaming_and_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "three"], "url": ["u1", "u2", "u3"]}), tmp_path / "a.parquet",
                   row_group_size=1)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    docs, rejects, _ = read_all(tmp_path, parquet_batch_rows=1)
    assert [(d.id, d.text, d.meta["url"]) for d in docs] == [("a.parquet:1", "one", "u1"), ("a.parquet:3", "three", "u3")]
    assert sorted((r[0], r[2]) for r in rejects) == [("a.parquet", "read:missing_text_field"),
                                                      ("b.parquet", "read:missing_text_field")]


def test_missing_input_and_no_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        list_shards(ReaderConfig(path=str(tmp_path / "nope")))
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(DataError, match="no input files"):
        list_shards(ReaderConfig(path=str(tmp_path)))


def test_text_files_grouped_into_shards(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"doc {i}")
    shards = list_shards(ReaderConfig(path=str(tmp_path), text_files_per_shard=2))
    assert [len(s.files) for s in shards] == [2, 2, 1]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "parquet"])
def test_doc_writer_roundtrip(tmp_path, fmt):
    path = tmp_path / f"out.{fmt}"
    w = DocWriter(path, fmt, parquet_rows=2)
    docs = [Doc(str(i), f"text {i} é", {"source": "s", "line": i}) for i in range(5)]
    for d in docs:
        w.write(d)
    assert not path.exists()  # only the temporary file until close
    w.close()
    assert list(read_docs(path)) == docs


@pytest.mark.parametrize("cut", [5, 30, 0.6])
def test_truncated_zstd_is_counted_with_what_was_read(tmp_path, cut):
    import zstandard

    rows = b"".join(json.dumps({"text": f"document {i} " * 10}).encode() + b"\n" for i in range(3000))
    whole = zstandard.ZstdCompressor().compress(rows)
    (tmp_path / "big.jsonl.zst").write_bytes(whole[:int(len(whole) * cut) if isinstance(cut, float) else cut])
    docs, rejects, stats = read_all(tmp_path)
    assert [(r[0], r[1], r[2]) for r in rejects] == [("big.jsonl.zst", None, "read:truncated")]  # not "empty"
    assert f"after {len(docs)} records" in rejects[0][3]
    assert stats["docs_kept"] == len(docs) and stats["dropped"] == {"read:truncated": 1}
    assert stats["docs_in"] == len(docs) + 1
    if isinstance(cut, float):
        assert 1000 < len(docs) < 3000


def test_suffixes_any_case_and_json_files(tmp_path):
    (tmp_path / "A.TXT").write_text("upper")
    (tmp_path / "b.Jsonl.GZ").write_bytes(gzip.compress(b'{"text": "gz"}\n'))
    (tmp_path / "c.json").write_text(json.dumps([{"text": "j1"}, {"text": "j2"}]))
    (tmp_path / "d.markdown").write_text("md")
    docs, rejects, _ = read_all(tmp_path)
    assert sorted(d.text for d in docs) == ["gz", "j1", "j2", "md", "upper"] and rejects == []
