"""The file-format readers shared by `kiln train` and `kiln prep` (kiln/data/documents.py)."""

import gzip
import json

import pytest
import zstandard

from kiln.data.documents import Doc, ReadOptions, file_format, read_file

ROWS = [json.dumps({"text": f"document number {i} " + "x" * (i % 50)}).encode() + b"\n" for i in range(3000)]
PLAIN = b"".join(ROWS)


def read(path, fmt=None, **opts):
    rejects = []
    docs = list(read_file(path, path.name, fmt or file_format(path), ReadOptions(**opts),
                          lambda *r: rejects.append(r)))
    return docs, rejects


@pytest.mark.parametrize("name, fmt", [
    ("a.txt", "text"), ("B.TXT", "text"), ("e.Markdown", "text"), ("d.html", "text"), ("n.txt.gz", "text"),
    ("c.json", "json"), ("f.jsonl.gz", "jsonl"), ("F.JSONL.ZST", "jsonl"), ("g.json.gz", "jsonl"),
    ("h.ndjson", "jsonl"), ("p.Parquet", "parquet"), ("x.bin", None), ("y.json.tar", None), ("noext", None),
])
def test_formats_by_suffix_any_case(name, fmt):
    assert file_format(name) == fmt


def _compress(kind, data):
    return gzip.compress(data) if kind == "gz" else zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("keep", [3, 12, 200, 0.5, -1])
def test_truncated_compressed_jsonl_keeps_what_was_read_and_says_so(tmp_path, kind, keep):
    whole = _compress(kind, PLAIN)
    cut = int(len(whole) * keep) if isinstance(keep, float) else keep % len(whole)
    path = tmp_path / f"d.jsonl.{kind}"
    path.write_bytes(whole[:cut])
    docs, rejects = read(path)
    assert [r[2] for r in rejects] == ["truncated"]  # never "empty file", never silent
    assert 0 <= len(docs) <= 3000  # a gzip file cut in its 8-byte trailer still has every record
    assert [d.text for d in docs] == [json.loads(r)["text"] for r in ROWS[:len(docs)]]  # a clean prefix
    assert f"after {len(docs)} records" in rejects[0][3]
    if keep == -1:  # everything before the damage is kept (zstd decodes whole blocks of <= 128 KiB)
        assert len(docs) > 2000


def test_truncated_compressed_text_and_corrupt_streams(tmp_path):
    (tmp_path / "t.txt.zst").write_bytes(_compress("zst", b"hello " * 1000)[:-5])
    docs, rejects = read(tmp_path / "t.txt.zst")
    assert docs == [] and rejects[0][2] == "truncated"
    whole = bytearray(_compress("gz", PLAIN))
    whole[len(whole) // 2: len(whole) // 2 + 64] = bytes(64)  # damaged in the middle
    (tmp_path / "c.jsonl.gz").write_bytes(bytes(whole))
    docs, rejects = read(tmp_path / "c.jsonl.gz")  # garbage lines first, then gzip's CRC check fails
    assert rejects[-1][2] == "corrupt" and "CRC" in rejects[-1][3] and len(docs) < 3000
    z = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(PLAIN))
    z[len(z) // 2: len(z) // 2 + 64] = b"\xff" * 64
    (tmp_path / "c.jsonl.zst").write_bytes(bytes(z))
    docs, rejects = read(tmp_path / "c.jsonl.zst")
    assert [r[2] for r in rejects] == ["corrupt"] and len(docs) < 3000


def test_multi_frame_zstd_and_empty_file(tmp_path):
    two = _compress("zst", b"".join(ROWS[:10])) + _compress("zst", b"".join(ROWS[10:20]))
    (tmp_path / "m.jsonl.zst").write_bytes(two)
    docs, rejects = read(tmp_path / "m.jsonl.zst")
    assert len(docs) == 20 and rejects == []
    (tmp_path / "e.jsonl.zst").write_bytes(b"")
    assert read(tmp_path / "e.jsonl.zst") == ([], [("e.jsonl.zst", None, "empty", "empty file", 0)])


def test_json_files_object_array_or_lines(tmp_path):
    (tmp_path / "o.json").write_text(json.dumps({"text": "one", "url": "u"}))
    docs, _ = read(tmp_path / "o.json")
    assert docs == [Doc("o.json:1", "one", {"url": "u", "source": "o.json", "line": 1})]
    (tmp_path / "a.json").write_text(json.dumps([{"text": "a"}, {"body": "b"}, {"text": "c"}]))
    docs, rejects = read(tmp_path / "a.json")
    assert [d.text for d in docs] == ["a", "c"] and [(r[1], r[2]) for r in rejects] == [(2, "missing_text_field")]
    (tmp_path / "l.json").write_text('{"text": "x"}\n{"text": "y"}\n')
    assert [d.text for d in read(tmp_path / "l.json")[0]] == ["x", "y"]
    (tmp_path / "bad.json").write_text('{"text": ')
    docs, rejects = read(tmp_path / "bad.json")
    assert docs == [] and rejects[0][2] == "bad_json"


def test_unreadable_file_is_rejected_not_raised(tmp_path):
    docs, rejects = read(tmp_path / "gone.jsonl")
    assert docs == [] and rejects[0][:3] == ("gone.jsonl", None, "unreadable")


def test_missing_optional_package_is_one_clear_line(tmp_path, monkeypatch):
    import sys

    from kiln.errors import DataError

    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n'))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(DataError, match=r"reading \.zst files needs the zstandard package"):
        read(tmp_path / "a.jsonl.zst")
