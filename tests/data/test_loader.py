import numpy as np
import pytest
import torch

from kiln.data.loader import Loader, TokenWindows, epoch_order, eval_batches, leading_batches
from kiln.data.shards import ShardSet, ShardWriter, write_meta
from kiln.errors import DataError


@pytest.fixture()
def windows(tmp_path):
    w = ShardWriter(tmp_path, "train", vocab_size=1000, eos_id=999, shard_tokens=300)
    rng = np.random.default_rng(0)
    for _ in range(10):
        w.add(rng.integers(0, 999, 99))
    w.finish()
    write_meta(tmp_path, [w])
    return TokenWindows(ShardSet(tmp_path, "train"), seq_len=16)


def take(loader, n):
    return [loader.next() for _ in range(n)]


def test_windows_are_contiguous_and_shifted(windows):
    x, y = Loader(windows, 4, seed=0, prefetch=2).next()
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    flat = np.concatenate([np.asarray(t) for t in windows.shards.tokens])
    # every window occurs in the token stream
    for row in torch.cat([x, y[:, -1:]], 1).numpy():
        assert any((flat[i:i + 17] == row).all() for i in range(len(flat) - 16))


def test_deterministic_for_seed(windows):
    a = take(Loader(windows, 4, seed=3), 5)
    b = take(Loader(windows, 4, seed=3), 5)
    c = take(Loader(windows, 4, seed=4), 5)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


def test_resume_continues_on_next_batch(windows):
    full = take(Loader(windows, 4, seed=1, prefetch=3), 30)  # crosses epoch boundaries
    first = Loader(windows, 4, seed=1, prefetch=3)
    take(first, 17)
    state = first.state_dict()
    first.close()
    resumed = Loader(windows, 4, seed=0)
    resumed.load_state_dict(state)
    rest = take(resumed, 13)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(full[17:], rest))


def test_epoch_visits_every_window_once(windows):
    loader = Loader(windows, 2, seed=0)
    n = len(windows) // 2
    seen = torch.cat([x for x, _ in take(loader, n)])
    assert len({tuple(r.tolist()) for r in seen}) == n * 2
    assert loader.epoch == 0
    loader.next()
    assert loader.epoch == 1


def test_dp_ranks_partition_the_global_batch_and_resume_across_dp_sizes(windows):
    single = take(Loader(windows, 4, seed=2), 6)
    ranks = [Loader(windows, 2, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for step in range(6):
        parts = [loader.next()[0] for loader in ranks]
        assert torch.equal(torch.cat(parts), single[step][0])
    # checkpoint from 2 ranks, resume on 1: same global position
    state = ranks[0].state_dict()
    one = Loader(windows, 4, seed=2)
    one.load_state_dict(state)
    expected = take(Loader(windows, 4, seed=2), 8)[6:]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(take(one, 2), expected))


def test_data_wait_is_recorded(windows):
    loader = Loader(windows, 4, seed=0)
    loader.next()
    assert loader.wait_s > 0


def test_errors(windows):
    with pytest.raises(DataError, match="global micro-batch"):
        Loader(windows, 10_000, seed=0)
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenWindows(windows.shards, seq_len=10_000)


def test_eval_batches_fixed_and_spread(windows):
    a = list(eval_batches(windows, 4, 3))
    b = list(eval_batches(windows, 4, 3))
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b))


def test_epoch_order_is_a_permutation():
    order = epoch_order(100, 5, 2)
    assert sorted(order.tolist()) == list(range(100))


def test_stream_windows_with_a_ragged_tail():
    """The windower `kiln eval` uses: a stream's last, shorter window is its own batch."""
    ids = np.arange(40)
    w = TokenWindows([ids], 16, ragged_tail=True)
    assert len(w) == 3 and w.lengths(np.arange(3)).tolist() == [17, 17, 8]
    batches = list(leading_batches(w, 8))
    assert [tuple(x.shape) for x, _ in batches] == [(2, 16), (1, 7)]
    assert batches[1][1][0].tolist() == list(range(33, 40))
    with pytest.raises(ValueError, match="different lengths"):
        w.gather(np.arange(3))
    assert len(TokenWindows([ids], 16)) == 2  # full windows only
    assert len(list(eval_batches(TokenWindows([ids], 16), 1, 5))) == 2


def doc_shards(tmp_path, lengths):
    w = ShardWriter(tmp_path, "train", vocab_size=1000, eos_id=999, shard_tokens=200)
    rng = np.random.default_rng(1)
    for n in lengths:
        w.add(rng.integers(0, 999, n))
    w.finish()
    write_meta(tmp_path, [w])
    return ShardSet(tmp_path, "train")


def test_doc_start_windows_begin_at_documents(tmp_path):
    shards = doc_shards(tmp_path, [5, 40, 3, 70, 12, 9, 33, 50, 8, 61])
    w = TokenWindows(shards, seq_len=16, doc_starts=True)
    stream, start = w._locate(np.arange(len(w)))
    for s, a in zip(stream.tolist(), start.tolist()):
        docs = np.asarray(shards.docs[s])
        doc = np.searchsorted(docs, a, side="right") - 1
        assert (a - docs[doc]) % 16 == 0  # a document start, or a whole number of windows into one
        assert a + 17 <= shards.tokens[s].shape[0]
    # every document start that leaves room for a full window is one
    room = {(s, int(a)) for s, (d, t) in enumerate(zip(shards.docs, shards.tokens))
            for a in np.asarray(d)[:-1] if a + 17 <= t.shape[0]}
    assert room and room <= set(zip(stream.tolist(), start.tolist()))
    x, y = Loader(w, 4, seed=0).next()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_doc_start_windows_resume_across_dp_sizes(tmp_path):
    w = TokenWindows(doc_shards(tmp_path, [30 + 7 * i for i in range(20)]), seq_len=8, doc_starts=True)
    full = take(Loader(w, 4, seed=2), 12)  # one rank, 4 per step
    halves = [Loader(w, 2, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for h in halves:
        take(h, 5)
    state = halves[0].state_dict()
    resumed = Loader(w, 4, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(full[5:], take(resumed, 7)))


def test_corrupted_document_index_names_the_file(tmp_path):
    shards = doc_shards(tmp_path, [20, 30, 40])
    np.save(tmp_path / "train-00000.docs.npy", np.array([0, 50, 30, 93], dtype=np.int64))
    with pytest.raises(DataError, match=r"train-00000\.docs\.npy: corrupted document index"):
        TokenWindows(ShardSet(tmp_path, "train"), seq_len=8, doc_starts=True)
