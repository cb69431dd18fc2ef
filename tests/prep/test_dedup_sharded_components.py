"""Sharded connected components equal scipy's single-process clustering, and resume safely."""

import json

import numpy as np
import pytest

from kiln.errors import DataError
from kiln.prep.dedup.components import components_keep_lowest
from kiln.prep.dedup.sharded_components import sharded_duplicates, sharded_keep_lowest


def write_edges(tmp_path, u, v, n_files=3):
    files = []
    for i, (a, b) in enumerate(zip(np.array_split(u, n_files), np.array_split(v, n_files))):
        path = tmp_path / f"edges-{i}.npy"
        np.save(path, np.stack([a, b]).astype(np.int64))
        files.append(path)
    return files


def random_graph(rng, n, m):
    return rng.integers(0, n, m), rng.integers(0, n, m)


@pytest.mark.parametrize("seed", range(6))
def test_equals_scipy_on_random_graphs(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    u, v = random_graph(rng, n, int(rng.integers(0, 2 * n)))
    files = write_edges(tmp_path, u, v)
    parts = int(rng.integers(1, 6))
    np.testing.assert_array_equal(sharded_keep_lowest(n, files, tmp_path / "cc", parts),
                                  components_keep_lowest(n, u, v))


def test_long_chain_and_reversed_ids(tmp_path):
    n = 2000
    perm = np.random.default_rng(0).permutation(n)  # one component, long diameter, shuffled ids
    u, v = perm[:-1], perm[1:]
    files = write_edges(tmp_path, u, v, n_files=2)
    dup, info = sharded_duplicates(n, files, tmp_path / "cc", 4)
    np.testing.assert_array_equal(dup, np.arange(1, n))
    assert info["rounds"] < 30


def test_resume_after_interrupted_run(tmp_path):
    rng = np.random.default_rng(7)
    n = 300
    u, v = random_graph(rng, n, 250)
    files = write_edges(tmp_path, u, v)
    expected = components_keep_lowest(n, u, v)
    calls = []

    def failing_map(fn, args):
        out = []
        for a in args:
            if fn.__name__ == "small_task" and calls.count("small_task") == 1:
                raise KeyboardInterrupt  # the run dies half-way through a phase
            calls.append(fn.__name__)
            out.append(fn(*a))
        return out

    with pytest.raises(KeyboardInterrupt):
        sharded_keep_lowest(n, files, tmp_path / "cc", 3, failing_map)
    d = tmp_path / "cc" / "P3"
    # debris of an interrupted run: a truncated output file, a garbled marker, a temp file
    victim = d / "large000-from00000.npy"
    victim.write_bytes(victim.read_bytes()[:20])
    (d / "init-00001.json").write_text("{not json")
    (d / ".tmp-leftover.npy").write_bytes(b"\x93NUMPY")
    np.testing.assert_array_equal(sharded_keep_lowest(n, files, tmp_path / "cc", 3), expected)


def test_bad_input_edge_files_are_clear_errors(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.array([[0], [1]]))
    with pytest.raises(DataError, match="missing edge file"):
        sharded_duplicates(3, [tmp_path / "none.npy"], tmp_path / "a", 2)
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00garbage")
    with pytest.raises(DataError, match="unreadable edge file"):
        sharded_duplicates(3, [bad], tmp_path / "b", 2)
    np.save(bad, np.array([[0], [5]]))
    with pytest.raises(DataError, match="outside"):
        sharded_duplicates(3, [bad], tmp_path / "c", 2)
    obj = tmp_path / "obj.npy"
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="unreadable"):  # never unpickled
        sharded_duplicates(3, [obj], tmp_path / "d", 2)
    dup, _ = sharded_duplicates(3, [good], tmp_path / "e", 2)
    assert dup.tolist() == [1]


