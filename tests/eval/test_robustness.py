import random

import pytest

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.eval.load import load_run
from kiln.eval.perplexity import evaluate_texts
from kiln.eval.robustness import DEFAULT_PROBE, parse_perturbation, perturb, robustness_probe, shard_texts, typos
from kiln.train.trainer import train

from conftest import tiny_overrides

TEXT = "The quick brown fox, said Dr. Smith, jumps over 2 lazy dogs! Don't stop."


@pytest.mark.parametrize("spec, expected", [
    ("lower", "the quick brown fox, said dr. smith, jumps over 2 lazy dogs! don't stop."),
    ("upper", "THE QUICK BROWN FOX, SAID DR. SMITH, JUMPS OVER 2 LAZY DOGS! DON'T STOP."),
    ("title", "The Quick Brown Fox, Said Dr. Smith, Jumps Over 2 Lazy Dogs! Don't Stop."),
    ("punctuation", "The quick brown fox said Dr Smith jumps over 2 lazy dogs Dont stop"),
    ("spaces:0.5", "The quick brown  fox, said    Dr. Smith,  jumps over  2 lazy dogs! Don't stop."),
    ("tabs:0.5", "The\tquick\tbrown\tfox, said\tDr. Smith,\tjumps over\t2 lazy dogs! Don't\tstop."),
    ("newlines:0.5", "The\nquick\nbrown\nfox, said Dr.\nSmith, jumps over\n2\nlazy dogs!\nDon't stop."),
    ("typos:0.2", "The quik borwn fox, siad Dr. Smtih, ujmps ovr 2 lazy dosg! Don't stop."),
])
def test_perturbations_exact_outputs(spec, expected):
    assert perturb([TEXT], spec, seed=7) == [expected]


def test_perturbations_preserve_what_they_should():
    text = TEXT * 20
    words = text.split()
    for spec in ("spaces:0.5", "tabs:0.5", "newlines:0.5"):
        assert perturb([text], spec, seed=1)[0].split() == words  # only whitespace changed
    for spec in ("lower", "upper", "title"):
        assert perturb([text], spec)[0].lower() == text.lower()
    assert perturb([text], "typos:0")[0] == text and perturb([text], "spaces:0")[0] == text
    heavy = perturb([text], "typos:1")[0]
    assert heavy != text and sorted(c for c in heavy if not c.isalpha()) == sorted(c for c in text if not c.isalpha())
    assert all(c.isalpha() or c in text for c in heavy)


def test_typos_rate_is_roughly_honoured():
    text = "abcdefghij" * 500
    dropped = len(text) - len(typos(text, random.Random(0), 0.1))
    assert 0.025 * len(text) < dropped < 0.1 * len(text)  # about half the 10% typos are drops


def test_determinism_per_seed_and_document():
    docs = [TEXT, TEXT]
    a = perturb(docs, "typos:0.3", seed=3)
    assert a == perturb(docs, "typos:0.3", seed=3)
    assert a != perturb(docs, "typos:0.3", seed=4)
    assert a[0] != a[1]  # each document gets its own stream


@pytest.mark.parametrize("spec, message", [("bogus", "unknown perturbation"), ("typos:x", "not a number"),
                                           ("typos:2", r"\[0, 1\]"), ("upper:0.1", "takes no rate")])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(KilnError, match=message):
        parse_perturbation(spec)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    run = tmp_path_factory.mktemp("robust") / "run"
    train(load_config(None, tiny_overrides(text_file, **{"train.steps": 40, "optim.lr": 1e-2, "train.eval_every": 0,
                                                         "checkpoint.every": 0})), run)
    return load_run(run)


@pytest.mark.timeout(120)
def test_probe_on_a_trained_tiny_model(trained, text_file):
    texts = [text_file.read_text()[i * 3000:(i + 1) * 3000] for i in range(3)]
    model, tok = trained.model, trained.tokenizer
    results = robustness_probe(model, tok, texts, seq_len=32, perturbations=["upper", "typos:0.3", "lower"])
    assert list(results) == ["clean", "upper", "typos:0.3", "lower"]
    clean = evaluate_texts(model, tok, texts, seq_len=32)
    assert results["clean"]["loss"] == clean["loss"] and results["clean"]["delta_loss"] == 0.0
    for spec in ("upper", "typos:0.3"):
        r = results[spec]
        assert r["delta_loss"] == pytest.approx(r["loss"] - clean["loss"])
        assert r["delta_bpb"] == pytest.approx(r["bpb"] - clean["bpb"])
        assert set(r) == {"loss", "ppl", "bpb", "tokens", "bytes", "delta_loss", "delta_bpb"}
    # a model trained (briefly) on mostly lower-case code is hurt by upper case, much less by lower case
    assert results["upper"]["delta_loss"] > 0.2 and results["upper"]["delta_loss"] > 2 * abs(results["lower"]["delta_loss"])
    again = robustness_probe(model, tok, texts, seq_len=32, perturbations=["typos:0.3"])
    assert again["typos:0.3"] == results["typos:0.3"]
    # a packed_masked run's probe: each text a document attention does not cross, as it trained
    masked = robustness_probe(model, tok, texts, seq_len=32, perturbations=["upper"], masked=True)
    assert masked["clean"]["loss"] == evaluate_texts(model, tok, texts, seq_len=32, masked=True)["loss"]
    assert masked["clean"]["loss"] != clean["loss"]
    assert len(DEFAULT_PROBE) == len(set(DEFAULT_PROBE))


def test_probe_rejects_empty_input_and_bad_specs_before_work(trained):
    with pytest.raises(KilnError, match="no text"):
        robustness_probe(trained.model, trained.tokenizer, ["  "], seq_len=32)
    with pytest.raises(KilnError, match="unknown perturbation"):
        robustness_probe(trained.model, trained.tokenizer, ["hello"], seq_len=32, perturbations=["nope"])


def test_shard_texts_decode_validation_documents(tmp_path):
    from kiln.data.shards import ShardWriter, write_meta
    from kiln.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    docs = ["first document\n", "   ", "second one, é ü", "third " * 50]
    writers = []
    for split, texts in (("train", ["x"]), ("val", docs)):
        w = ShardWriter(tmp_path, split, tok.vocab_size, tok.eos_id, shard_tokens=40)  # several shards
        for t in texts:
            w.add(tok.encode(t))
        w.finish()
        writers.append(w)
    write_meta(tmp_path, writers)
    assert shard_texts(tmp_path, tok) == [docs[0], docs[2], docs[3]]  # blank documents are left out
    capped = shard_texts(tmp_path, tok, max_chars=20)
    assert "".join(capped) == (docs[0] + docs[2])[:20]
    with pytest.raises(KilnError, match="no documents"):
        shard_texts(_empty_val(tmp_path / "e", tok), tok)


def _empty_val(path, tok):
    from kiln.data.shards import ShardWriter, write_meta

    writers = []
    for split in ("train", "val"):
        w = ShardWriter(path, split, tok.vocab_size, tok.eos_id)
        w.add(tok.encode("  ") if split == "val" else tok.encode("x"))
        w.finish()
        writers.append(w)
    write_meta(path, writers)
    return path
