"""Shared helpers for the prep executor tests: a small corpus and toy steps (a global exact-dedup
step and a slow step), registered when this module is imported."""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.prep.base import Filter, GlobalStep, register

WORDS = ("the of and to in that have with it for not on be as at this but by from they we say her she or an "
         "will my one all would there their what so up out if about who get which go me when make can like time "
         "no just him know take people into year your good some could them see other than then now look only "
         "come its over think also back after use two how our work first well way even new want because").split()


def make_corpus(root: Path, n_docs: int = 24, seed: int = 0) -> Path:
    """Text files of English-like prose plus junk: duplicates, short files, binary, PII, bad JSONL."""
    rng = random.Random(seed)
    raw = root / "raw"
    raw.mkdir(parents=True)
    texts = []
    for i in range(n_docs):
        paras = [" ".join(rng.choice(WORDS) for _ in range(30)).capitalize() + "." for _ in range(3)]
        texts.append("\n\n".join(paras))
    texts[5] += "\nWrite to jane.doe@example.org or call 415-555-0132."
    for i, text in enumerate(texts):
        (raw / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    (raw / "dup_a.txt").write_text(texts[1], encoding="utf-8")
    (raw / "dup_b.txt").write_text(texts[2], encoding="utf-8")
    (raw / "short.txt").write_text("too short", encoding="utf-8")
    (raw / "binary.txt").write_bytes(b"\x00\x01\x02 binary")
    with open(raw / "records.jsonl", "w", encoding="utf-8") as f:
        for i in range(6):
            f.write(json.dumps({"text": texts[i % n_docs] + f" Record {i} ends here.", "url": f"http://ex.org/{i}"}) + "\n")
        f.write("{broken json\n")
    return raw


@dataclass
class ExactDedupConfig:
    pass


@register
class ExactDedup(GlobalStep):
    """Toy global step: drops exact duplicate texts, keeping the first by (shard, position)."""

    type = "test_exact_dedup"
    Config = ExactDedupConfig
    state_bytes_per_doc = 16

    def index(self, docs, ctx):
        hashes = [hashlib.sha1(d.text.encode()).hexdigest() for d in docs]
        (ctx.work_dir / f"hashes-{ctx.shard_index:05d}.json").write_text(json.dumps(hashes))

    def prepare(self, ctx, n_shards):
        seen, drop = set(), {}
        for s in range(n_shards):
            hashes = json.loads((ctx.work_dir / f"hashes-{s:05d}.json").read_text())
            for pos, h in enumerate(hashes):
                if h in seen:
                    drop.setdefault(str(s), []).append(pos)
                seen.add(h)
        (ctx.work_dir / "drop.json").write_text(json.dumps(drop))
        ctx.note(self.name, "duplicates", sum(map(len, drop.values())))

    def setup(self, ctx):
        self._drop = set(json.loads((ctx.work_dir / "drop.json").read_text()).get(str(ctx.shard_index), []))

    def run(self, docs, ctx):
        for pos, doc in enumerate(docs):
            if pos in self._drop:
                ctx.drop(self.name, doc, "exact_dup")
            else:
                yield doc


@dataclass
class SlowConfig:
    seconds: float = 0.0


@register
class Slow(Filter):
    """Sleeps per document, so a test can kill a run part-way."""

    type = "test_slow"
    Config = SlowConfig

    def reason(self, doc):
        time.sleep(self.config.seconds)
        return None


PIPELINE = """
[input]
path = "{raw}"
text_files_per_shard = {per_shard}
[output]
dir = "{out}"
[tokenize]
tokenizer = "bpe"
vocab_size = 300
val_fraction = 0.2
[run]
executor = "{executor}"
workers = {workers}
progress = "none"
[[step]]
type = "normalize"
[[step]]
type = "gopher_quality"
min_words = 20
[[step]]
type = "test_exact_dedup"
[[step]]
type = "pii"
[[step]]
type = "test_slow"
seconds = {slow}
"""


def write_config(root: Path, raw: Path, out: Path, *, executor: str = "local", workers: int = 1,
                 per_shard: int = 4, slow: float = 0.0) -> Path:
    path = root / f"prep-{out.name}.toml"
    path.write_text(PIPELINE.format(raw=raw, out=out, executor=executor, workers=workers, per_shard=per_shard,
                                    slow=slow), encoding="utf-8")
    return path


def output_files(out: Path) -> dict[str, bytes]:
    """Every output file except the report (which holds timings), by relative path."""
    skip = {"prep_report.json", "prep_report.html"}
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".work" not in p.parts and p.name not in skip}
