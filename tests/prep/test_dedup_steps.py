import json
import pickle

import pytest
from dedup_testdata import edit_words, random_docs

from kiln.prep.base import Doc, StepContext, merge_stats
from kiln.prep.dedup.exact import ExactConfig
from kiln.prep.dedup.minhash import MinHashConfig
from kiln.prep.dedup.simhash import SimHashConfig
from kiln.prep.dedup.steps import (ExactDedup, ExactDedupConfig, MinHashDedup, SimHashDedup,
                                        SuffixArrayDedup)
from kiln.prep.dedup.suffix_array import SuffixArrayConfig
from kiln.errors import ConfigError, DataError


def run_global(step, shards, work_dir):
    """The three stages in the order the executors run them (index all, prepare, run all)."""
    step = pickle.loads(pickle.dumps(step))  # steps travel to worker processes
    for i, docs in enumerate(shards):
        step.index(iter(docs), StepContext(shard_index=i, n_shards=len(shards), work_dir=work_dir))
    prepare_ctx = StepContext(n_shards=len(shards), work_dir=work_dir)
    step.prepare(prepare_ctx, len(shards))
    stats = dict(prepare_ctx.stats)
    outputs = []
    for i, docs in enumerate(shards):
        ctx = StepContext(shard_index=i, n_shards=len(shards), work_dir=work_dir)
        step.setup(ctx)
        outputs.append(list(step.run(iter(docs), ctx)))
        merge_stats(stats, ctx.stats)
    return outputs, stats.get(step.name, {})


def as_docs(texts, prefix):
    return [Doc(f"{prefix}{i}", t) for i, t in enumerate(texts)]


def test_exact_document_dedup_across_shards_counts_reasons(tmp_path):
    a, b = random_docs(2, seed=10)
    shards = [as_docs([a, b], "s0-"), as_docs([b.upper(), "fresh text " + a, a], "s1-")]
    for kind in ("exact", "bloom"):
        out, stats = run_global(ExactDedup(ExactDedupConfig(filter=kind)), shards, tmp_path / kind)
        assert [d.id for d in out[0]] == ["s0-0", "s0-1"] and [d.id for d in out[1]] == ["s1-1"]
        assert stats["dropped"] == {f"dedup:{kind}": 2}
        assert stats["info"]["units_indexed"] == 5


def test_exact_paragraph_dedup_modifies_and_drops(tmp_path):
    boiler = "Share this article with your friends and family today."
    texts = [f"Story one here.\n\n{boiler}", f"Story two here.\n\n{boiler}", boiler]
    step = ExactDedup(ExactDedupConfig(unit="paragraph", min_unit_chars=5), name="para")
    out, stats = run_global(step, [as_docs(texts, "d")], tmp_path)
    assert [d.text for d in out[0]] == [texts[0], "Story two here.\n\n"]
    assert stats["dropped"] == {"dedup:exact_paragraph": 1}
    assert stats["modified"] == {"dedup:exact_paragraph": 1} and stats["docs_modified"] == 1


def test_minhash_step_drops_near_duplicates_in_other_shards(tmp_path):
    docs = random_docs(30, seed=11)
    shards = [as_docs(docs[:15], "a"), as_docs(docs[15:] + [edit_words(docs[2], 1), edit_words(docs[20], 2)], "b")]
    out, stats = run_global(MinHashDedup(MinHashConfig()), shards, tmp_path)
    assert len(out[0]) == 15 and [d.id for d in out[1]] == [f"b{i}" for i in range(15)]
    assert stats["dropped"] == {"dedup:minhash": 2}
    assert stats["info"]["verified_pairs"] == 2
    assert "bands x" in (tmp_path / "s_curve.txt").read_text()
    assert stats["info"]["p_candidate@1.00"] == 1.0 and stats["info"]["lsh_bands"] * stats["info"]["lsh_rows"] <= 128


def test_simhash_step(tmp_path):
    docs = random_docs(20, words=300, seed=12)
    out, stats = run_global(SimHashDedup(SimHashConfig(max_distance=4)),
                            [as_docs(docs, "a"), as_docs([docs[4].title()], "b")], tmp_path)
    assert len(out[0]) == 20 and out[1] == [] and stats["dropped"] == {"dedup:simhash": 1}


def test_suffix_array_step_removes_spans_and_drops_emptied_docs(tmp_path):
    span = "A repeated paragraph of boilerplate that appears in more than one document. "
    shards = [as_docs(["Intro. " + span + "End.", "unique words"], "a"), as_docs([span.strip(), "x " + span], "b")]
    out, stats = run_global(SuffixArrayDedup(SuffixArrayConfig(min_length=40)), shards, tmp_path)
    assert [d.text for d in out[0]] == ["Intro. " + span + "End.", "unique words"]
    assert [d.text for d in out[1]] == ["x"] or [d.text for d in out[1]] == ["x "]
    assert stats["dropped"] == {"dedup:suffix_array": 1} and stats["docs_modified"] == 1
    assert stats["info"]["removed_bytes"] == stats["modified"]["dedup:suffix_array_bytes"] + len(span.strip())


