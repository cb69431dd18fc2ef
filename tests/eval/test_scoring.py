"""One scorer, one windower: the trainer's evaluation, `kiln eval`'s perplexity part and the
robustness probe give the numbers the formulas they replaced gave (kept here as references)."""

import math

import numpy as np
import pytest
import torch

from kiln.config import ModelConfig, load_config
from kiln.data.tokenizer import token_byte_lengths
from kiln.data.loader import TokenWindows, leading_batches
from kiln.data.shards import ShardSet, ShardWriter, write_meta
from kiln.data.tokenizer import ByteTokenizer
from kiln.errors import DataError
from kiln.eval.perplexity import evaluate_texts, evaluate_tokens
from kiln.eval.robustness import robustness_probe
from kiln.eval.scoring import score_batches
from kiln.model.transformer import Transformer, lm_loss
from kiln.train.evaluate import Evaluator

SEQ = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=SEQ))
    m.init_weights()
    return m


def _totals(model, pairs, byte_lengths):
    total, tokens, n_bytes = 0.0, 0, 0
    for x, y in pairs:
        loss = lm_loss(model(x), y)
        total += loss.item() * y.numel()
        tokens += y.numel()
        n_bytes += int(byte_lengths[y].sum())
    loss = total / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": total / math.log(2) / max(n_bytes, 1),
            "tokens": tokens, "bytes": n_bytes}


@torch.no_grad()
def old_evaluate_tokens(model, tokenizer, ids, seq_len, batch_size, max_tokens=0):
    """kiln/eval/perplexity.py:evaluate_tokens before consolidation."""
    ids = torch.as_tensor(np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64))
    starts = list(range(0, ids.numel() - 1, seq_len))
    pairs = []
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        full = [s for s in chunk if s + seq_len + 1 <= ids.numel()]
        for group in ([full] if full else []) + [[s] for s in chunk if s not in full]:
            end = min(seq_len, ids.numel() - 1 - group[0])
            w = torch.stack([ids[s:s + end + 1] for s in group])
            pairs.append((w[:, :-1], w[:, 1:]))
    return _totals(model, pairs, torch.from_numpy(token_byte_lengths(tokenizer)))


def old_text_batches(ids, seq_len, batch_size, max_batches):
    """kiln/train/evaluate.py:_text_batches before consolidation."""
    n = min((ids.numel() - 1) // seq_len, batch_size * max_batches)
    w = torch.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, n, batch_size)]


def old_val_batches(shards, seq_len, batch_size, max_batches):
    """kiln/data/loader.py:TokenWindows.gather + eval_batches before consolidation."""
    counts = [max(0, (t.shape[0] - 1) // seq_len) for t in shards.tokens]
    offsets = np.cumsum([0] + counts)
    n = min(int(offsets[-1]), batch_size * max_batches)
    idx = np.linspace(0, offsets[-1] - 1, n).round().astype(np.int64)
    rows = []
    for i in idx:
        s = np.searchsorted(offsets, i, side="right") - 1
        start = (int(i) - int(offsets[s])) * seq_len
        rows.append(np.asarray(shards.tokens[s][start:start + seq_len + 1], dtype=np.int64))
    w = torch.from_numpy(np.stack(rows))
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, n, batch_size)]


@pytest.mark.parametrize("n_tokens,batch_size,max_tokens", [(200, 3, 0), (161, 4, 0), (17, 8, 0), (2, 2, 0),
                                                            (500, 5, 123)])
def test_kiln_eval_numbers_match_the_old_formula(model, n_tokens, batch_size, max_tokens):
    ids = np.random.default_rng(n_tokens).integers(0, 256, n_tokens)
    tok = ByteTokenizer()
    got = evaluate_tokens(model, tok, ids, seq_len=SEQ, batch_size=batch_size, max_tokens=max_tokens)
    want = old_evaluate_tokens(model, tok, ids, SEQ, batch_size, max_tokens)
    assert got["tokens"] == want["tokens"] == min(n_tokens - 1, max_tokens or n_tokens)
    assert got["bytes"] == want["bytes"]
    for key in ("loss", "ppl", "bpb"):
        assert got[key] == pytest.approx(want[key], rel=1e-6)


def test_too_short_a_stream_is_a_data_error(model):
    with pytest.raises(DataError, match="fewer than 2"):
        evaluate_tokens(model, ByteTokenizer(), np.array([5]), seq_len=SEQ)


def _shards(tmp_path, tok, texts):
    writers = []
    for split, docs in (("train", ["x" * 50]), ("val", texts)):
        w = ShardWriter(tmp_path, split, tok.vocab_size, tok.eos_id, shard_tokens=120)  # several shards
        for t in docs:
            w.add(tok.encode(t))
        w.finish()
        writers.append(w)
    write_meta(tmp_path, writers)
    return ShardSet(tmp_path, "val")


def test_trainer_eval_rows_are_unchanged(model, tmp_path, text_file):
    tok = ByteTokenizer()
    body = text_file.read_text()[:6000]
    val = _shards(tmp_path / "shards", tok, [body[i:i + 300] for i in range(0, 3000, 300)])
    held_out = tmp_path / "held-out.txt"
    held_out.write_text(body[3000:5000])
    cfg = load_config(None, [f"data.seq_len={SEQ}", "train.batch_size=3", "train.eval_batches=4", "train.dtype=fp32",
                             f"train.eval_sets=[{str(held_out)!r}]"])
    got = Evaluator(model, val, tok, cfg, torch.device("cpu")).run()
    assert set(got) == {"val_loss", "val_ppl", "val_bpb", "held_out_loss", "held_out_ppl", "held_out_bpb"}
    byte_lengths = torch.from_numpy(token_byte_lengths(tok))
    with torch.no_grad():
        want_val = _totals(model, old_val_batches(val, SEQ, 3, 4), byte_lengths)
        ids = torch.from_numpy(np.append(tok.encode_array(held_out.read_text()), tok.eos_id).astype(np.int64))
        want_text = _totals(model, old_text_batches(ids, SEQ, 3, 4), byte_lengths)
    for key in ("loss", "ppl", "bpb"):  # the same batches, the same sums: bit-identical
        assert got[f"val_{key}"] == want_val[key]
        assert got[f"held_out_{key}"] == want_text[key]