@pytest.mark.parametrize("verify", ["exact", "signature", "none"])
def test_minhash_step_with_cluster_parts_equals_scipy_clustering(tmp_path, verify):
    from kiln.prep.base import Doc, StepContext
    from kiln.prep.dedup.minhash import MinHashConfig
    from kiln.prep.dedup.steps import MinHashDedup

    from tests.prep.dedup_testdata import edit_words, random_docs

    texts = random_docs(24, words=80, seed=3)
    texts += [edit_words(texts[i], i % 3 + 1, seed=i) for i in (1, 5, 5, 9, 20)]  # a cluster of 3 too
    shards = [[Doc(f"{s}-{i}", t) for i, t in enumerate(texts[s::3])] for s in range(3)]
    results = {}
    for parts in (0, 4):
        step = MinHashDedup(MinHashConfig(verify=verify, cluster_parts=parts))
        work = tmp_path / f"p{parts}"
        for i, docs in enumerate(shards):
            step.index(iter(docs), StepContext(shard_index=i, n_shards=3, work_dir=work))
        n_parts = step.prepare_parts(3)
        for p in range(0, n_parts, 2):  # some bands in parallel tasks, the rest left to prepare
            step.prepare_part(StepContext(n_shards=3, work_dir=work), 3, p, n_parts)
        ctx = StepContext(n_shards=3, work_dir=work)
        if parts:
            step.prepare_sharded(ctx, 3, lambda fn, args: [fn(*a) for a in args])
        step.prepare(ctx, 3)
        kept = []
        for i, docs in enumerate(shards):
            run_ctx = StepContext(shard_index=i, n_shards=3, work_dir=work)
            step.setup(run_ctx)
            kept += [d.id for d in step.run(iter(docs), run_ctx)]
        results[parts] = (kept, ctx.stats[step.name]["info"]["clusters_dropped"])
    assert results[0] == results[4]
    assert results[0][1] >= 2  # near-duplicates were found, so the comparison means something


def test_executor_runs_sharded_clustering_as_tasks(tmp_path, monkeypatch):
    """`kiln prep` with dedup_minhash cluster_parts=3 on 2 worker processes: same output as scipy."""
    from kiln.prep.dedup.steps import MinHashDedup
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    from tests.prep.dedup_testdata import edit_words, random_docs

    raw = tmp_path / "raw"
    raw.mkdir()
    texts = random_docs(12, words=80, seed=4)
    texts += [edit_words(texts[i], 1, seed=i) for i in (0, 3, 3)]
    for i, t in enumerate(texts):
        (raw / f"d{i:02d}.txt").write_text(t, encoding="utf-8")
    outputs, maps = {}, []
    original = MinHashDedup.prepare_sharded

    def recording(self, ctx, n_shards, map_fn):
        maps.append(getattr(map_fn, "__self__", None))  # the executor's runner, not a local loop
        return original(self, ctx, n_shards, map_fn)

    monkeypatch.setattr(MinHashDedup, "prepare_sharded", recording)
    for parts in (0, 3):
        out = tmp_path / f"out{parts}"
        cfg = tmp_path / f"p{parts}.toml"
        cfg.write_text(f'[input]\npath = "{raw}"\ntext_files_per_shard = 4\n[output]\ndir = "{out}"\ndocs_format = "jsonl"\n'
                       '[tokenize]\nenabled = false\n[run]\nworkers = 2\nprogress = "none"\n'
                       f'[[step]]\ntype = "dedup_minhash"\ncluster_parts = {parts}\n', encoding="utf-8")
        report = run_prep(load_prep_config(cfg))
        outputs[parts] = sorted(json.loads(line)["id"] for f in sorted(out.glob("documents/*")) for line in
                                f.read_text(encoding="utf-8").splitlines())
        assert report["steps"]["dedup_minhash"]["info"]["clusters_dropped"] == 3
    assert (tmp_path / "out3" / ".work").exists() and any((tmp_path / "out3" / ".work").rglob("large000-*.json"))
    assert outputs[0] == outputs[3] and len(outputs[0]) == 12
    assert len(maps) == 2 and all(type(m).__name__.endswith("Runner") for m in maps)
