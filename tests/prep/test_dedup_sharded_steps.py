"""dedup_simhash with `cluster_parts`: same output as scipy's clustering, in-process, through the
local executor and through Ray (for dedup_minhash too)."""

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.errors import ConfigError, DataError
from kiln.prep.base import Doc, StepContext
from kiln.prep.dedup.simhash import SimHashConfig, identical_pairs, near_pairs, table_pairs
from kiln.prep.dedup.steps import SimHashDedup

from tests.prep.dedup_testdata import edit_words, random_docs

sys.path.insert(0, str(Path(__file__).parent))
from prep_testlib import output_files  # noqa: E402


def near_duplicate_corpus(seed: int, n: int = 30) -> list[str]:
    """Random documents, exact copies and lightly edited copies (chains of edits too), shuffled."""
    rng = random.Random(seed)
    texts = random_docs(n, words=60, seed=seed)
    for _ in range(n // 2):
        source = rng.choice(texts)
        texts.append(source if rng.random() < 0.3 else edit_words(source, rng.randint(1, 3), seed=rng.randrange(10**6)))
    rng.shuffle(texts)
    return texts


def run_step(step: SimHashDedup, shards: list[list[Doc]], work: Path) -> tuple[list[str], dict]:
    n = len(shards)
    for i, docs in enumerate(shards):
        step.index(iter(docs), StepContext(shard_index=i, n_shards=n, work_dir=work))
    n_parts = step.prepare_parts(n)
    for p in range(0, n_parts, 2):  # some tables in parallel tasks, the rest left to prepare_sharded
        step.prepare_part(StepContext(n_shards=n, work_dir=work), n, p, n_parts)
    ctx = StepContext(n_shards=n, work_dir=work)
    if step.config.cluster_parts:
        step.prepare_sharded(ctx, n, lambda fn, args: [fn(*a) for a in args])
    step.prepare(ctx, n)
    kept = []
    for i, docs in enumerate(shards):
        run_ctx = StepContext(shard_index=i, n_shards=n, work_dir=work)
        step.setup(run_ctx)
        kept += [d.id for d in step.run(iter(docs), run_ctx)]
    return kept, ctx.stats[step.name]["info"]


def test_table_pairs_union_is_near_pairs():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**63, 40, dtype=np.uint64)
    flips = np.uint64(1) << rng.integers(0, 64, (60, 3)).astype(np.uint64)
    fps = np.concatenate([base, base[:20] ^ flips[:20, 0], base[:20] ^ flips[:20, 0] ^ flips[:20, 1], base[:5]])
    for k in (0, 2, 5):
        pieces = [identical_pairs(fps)] + [table_pairs(fps, k, t) for t in range(k + 1)]
        union = {(int(a), int(b)) for u, v in pieces for a, b in zip(u, v)}
        u, v = near_pairs(fps, k)
        assert union == set(zip(u.tolist(), v.tolist())) and len(union) == len(u) > 0


@pytest.mark.parametrize("seed,max_distance", [(0, 6), (1, 10), (2, 3)])
def test_simhash_step_with_cluster_parts_equals_scipy_clustering(tmp_path, seed, max_distance):
    texts = near_duplicate_corpus(seed)
    shards = [[Doc(f"{s}-{i}", t) for i, t in enumerate(texts[s::3])] for s in range(3)]
    results = {}
    for parts in (0, 1, 4):
        step = SimHashDedup(SimHashConfig(max_distance=max_distance, cluster_parts=parts))
        kept, info = run_step(step, shards, tmp_path / f"p{parts}")
        results[parts] = (kept, info["clusters_dropped"])
        if parts:
            assert info["component_rounds"] >= 1 and info["table_pairs"] >= info["clusters_dropped"]
    assert results[0] == results[1] == results[4]
    assert results[0][1] >= 5  # near-duplicates were found, so the comparison means something


def test_cluster_parts_is_checked():
    with pytest.raises(ConfigError, match="cluster_parts"):
        SimHashDedup(SimHashConfig(cluster_parts=-1))
    with pytest.raises(ConfigError, match="cluster_parts"):
        SimHashDedup(SimHashConfig(cluster_parts=70000))


def test_garbled_table_file_is_a_clear_error(tmp_path):
    step = SimHashDedup(SimHashConfig(cluster_parts=2))
    docs = [Doc(str(i), t) for i, t in enumerate(near_duplicate_corpus(5, n=8))]
    step.index(iter(docs), StepContext(shard_index=0, n_shards=1, work_dir=tmp_path))
    step.prepare_part(StepContext(n_shards=1, work_dir=tmp_path), 1, 0, step.prepare_parts(1))
    table = step._edges_path(tmp_path, 0)
    np.save(table, np.array([[0], [10**6]]))  # a node id no document has
    with pytest.raises(DataError, match=str(table.name)):
        step.prepare(StepContext(n_shards=1, work_dir=tmp_path), 1)


