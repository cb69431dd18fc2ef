"""Validation perplexity split over data-parallel ranks (kiln.privacy.validation) == one process.

One process: the same numbers as `kiln eval`'s scorer (kiln.eval.perplexity.evaluate_tokens) on
the same windows. Two gloo FSDP ranks: each rank scores its own block
of the windows (the per-rank token counts add up to the total and neither rank scores all) and
the all-reduced loss/bpb equal one process's within rel 1e-6 (only the order of float64 sums and
the batch boundaries differ; a rank scoring every window, or a missing all-reduce, fails it).
The stream has a ragged tail and an odd number of windows, so the ranks run different numbers of
batches and need the idle forwards to finish at all (FSDP's forwards are collectives).
"""

import numpy as np
import pytest
import torch

from kiln.data.tokenizer import ByteTokenizer

SEQ_LEN, TOKENS = 16, 9 * 16 + 7  # 9 full windows, then a ragged tail of 7 predictions


def _model():
    from kiln.config import load_config
    from kiln.model.transformer import Transformer

    cfg = load_config(None, ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16",
                             "data.seq_len=16", "data.tokenizer=byte"]).model
    cfg.vocab_size = ByteTokenizer().vocab_size
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def _ids():
    return np.random.default_rng(0).integers(0, 256, 400).astype(np.int64)


def _score(model, shard, doc_offsets=None):
    from kiln.privacy.validation import validation_score

    return validation_score(model, ByteTokenizer(), _ids(), seq_len=SEQ_LEN, batch_size=8, max_tokens=TOKENS,
                            shard=shard, doc_offsets=doc_offsets)


# a packed_masked run's validation (kiln unlearn passes the shards' document offsets); the last
# offsets lie beyond the TOKENS + 1 scored
DOCS = np.array([0, 5, 9, 30, 31, 60, 100, 140, 150, 160, 300, 400])


@pytest.mark.parametrize("doc_offsets", [None, DOCS])
def test_one_process_matches_the_eval_scorer(doc_offsets):
    from kiln.eval.perplexity import evaluate_tokens
    from kiln.privacy.metrics import Shard

    model = _model()
    ours = _score(model, Shard(), doc_offsets)
    ref = evaluate_tokens(model, ByteTokenizer(), _ids(), seq_len=SEQ_LEN, batch_size=8, max_tokens=TOKENS,
                          doc_offsets=doc_offsets)
    if doc_offsets is not None:  # masked: not the unmasked numbers
        assert ours["loss"] != pytest.approx(_score(model, Shard())["loss"], rel=1e-6)
    assert ours["tokens"] == ref["tokens"] == TOKENS and ours["rank_tokens"] == [TOKENS]
    for key in ("loss", "ppl", "bpb"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-12), key
    assert ours["bytes"] == ref["bytes"]


def _rank(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kiln.privacy.metrics import Shard

    model = _model()
    mesh = init_device_mesh("cpu", (n,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _score(model, Shard(rank, n, "cpu"))


@pytest.mark.timeout(120)
def test_two_fsdp_ranks_split_the_windows_and_match_one_process(tmp_path):
    from parallel.ranks import run_ranks

    from kiln.privacy.metrics import Shard

    one = _score(_model(), Shard())
    a, b = run_ranks(_rank, 2, tmp_path, timeout=100)
    assert a == b  # every rank returns the same numbers
    # 10 windows: 5 each; rank 1 holds the ragged tail (4 full windows + 7 predictions), so in
    # batches of 8 rank 0 runs one forward and rank 1 two (the tail is a batch of its own).
    assert a["rank_tokens"] == [5 * SEQ_LEN, 4 * SEQ_LEN + 7] and a["tokens"] == one["tokens"] == TOKENS
    for key in ("loss", "ppl", "bpb"):
        assert a[key] == pytest.approx(one[key], rel=1e-6), key
    assert a["bytes"] == one["bytes"]
