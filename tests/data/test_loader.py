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