def write_raw(tmp_path: Path, seed: int) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, t in enumerate(near_duplicate_corpus(seed, n=12)):
        (raw / f"d{i:02d}.txt").write_text(t, encoding="utf-8")
    return raw


def write_config(tmp_path: Path, raw: Path, out: Path, steps: str, executor: str = "local") -> Path:
    cfg = tmp_path / f"{out.name}.toml"
    cfg.write_text(f'[input]\npath = "{raw}"\ntext_files_per_shard = 5\n[output]\ndir = "{out}"\ndocs_format = "jsonl"\n'
                   f'[tokenize]\nenabled = false\n[run]\nworkers = 2\nexecutor = "{executor}"\nprogress = "none"\n'
                   + steps, encoding="utf-8")
    return cfg


def test_executor_runs_sharded_simhash_clustering_as_tasks(tmp_path, monkeypatch):
    """`kiln prep` with dedup_simhash cluster_parts=3 on 2 local worker processes: same output as scipy."""
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    raw = write_raw(tmp_path, seed=11)
    maps = []
    original = SimHashDedup.prepare_sharded

    def recording(self, ctx, n_shards, map_fn):
        maps.append(getattr(map_fn, "__self__", None))  # the executor's runner, not a local loop
        return original(self, ctx, n_shards, map_fn)

    monkeypatch.setattr(SimHashDedup, "prepare_sharded", recording)
    outputs, reports = {}, {}
    for parts in (0, 3):
        out = tmp_path / f"out{parts}"
        step = f'[[step]]\ntype = "dedup_simhash"\nmax_distance = 6\ncluster_parts = {parts}\n'
        reports[parts] = run_prep(load_prep_config(write_config(tmp_path, raw, out, step)))
        outputs[parts] = output_files(out)
    info = {p: reports[p]["steps"]["dedup_simhash"] for p in (0, 3)}
    assert info[0]["dropped"] == info[3]["dropped"] and info[0]["dropped"]["dedup:simhash"] >= 3
    assert info[0]["info"]["clusters_dropped"] == info[3]["info"]["clusters_dropped"]
    assert outputs[0] == outputs[3]
    work = tmp_path / "out3" / ".work"
    assert any(work.rglob("simhash-edges-k06-*.npy")) and any(work.rglob("large000-*.json"))
    assert len(maps) == 2 and all(type(m).__name__.endswith("Runner") for m in maps)


@pytest.mark.timeout(240)
def test_ray_executor_runs_sharded_clustering_like_local(tmp_path):
    """run.executor = "ray" with cluster_parts > 0 (MinHash and SimHash): byte-identical output
    to the local executor, and the component phases really ran as Ray tasks."""
    ray = pytest.importorskip("ray")
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    raw = write_raw(tmp_path, seed=12)
    steps = ('[[step]]\ntype = "dedup_minhash"\ncluster_parts = 3\n'
             '[[step]]\ntype = "dedup_simhash"\nmax_distance = 6\ncluster_parts = 2\n')
    local_out, ray_out = tmp_path / "local", tmp_path / "ray"
    local = run_prep(load_prep_config(write_config(tmp_path, raw, local_out, steps)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_prep(load_prep_config(write_config(tmp_path, raw, ray_out, steps, executor="ray")))
    finally:
        ray.shutdown()
    assert output_files(local_out) == output_files(ray_out)
    assert local["steps"] == remote["steps"]
    dropped = sum(local["steps"][s]["dropped"].get(f"dedup:{s[6:]}", 0) for s in ("dedup_minhash", "dedup_simhash"))
    assert dropped >= 3  # duplicates were removed, so identical outputs mean something
    for name, parts in (("dedup_minhash", 3), ("dedup_simhash", 2)):
        markers = list((ray_out / ".work").rglob(f"{name}*/components/P{parts}/large000-*.json"))
        assert len(markers) == parts, name


def test_rerun_after_interrupted_sharded_prepare_gives_the_same_drops(tmp_path):
    texts = near_duplicate_corpus(3)
    shards = [[Doc(f"{s}-{i}", t) for i, t in enumerate(texts[s::2])] for s in range(2)]
    step = SimHashDedup(SimHashConfig(max_distance=6, cluster_parts=3))
    kept, _ = run_step(step, shards, tmp_path)
    drops = [np.load(p) for p in sorted(tmp_path.glob("drop*.npy"))]
    assert drops and len(kept) < len(texts)
    # what a run killed during the component phases leaves: no clusters.json, a table not written,
    # a phase marker missing
    (tmp_path / "clusters.json").unlink()
    step._edges_path(tmp_path, 1).unlink()
    next((tmp_path / "components" / "P3").glob("small000-*.json")).unlink()
    for p in tmp_path.glob("drop*.npy"):
        p.unlink()
    step.prepare(StepContext(n_shards=2, work_dir=tmp_path), 2)
    for before, after in zip(drops, [np.load(p) for p in sorted(tmp_path.glob("drop*.npy"))], strict=True):
        np.testing.assert_array_equal(before, after)
