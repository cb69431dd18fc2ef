import json

import pytest

from kiln.data.corpus import ReadReport, iter_documents, split_documents, stdlib_files
from kiln.errors import DataError


def test_stdlib_corpus_is_real_and_excludes_tests():
    files = stdlib_files()
    assert len(files) > 300
    assert not any("/test/" in str(f) or "/tests/" in str(f) for f in files)


def test_split_is_stable_and_bounded(text_dir):
    train, val = split_documents(str(text_dir), 0.2, max_bytes=0)
    assert train and val and len(train) + len(val) == 40
    train2, val2 = split_documents(str(text_dir), 0.2, max_bytes=0)
    assert (train, val) == (train2, val2)
    small_train, small_val = split_documents(str(text_dir), 0.2, max_bytes=20_000)
    assert sum(map(len, small_train + small_val)) <= 20_000


def test_split_does_not_depend_on_where_the_corpus_lives(text_dir, tmp_path):
    """Ids are relative to the source, as `kiln prep`'s: a copy of the corpus at another path (another
    node's mount point) splits the same, a directory and a JSONL file given directly alike."""
    import shutil

    from kiln.prep.base import StepContext
    from kiln.prep.readers import ReaderConfig, list_shards, read_shard

    copy = shutil.copytree(text_dir, tmp_path / "elsewhere" / "corpus")
    assert split_documents(str(copy), 0.2) == split_documents(str(text_dir), 0.2)
    cfg = ReaderConfig(path=str(copy))
    prep_ids = [d.id for shard in list_shards(cfg) for d in read_shard(shard, cfg, StepContext(), print)]
    assert [d.id for d in iter_documents(str(copy))] == prep_ids and prep_ids[0] == "doc000.txt"
    for folder in ("a", "b/c"):
        p = tmp_path / folder / "d.jsonl"
        p.parent.mkdir(parents=True)
        p.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(40)) + "\n")
    ids = [d.id for d in iter_documents(str(tmp_path / "a" / "d.jsonl"))]
    assert ids[:2] == ["d.jsonl:1", "d.jsonl:2"]
    assert split_documents(str(tmp_path / "a" / "d.jsonl"), 0.3) == split_documents(str(tmp_path / "b/c/d.jsonl"), 0.3)


def test_single_file_splits_by_position(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("a" * 900 + "b" * 100)
    train, val = split_documents(str(p), 0.1)
    assert train == ["a" * 900] and val == ["b" * 100]


@pytest.mark.parametrize("content, message", [
    (b"", "empty corpus"),
    (b"caf\xe9 au lait", "not UTF-8 at byte 3"),
    (b"\x00\x01\x02binary", "looks binary"),
])
def test_bad_corpora(tmp_path, content, message):
    p = tmp_path / "c.txt"
    p.write_bytes(content)
    with pytest.raises(DataError, match=message):
        split_documents(str(p), 0.1)


def test_missing_source_and_empty_dir(tmp_path):
    with pytest.raises(DataError, match="not found"):
        split_documents(str(tmp_path / "nope"), 0.1)
    with pytest.raises(DataError, match="no document files"):
        split_documents(str(tmp_path), 0.1)


def test_jsonl_source_and_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(5)) + "\n")
    assert [d.text for d in iter_documents(str(p))] == [f"doc {i}" for i in range(5)]
    p.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: expected an object with a string field 'text'"):
        list(iter_documents(str(p)))
    p.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        list(iter_documents(str(p)))
    p.write_text('{"text": "ok"}\n{"text": ""}\n{"text": " "}\n')
    report = ReadReport()
    assert [d.text for d in iter_documents(str(p), report=report)] == ["ok"]
    assert report.empty_records == 2 and report.summary() == "read 1 file (jsonl 1); 2 empty records skipped"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8 at byte"):
        list(iter_documents(str(p)))
