"""Unit checks of the memorization metrics and canary helpers (no training)."""

import math

import pytest
import torch

from kiln.config import ModelConfig
from kiln.data.tokenizer import build_tokenizer
from kiln.model.transformer import Transformer
from kiln.privacy.canaries import canary_docs, interleave, make_canaries
from kiln.privacy.metrics import exposure, ngram_overlap, sequence_nll, token_nll


@pytest.fixture(scope="module")
def model_and_tok():
    tok = build_tokenizer("byte", 0, [])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2, max_seq_len=32))
    model.init_weights()
    return model.eval(), tok


def test_ngram_overlap():
    assert ngram_overlap([1, 2, 3, 4], [1, 2, 3, 4], 2) == 1.0
    assert ngram_overlap([9, 9, 9], [1, 2, 3], 2) == 0.0
    assert ngram_overlap([1, 2, 7, 3, 4], [1, 2, 3, 4], 2) == pytest.approx(2 / 3)  # (1,2) and (3,4) of 3


def test_exposure_enumerates_small_spaces_and_ranks_by_nll(model_and_tok):
    model, tok = model_and_tok
    result = exposure(model, tok, "code ", "4-2", 2, candidates=1000)
    assert result["exact"] and result["candidates"] == 100
    secrets = [f"{a}-{b}" for a in range(10) for b in range(10)]
    nll = sequence_nll(model, [tok.encode("code " + s) for s in secrets])
    rank = 1 + sum(v < nll[secrets.index("4-2")] for v in nll)
    assert result["rank"] == rank
    assert result["exposure"] == pytest.approx(math.log2(100) - math.log2(rank))
    sampled = exposure(model, tok, "code ", "4-2-1-7", 4, candidates=50)
    assert not sampled["exact"] and sampled["candidates"] == 51 and sampled["exposure"] <= math.log2(51)


def test_padding_does_not_change_a_sequence_score(model_and_tok):
    model, tok = model_and_tok
    a, b = tok.encode("short"), tok.encode("a much longer sequence")
    assert sequence_nll(model, [a])[0] == pytest.approx(sequence_nll(model, [a, b])[0], rel=1e-5)
    nll, hits = token_nll(model, [a, b])
    assert (nll[0, len(a) - 1:] == 0).all() and not hits[0, len(a) - 1:].any()


def test_canaries_are_distinct_and_interleaved_in_order():
    canaries = make_canaries(5, 3, 2, seed=1)
    assert len({c.secret for c in canaries}) == 10 and sum(c.heldout for c in canaries) == 5
    assert all(c.text == "my code is " + c.secret and len(c.secret) == 3 for c in canaries)
    docs = canary_docs(canaries, seed=1, val_fraction=0.5)
    from kiln.data.corpus import is_val

    assert len(docs) == 15 and not any(is_val(d.id, 0.5) for d in docs)
    from kiln.data.documents import Doc

    base = [Doc(str(i), f"t{i}") for i in range(7)]
    mixed = interleave(base, docs, seed=1)
    assert [d for d in mixed if d in base] == base and [d for d in mixed if d in docs] == docs
    with pytest.raises(ValueError):
        make_canaries(60, 1, 2, seed=0)


def test_batched_greedy_decoding_matches_generate(model_and_tok):
    from kiln.model.generate import generate
    from kiln.privacy.metrics import Shard, extraction_likelihood, greedy_suffixes, sequence_metrics

    model, tok = model_and_tok
    texts = ["my code is 1-2-3", "abc", "a longer line of text"]
    seqs = [tok.encode(t) for t in texts]
    for stride in (1, 3):
        got = greedy_suffixes(model, seqs, stride, batch=2)  # batch=2: the sequences in two groups
        for s, gens in zip(seqs, got):
            starts = list(range(1, len(s), stride))
            assert gens == [generate(model, s[:t], max_new_tokens=len(s) - t, temperature=0.0) for t in starts]
    els = [m["el"] for m in sequence_metrics(model, tok, [{"text": t} for t in texts], ngram=2)]
    assert els == pytest.approx([extraction_likelihood(model, s, 2) for s in seqs])
    assert Shard(1, 2).block([10, 11, 12]) == ([12, 10], 1)  # rank 1's block, padded with a copy
