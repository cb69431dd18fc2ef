import json

import numpy as np
import pytest

from kiln.data.tokenizer import token_byte_lengths
from kiln.data.shards import ShardSet, ShardWriter, read_meta, token_dtype, write_meta
from kiln.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from kiln.errors import DataError

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓ 你好", "class A:\n    pass\n" * 20]


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    tok.save(tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), ByteTokenizer)


def test_bpe_round_trip_and_save(tmp_path):
    tok = train_bpe(iter(TEXTS * 10), vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    for t in TEXTS:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        assert len(ids) <= len(t.encode())
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.eos_id == tok.eos_id
    batch = tok.encode_batch(TEXTS)
    assert [list(b) for b in batch] == [tok.encode(t) for t in TEXTS]


def test_token_byte_lengths_exact():
    tok = train_bpe(iter(TEXTS * 10), vocab_size=300)
    lengths = token_byte_lengths(tok)
    for t in TEXTS:
        assert lengths[tok.encode(t)].sum() == len(t.encode("utf-8"))
    assert lengths[tok.eos_id] == 0
    assert token_byte_lengths(ByteTokenizer())[65] == 1


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_shards_round_trip(tmp_path):
    docs = [np.arange(n) % 300 for n in (5, 0, 17, 3)]
    w = ShardWriter(tmp_path, "train", vocab_size=300, eos_id=299, shard_tokens=16)
    for d in docs:
        w.add(d)
    w.finish()
    write_meta(tmp_path, [w])
    assert len(w.shards) >= 2  # rolled over to a second shard
    s = ShardSet(tmp_path, "train")
    assert s.n_docs == 4 and s.n_tokens == sum(len(d) + 1 for d in docs)
    got = [s.document(i, j) for i, d in enumerate(s.docs) for j in range(len(d) - 1)]
    assert [list(g) for g in got] == [list(d) for d in docs]
    assert s.tokens[0].dtype == np.uint16 and token_dtype(70000) == np.uint32
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporaries


def test_shard_errors(tmp_path):
    w = ShardWriter(tmp_path, "train", vocab_size=10, eos_id=9)
    with pytest.raises(DataError, match="out of range"):
        w.add([3, 10])
    with pytest.raises(DataError, match="no meta.json"):
        ShardSet(tmp_path, "train")
    (tmp_path / "meta.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="expected format"):
        read_meta(tmp_path)
