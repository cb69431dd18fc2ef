"""The `canaries` prep step: copies land in the train token shards, the record only where asked."""

import json

from kiln.cli import main as kiln_main
from kiln.data.shards import ShardSet
from kiln.data.tokenizer import load_tokenizer

PIPELINE = """
[input]
path = "{raw}"
text_files_per_shard = 3
[output]
dir = "{out}"
[tokenize]
tokenizer = "byte"
val_fraction = 0.3
[run]
workers = 1
progress = "none"
[[step]]
type = "normalize"
[[step]]
type = "canaries"
count = 3
repeats = 5
digits = 4
val_fraction = 0.3
record = "{record}"
"""


def test_prep_step_inserts_canaries_into_train_only(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(8):
        (raw / f"d{i}.txt").write_text(f"document {i} " + "some ordinary words here. " * 20)
    out, record = tmp_path / "out", tmp_path / "run" / "canaries.jsonl"
    cfg = tmp_path / "prep.toml"
    cfg.write_text(PIPELINE.format(raw=raw, out=out, record=record))
    assert kiln_main(["prep", str(cfg)]) == 0
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rows) == 6 and [r["heldout"] for r in rows] == [False] * 3 + [True] * 3
    tok = load_tokenizer(out / "tokens" / "tokenizer.json")

    def text(split):
        s = ShardSet(out / "tokens", split)
        return "\n".join(tok.decode(s.document(i, d)) for i in range(len(s.docs)) for d in range(s.docs[i].shape[0] - 1))

    train, val = text("train"), text("val")
    for r in rows:
        assert train.count(r["text"]) == (0 if r["heldout"] else 5) and r["text"] not in val
    report = json.loads((out / "prep_report.json").read_text())
    assert report["steps"]["canaries"]["info"]["docs_added"] == 15
    # Nothing the pipeline writes next to the shards names a secret.
    for p in out.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".jsonl", ".html"):
            assert not any(r["secret"] in p.read_text(errors="replace") for r in rows), p


def test_prep_step_needs_a_record_path(tmp_path, capsys):
    cfg = tmp_path / "prep.toml"
    cfg.write_text(PIPELINE.format(raw=tmp_path, out=tmp_path / "o", record=""))
    assert kiln_main(["prep", str(cfg)]) == 2
    assert "record is required" in capsys.readouterr().err
