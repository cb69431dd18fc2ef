"""Sharded connected components equal scipy's single-process clustering, and resume safely."""

import os

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
