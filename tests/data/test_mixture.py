import numpy as np
import pytest
import torch

from kiln.data.loader import Loader, TokenWindows
from kiln.data.mixture import MixtureWindows, block_counts
from kiln.errors import ConfigError


def source(value, n_windows, seq_len=8):
    """Windows whose every token is `value`: a batch row says which source it came from."""
    return TokenWindows([np.full(n_windows * seq_len + 1, value, dtype=np.int64)], seq_len)


def mixture(**kw):
    kw.setdefault("block", 64)
    return MixtureWindows([source(0, 50), source(1, 30), source(2, 7)], [0.5, 0.3, 0.2], seed=3, **kw)


def rows_source(batches):
    return torch.cat([x[:, 0] for x in batches]).tolist()


def test_block_counts_follow_the_weights_exactly():
    assert block_counts([0.5, 0.3, 0.2], 64).tolist() == [32, 19, 13]
    assert block_counts([1, 1, 1], 10).sum() == 10


def test_mix_is_deterministic_and_matches_weights():
    a, b = Loader(mixture(), 8, seed=0), Loader(mixture(), 8, seed=0)
    got = rows_source([a.next()[0] for _ in range(64)])  # 8 blocks
    assert got == rows_source([b.next()[0] for _ in range(64)])
    assert np.bincount(got).tolist() == [256, 152, 104]
    assert mixture().realized(512) == {f"source{i}": {"samples": n, "tokens": n * 8}
                                       for i, n in enumerate([256, 152, 104])}


def test_a_small_source_cycles_through_all_its_windows():
    m = mixture()
    src, win = m._locate(np.arange(640))
    seen = win[src == 2]
    assert len(seen) >= 14 and sorted(seen[:7].tolist()) == list(range(7))  # one full pass first


def test_exact_resume_across_dp_sizes():
    full = Loader(mixture(), 8, seed=0)
    want = [full.next()[0] for _ in range(20)]
    ranks = [Loader(mixture(), 2, seed=0, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(7):
        for r in ranks:
            r.next()
    state = ranks[0].state_dict()  # 7 steps of 4 ranks x 2 = 56 positions = 7 steps of 8
    pair = [Loader(mixture(), 4, seed=0, dp_rank=r, dp_size=2) for r in range(2)]
    for p in pair:
        p.load_state_dict(state)
    for step in range(7, 20):
        got = torch.cat([p.next()[0] for p in pair])
        assert torch.equal(got, want[step])


def test_schedule_changes_the_weights_from_its_position():
    m = mixture(schedule=[(128, [0.0, 0.0, 1.0])])
    src, _ = m._locate(np.arange(256))
    assert set(src[128:].tolist()) == {2} and set(src[:128].tolist()) == {0, 1, 2}
    assert m.realized(256)["source2"]["samples"] == 2 * 13 + 128


@pytest.mark.parametrize("weights", [[1, 1], [1, -1, 1], [0, 0, 0], [1, float("nan"), 1]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ConfigError, match="weights"):
        MixtureWindows([source(0, 5), source(1, 5), source(2, 5)], weights, seed=0)


def test_config_needs_one_weight_per_source():
    from kiln.config import load_config

    with pytest.raises(ConfigError, match="data.mixture has 2 sources but data.mixture_weights has 1"):
        load_config(None, ["data.mixture=['a', 'b']", "data.mixture_weights=[1.0]"])
    with pytest.raises(ConfigError, match="data.mixture_weights"):
        load_config(None, ["data.mixture=['a']", "data.mixture_weights=[-1.0]"])