@pytest.mark.parametrize("step", [ExactDedup(), ExactDedup(ExactDedupConfig(filter="bloom")), MinHashDedup(),
                                  SimHashDedup(), SuffixArrayDedup()], ids=lambda s: s.config.__class__.__name__)
def test_empty_shards_pass_through(tmp_path, step):
    out, stats = run_global(step, [[], as_docs(["only one document here"], "x"), []], tmp_path / "a")
    assert [len(o) for o in out] == [0, 1, 0] and not stats.get("dropped")
    out, stats = run_global(step, [[], []], tmp_path / "b")  # nothing at all
    assert out == [[], []] and not stats.get("dropped")


def test_missing_stage_files_and_bad_configs_are_clear_errors(tmp_path):
    step = MinHashDedup(MinHashConfig())
    with pytest.raises(DataError, match="stage 1"):
        step.prepare(StepContext(work_dir=tmp_path), 1)
    with pytest.raises(ConfigError, match="dedup_exact"):
        ExactDedup(ExactDedupConfig(filter="cuckoo"))
    with pytest.raises(ConfigError, match="work directory"):
        ExactDedup().index(iter([]), StepContext())
    assert isinstance(ExactDedup().config, ExactConfig)


PIPELINE = """
[input]
path = "{raw}"
text_files_per_shard = 5
[output]
dir = "{out}"
[tokenize]
enabled = false
[run]
executor = "local"
workers = 2
progress = "none"
[[step]]
type = "dedup_exact"
[[step]]
type = "dedup_minhash"
[[step]]
type = "dedup_exact"
name = "paragraphs"
unit = "paragraph"
[[step]]
type = "dedup_suffix_array"
min_length = 60
"""


def _write_corpus(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    docs = random_docs(12, seed=13)
    boiler = "Copyright notice: all of these words belong to the kiln test corpus authors."
    span = "an identical sentence quoted inside two different paragraphs of the corpus"
    docs[2] += " " + span + " closing words"
    docs[3] = "opening words " + span + " " + docs[3]
    texts = [f"{d}\n\n{boiler}" for d in docs] + [docs[0] + f"\n\n{boiler}", edit_words(docs[1], 1)]
    for i, text in enumerate(texts):
        (raw / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return raw, boiler, span


def _run(tmp_path, raw, executor):
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    config = tmp_path / f"prep-{executor}.toml"
    text = PIPELINE.format(raw=raw, out=tmp_path / executor).replace('"local"', f'"{executor}"')
    config.write_text(text, encoding="utf-8")
    return run_prep(load_prep_config(config))


@pytest.mark.timeout(180)
def test_pipeline_with_dedup_steps_under_local_executor(tmp_path):
    raw, boiler, span = _write_corpus(tmp_path)
    steps = _run(tmp_path, raw, "local")["steps"]
    assert steps["dedup_exact"]["dropped"] == {"dedup:exact": 1}  # the verbatim copy of doc 0
    assert steps["dedup_minhash"]["dropped"] == {"dedup:minhash": 1}  # the edited copy of doc 1
    assert steps["paragraphs"]["modified"] == {"dedup:exact_paragraph": 11}  # boilerplate after the first
    assert steps["dedup_suffix_array"]["docs_modified"] == 1
    kept = {d["id"]: d["text"] for f in sorted((tmp_path / "local" / "documents").glob("*"))
            for d in map(json.loads, _read_lines(f))}
    assert len(kept) == 12 and "doc12.txt" not in kept and "doc13.txt" not in kept
    assert sum(boiler in t for t in kept.values()) == 1  # the paragraph step keeps its first copy
    assert span in kept["doc02.txt"] and span not in kept["doc03.txt"]  # first occurrence kept
    # MinHash's LSH bands ran as parallel prepare parts (one task per band) before its prepare
    from kiln.prep.dedup.minhash import MinHashConfig

    parts = list((tmp_path / "local").rglob("*prepare-*-part-*"))
    assert len(parts) == MinHashConfig().bands_rows()[0]


@pytest.mark.timeout(240)
def test_ray_executor_gives_the_same_dedup_output(tmp_path):
    pytest.importorskip("ray")
    from prep_testlib import output_files

    raw, _, _ = _write_corpus(tmp_path)
    local = _run(tmp_path, raw, "local")["steps"]
    ray = _run(tmp_path, raw, "ray")["steps"]
    assert {k: v["dropped"] for k, v in local.items()} == {k: v["dropped"] for k, v in ray.items()}
    assert output_files(tmp_path / "local") == output_files(tmp_path / "ray")


def _read_lines(path):
    import zstandard

    data = path.read_bytes()
    if path.name.endswith(".zst"):
        data = zstandard.ZstdDecompressor().stream_reader(data).read()
    return [line for line in data.decode().splitlines() if line.strip()]
