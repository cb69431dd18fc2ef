"""data.windows = "packed_masked": contiguous windows whose attention stays within documents."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.data.loader import Loader, TokenWindows
from kiln.data.shards import ShardSet, ShardWriter, write_meta
from kiln.errors import DataError
from kiln.model.transformer import Transformer, document_mask
from kiln.train.step import train_step


def doc_shards(tmp_path, lengths, vocab=97):
    w = ShardWriter(tmp_path, "train", vocab_size=vocab, eos_id=vocab - 1, shard_tokens=200)
    rng = np.random.default_rng(1)
    for n in lengths:
        w.add(rng.integers(0, vocab - 1, n))
    w.finish()
    write_meta(tmp_path, [w])
    return ShardSet(tmp_path, "train")


def tiny_model(**kw) -> Transformer:
    cfg = ModelConfig(**{"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                         "max_seq_len": 32, **kw})
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def test_doc_ids_follow_the_document_index(tmp_path):
    shards = doc_shards(tmp_path, [5, 40, 3, 70, 12, 9, 33, 50, 8, 61])
    w = TokenWindows(shards, seq_len=16, doc_ids=True)
    plain = TokenWindows(shards, seq_len=16)
    idx = np.arange(len(w))
    assert np.array_equal(w.gather(idx), plain.gather(idx))  # windows stay contiguous
    ids = w.gather_doc_ids(idx)
    stream, start = w._locate(idx)
    for row, (s, a) in enumerate(zip(stream.tolist(), start.tolist())):
        docs = np.asarray(shards.docs[s])
        absolute = np.searchsorted(docs, a + np.arange(17), side="right") - 1
        assert np.array_equal(ids[row], absolute - absolute[0])
    assert (ids.max(axis=1) > 0).any()  # some windows do span documents
    x, y, d = Loader(w, 4, seed=0).next()
    assert x.shape == y.shape == d.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_corrupted_document_index_is_refused(tmp_path):
    doc_shards(tmp_path, [20, 30, 40])
    np.save(tmp_path / "train-00000.docs.npy", np.array([0, 50, 30, 90], dtype=np.int64))
    with pytest.raises(DataError, match=r"train-00000\.docs\.npy: corrupted document index"):
        TokenWindows(ShardSet(tmp_path, "train"), seq_len=8, doc_ids=True)


def test_document_mask_is_block_diagonal_causal():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 2), (2, 5), (5, 6)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("kw", [{}, {"norm": "layernorm", "activation": "gelu"}])
def test_packed_masked_losses_equal_each_document_alone(kw):
    """Per-document losses of a packed window equal running each document alone (RoPE: positions
    stay global in the window, attention scores only see relative positions)."""
    model = tiny_model(**kw)
    gen = torch.Generator().manual_seed(3)
    lengths = [[7, 12, 5], [24], [1, 10, 13]]  # two windows of 24 (+1 target) tokens
    rows, ids = [], []
    for doc_lengths in lengths:
        docs = [torch.randint(0, 96, (n,), generator=gen) for n in doc_lengths]
        rows.append(torch.cat(docs + [torch.randint(0, 96, (1,), generator=gen)]))
        ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths)] + [torch.tensor([99])]))
    batch, doc_ids = torch.stack(rows), torch.stack(ids)
    x, y, d = batch[:, :-1], batch[:, 1:], doc_ids[:, :-1]
    with torch.no_grad():
        logits = model(x, doc_ids=d)
        unmasked = model(x)
    for row, doc_lengths in enumerate(lengths):
        start = 0
        for n in doc_lengths:
            doc = batch[row, start:start + n]
            if n > 1:
                with torch.no_grad():
                    alone = model(doc[None, :-1])
                packed = logits[row, start:start + n - 1]
                torch.testing.assert_close(packed, alone[0], rtol=1e-4, atol=1e-4)
                alone_loss = F.cross_entropy(alone[0], doc[1:])
                torch.testing.assert_close(F.cross_entropy(packed, doc[1:]), alone_loss, rtol=1e-4, atol=1e-5)
            start += n
    # the mask matters: without it, later documents see earlier ones
    assert not torch.allclose(logits[0, 7:19], unmasked[0, 7:19], atol=1e-3)
    # one document per window: the mask is plain causal attention
    torch.testing.assert_close(logits[1], unmasked[1], rtol=1e-5, atol=1e-5)


def test_train_step_passes_the_document_mask(tmp_path):
    w = TokenWindows(doc_shards(tmp_path, [9, 30, 4, 50, 20, 17, 60]), seq_len=16, doc_ids=True)
    batch = Loader(w, 4, seed=0).next()
    assert len(batch) == 3
    losses = []
    for micro in ([batch], [batch[:2]]):
        model = tiny_model().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loss, _, _ = train_step(model, opt, micro, autocast=torch.autocast("cpu", enabled=False), scaler=None,
                                clip=0.0)
        losses.append(loss)
    with torch.no_grad():
        masked = tiny_model()(batch[0], batch[1], doc_ids=batch[2])
    torch.testing.assert_close(losses[0], masked)
    assert not torch.allclose(losses[0], losses[1])


def test_a_mixture_carries_each_sources_document_ids(tmp_path):
    """MixtureWindows over packed sources: each window's document ids are its own source's (a
    document ends after each EOS token), and the Loader yields them as a third tensor."""
    from kiln.data.mixture import MixtureWindows

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sources = [TokenWindows(doc_shards(tmp_path / name, lengths), seq_len=16, doc_ids=True)
               for name, lengths in (("a", [5, 40, 3, 70, 12, 9, 33]), ("b", [20, 7, 7, 7, 50, 11, 64]))]
    mixture = MixtureWindows(sources, [0.5, 0.5], seed=0, block=8)
    assert mixture.carries_doc_ids
    positions = np.arange(24)
    tokens, ids = mixture.gather(positions), mixture.gather_doc_ids(positions)
    assert np.array_equal(np.diff(ids, axis=1), tokens[:, :-1] == 96)  # EOS (vocab - 1) ends a document
    assert (ids[:, 0] == 0).all() and ids.max() > 0
    x, y, d = Loader(mixture, 4, seed=0).next()
    assert x.shape == y.shape == d.shape == (4, 16)
    plain = MixtureWindows([TokenWindows(s.shards, seq_len=16) for s in sources], [0.5, 0.5], seed=0, block=8)
    assert not plain.carries_doc_ids and len(Loader(plain, 4, seed=0).next()) == 2


def test_trainer_runs_packed_masked_also_on_a_mixture(tmp_path, short_docs_dir):
    from conftest import tiny_overrides

    from kiln.config import load_config
    from kiln.data.raw_to_shards import prepare_shards
    from kiln.train.trainer import train

    over = {"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 0, "metrics.log_every": 1,
            "optim.lr": 0.1, "data.windows": '"packed_masked"'}
    result = train(load_config(None, tiny_overrides(short_docs_dir, **over)), tmp_path / "run")
    assert result is not None and (tmp_path / "run" / "metrics.jsonl").is_file()

    def mixture_losses(windows):
        cfg = load_config(None, tiny_overrides(short_docs_dir, **{**over, "data.windows": windows}))
        cfg.data.shards_dir = str(tmp_path / "shards")
        prepare_shards(cfg.data, tmp_path)
        cfg.data.mixture, cfg.data.mixture_weights = [cfg.data.shards_dir] * 2, [0.5, 0.5]
        train(cfg, tmp_path / f"mix-{windows}")
        rows = (json.loads(x) for x in (tmp_path / f"mix-{windows}" / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in rows if r["kind"] == "train"]

    masked, unmasked = mixture_losses('"packed_masked"'), mixture_losses('"contiguous"')
    assert len(masked) == 2 and masked[1] != unmasked[1]  # the mixture's windows were masked


# ------------------------------------------------- evaluation: scored as the model was trained


def test_in_memory_streams_with_ragged_tails_carry_document_ids():
    """doc_offsets for in-memory streams (eval sets, `kiln eval`): every window's ids, the ragged
    tail's too, shaped as its tokens; window_batches hands them on as score_batches' 4th field."""
    from kiln.data.loader import window_batches

    streams = [np.arange(45) % 90, np.arange(20) % 90]
    offsets = [np.array([0, 3, 17, 18, 40, 45]), np.array([0, 20])]
    w = TokenWindows(streams, seq_len=8, ragged_tail=True, doc_offsets=offsets)
    assert w.ragged_tail and w.carries_doc_ids and len(w) == 6 + 3
    for k in range(len(w)):
        tokens, ids = w.gather(np.array([k])), w.gather_doc_ids(np.array([k]))
        assert ids.shape == tokens.shape
        stream, start = w._locate(np.array([k]))
        absolute = np.searchsorted(offsets[int(stream[0])], start[0] + np.arange(tokens.shape[1]), side="right")
        assert np.array_equal(ids[0], absolute - absolute[0])
    assert w.gather_doc_ids(np.array([2]))[0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 2]  # tokens 16..24
    batches = list(window_batches(w, np.arange(len(w)), 4))
    assert all(len(b) == 4 and b[2] == len(b[0]) and b[3].shape == b[0].shape for b in batches)
    assert sum(b[2] for b in batches) == len(w)
    with pytest.raises(DataError, match=r"the text \(stream 1\): corrupted document index"):
        TokenWindows(streams, seq_len=8, source="the text", doc_offsets=[offsets[0], np.array([0, 5, 19])])


def test_stream_prefix_cuts_the_document_offsets_with_the_tokens():
    from kiln.eval.perplexity import stream_prefix

    ids, offsets = stream_prefix(np.arange(30), 10, np.array([0, 4, 11, 12, 30]))
    assert len(ids) == 11 and offsets[0].tolist() == [0, 4, 11]
    ids, offsets = stream_prefix(np.arange(30), 0, np.array([0, 4, 30]))
    assert len(ids) == 30 and offsets[0].tolist() == [0, 4, 30]
    assert stream_prefix(np.arange(30), 10)[1] is None


def test_masked_scoring_equals_the_masked_forward_window_by_window():
    """evaluate_texts(masked=True): each text a document (ending in its EOS) that attention does
    not cross, in every window, the ragged tail's too; the same sums as the masked forward by hand."""
    from kiln.data.tokenizer import ByteTokenizer
    from kiln.eval.perplexity import evaluate_texts

    tok = ByteTokenizer()
    model = tiny_model(vocab_size=tok.vocab_size)
    texts = ["the cat sat", "on a mat today", "x", "and then it left the room quietly"]
    docs = [np.append(tok.encode_array(t), tok.eos_id) for t in texts]
    stream = torch.from_numpy(np.concatenate(docs).astype(np.int64))
    doc_of = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(stream) - 1, 16):
            window, ids = stream[a:a + 17], doc_of[a:a + 17]
            logits = model(window[None, :-1], doc_ids=ids[None, :-1] - ids[0])
            total += float(F.cross_entropy(logits[0], window[1:], reduction="sum"))
            count += len(window) - 1
    got = evaluate_texts(model, tok, texts, seq_len=16, batch_size=2, masked=True)
    assert got["tokens"] == count and got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert evaluate_texts(model, tok, texts, seq_len=16, batch_size=2)["loss"] != pytest.approx(got["loss"], rel=1e-4)
    one = [texts[-1]]  # one document: the mask is plain causal attention
    assert evaluate_texts(model, tok, one, seq_len=16, masked=True)["loss"] == pytest.approx(
        evaluate_texts(model, tok, one, seq_len=16)["loss"], rel=1e-5)