def test_the_three_entry_points_agree_on_the_same_windows(model, text_file):
    """Full windows of one text: the trainer's text eval set, `kiln eval` and the probe's clean score."""
    tok = ByteTokenizer()
    text = text_file.read_text()[:40 * SEQ]
    ids = np.append(tok.encode_array(text), tok.eos_id).astype(np.int64)
    ids = ids[: (len(ids) - 1) // SEQ * SEQ + 1]  # whole windows only, so no ragged tail anywhere
    byte_lengths = torch.from_numpy(token_byte_lengths(tok))
    trainer_side = score_batches(model, leading_batches(TokenWindows([ids], SEQ), 4, 100), byte_lengths)
    eval_side = evaluate_tokens(model, tok, ids, seq_len=SEQ, batch_size=4)
    assert eval_side == trainer_side
    probe = robustness_probe(model, tok, [text], seq_len=SEQ, perturbations=["upper"], batch_size=4)
    assert probe["clean"]["loss"] == evaluate_texts(model, tok, [text], seq_len=SEQ, batch_size=4)["loss"]


def test_a_too_short_eval_set_names_itself(model, tmp_path):
    tok = ByteTokenizer()
    val = _shards(tmp_path / "shards", tok, ["some validation text " * 20])
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    cfg = load_config(None, [f"data.seq_len={SEQ}", "train.dtype=fp32", f"train.eval_sets=[{str(tiny)!r}]"])
    with pytest.raises(DataError, match=f"eval set {tiny} has \\d+ tokens, fewer than seq_len\\+1=17"):
        Evaluator(model, val, tok, cfg, torch.device("cpu"))


def test_scoring_restores_the_training_mode(model):
    model.train()
    byte_lengths = torch.ones(256, dtype=torch.int64)
    x = torch.randint(0, 256, (2, SEQ))
    score_batches(model, [(x, x)], byte_lengths)
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="no batches"):
        score_batches(model, [], byte_lengths)


def test_scoring_takes_the_models_training_loss_path_and_counts_real_rows_only(model):
    """score_batches asks kiln's Transformer for the loss (eval_loss): under the chunked loss the
    full logits are never formed (the head module is not called), the numbers are the logits'
    within fp32 rounding, and rows past `rows` (a rank's padding) count for nothing."""
    byte_lengths = torch.ones(256, dtype=torch.int64)
    x = torch.randint(0, 97, (4, SEQ), generator=torch.Generator().manual_seed(5))
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        want = lm_loss(model(x[:3]), y[:3]).item()
    calls = []
    hook = model.output.register_forward_hook(lambda *args: calls.append(1))
    try:
        model.loss_impl = "chunked"
        got = score_batches(model, [(x, y, 3)], byte_lengths)
    finally:
        model.loss_impl = "full"
        hook.remove()
    assert not calls  # no (batch x seq x vocab) logits
    assert got["tokens"] == 3 * SEQ and got["loss"] == pytest.approx(want, rel=1e-6)
    assert score_batches(model, [(x, y, 3)], byte_lengths)["loss"] == pytest.approx(want, rel=1e-7)


def test_an_eval_set_is_its_documents_in_file_order_wherever_the_file_lives(model, tmp_path):
    """train.eval_sets: each record (a plain text file: the whole file) one document ending in EOS,
    in the file's order; the same file at another path gives the same batches (it was split by a
    hash of each record's id, which holds the path, and a plain text file cut in two)."""
    import json

    tok = ByteTokenizer()
    val = _shards(tmp_path / "shards", tok, ["some validation text " * 20])
    records = [f"record {i}: " + "words " * (3 + 2 * i) for i in range(6)]
    plain = "one plain document, " * 12
    sets = {}
    for where in ("a", "b/c"):
        folder = tmp_path / where
        folder.mkdir(parents=True)
        (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
        (folder / "plain.txt").write_text(plain)
        cfg = load_config(None, [f"data.seq_len={SEQ}", "train.batch_size=2", "train.eval_batches=100",
                                 "train.dtype=fp32", "data.windows='packed_masked'",
                                 f"train.eval_sets=[{str(folder / 'docs.jsonl')!r}, {str(folder / 'plain.txt')!r}]"])
        sets[where] = Evaluator(model, val, tok, cfg, torch.device("cpu")).sets
    for name, texts in (("docs", records), ("plain", [plain])):
        docs = [np.append(tok.encode_array(t), tok.eos_id) for t in texts]
        ids = np.concatenate(docs).astype(np.int64)
        offsets = [np.cumsum([0] + [len(d) for d in docs])]
        want = list(leading_batches(TokenWindows([ids], SEQ, doc_offsets=offsets), 2, 100))
        for where in sets:
            got = sets[where][name]
            assert len(got) == len(want) > 1
            for g, w in zip(got, want):
                assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(g, w)), (name, where)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = load_config(None, [f"data.seq_len={SEQ}", "train.dtype=fp32", f"train.eval_sets=[{str(empty)!r}]"])
    with pytest.raises(DataError, match="empty.txt"):
        Evaluator(model, val, tok, cfg, torch.device("cpu"))
