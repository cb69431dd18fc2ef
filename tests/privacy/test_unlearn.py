"""Canaries -> memorization -> `kiln unlearn` end to end on a tiny byte-level model, plus bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main
from kiln.config import load_config
from kiln.data.corpus import stdlib_files

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.tokenizer=byte", "data.seq_len=64",
        "model.max_seq_len=64", "train.batch_size=8", "train.steps=250", "train.dtype=fp32",
        "metrics.progress=none", "train.eval_every=0", "metrics.peak_flops=1e12", "schedule.warmup_steps=10",
        "checkpoint.every=0", "data.canaries=4", "data.canary_repeats=40", "data.canary_digits=4"]
CANDIDATES = "300"
VAL_LOSS_BOUND = 0.15  # stated bound: unlearning raises validation loss by < 15% (relative)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("privacy")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(p.read_text(errors="replace") for p in list(stdlib_files())[:6])[:20000])
    train(load_config(None, TINY + [f"data.source={corpus}"]), root / "run")
    return root / "run", corpus


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_canaries_are_in_train_tokens_and_recorded_only_in_the_run_dir(run):
    run_dir, _ = run
    rows = _rows(run_dir / "canaries.jsonl")
    assert len(rows) == 8 and sum(r["heldout"] for r in rows) == 4
    train_bytes = np.concatenate([np.load(p) for p in sorted((run_dir / "data").glob("train-*.tokens.npy"))])
    val_bytes = np.concatenate([np.load(p) for p in sorted((run_dir / "data").glob("val-*.tokens.npy"))])
    train_text = bytes(int(t) for t in train_bytes if t < 256).decode("utf-8", "replace")
    val_text = bytes(int(t) for t in val_bytes if t < 256).decode("utf-8", "replace")
    for r in rows:
        assert train_text.count(r["text"]) == (0 if r["heldout"] else 40)
        assert r["text"] not in val_text
    for f in (run_dir / "data").iterdir():  # no shard file names or metadata mention a secret
        if f.suffix == ".json":
            assert not any(r["secret"] in f.read_text() for r in rows)


@pytest.mark.timeout(300)
def test_memorization_eval_then_unlearn_to_the_unseen_level(run, tmp_path):
    run_dir, corpus = run
    report = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--memorization", "--skip-perplexity", "--candidates", CANDIDATES,
                 "--el-stride", "2", "--out", str(report)]) == 0
    mem = json.loads(report.read_text())["parts"]["memorization"]
    seen, unseen = mem["sequences"], mem["heldout"]
    assert seen["exposure"] > unseen["exposure"] + 3  # memorized: well above random
    assert seen["el"] > unseen["el"] and seen["ma"] > unseen["ma"]

    out = tmp_path / "unlearned"
    assert main(["unlearn", str(run_dir), "--forget", str(run_dir / "canaries.jsonl"), "--retain", str(corpus),
                 "--chunk", "2", "--candidates", CANDIDATES, "--val-tokens", "4000", "--out", str(out)]) == 0
    rep = json.loads((out / "reports" / "unlearning.json").read_text())
    assert rep["status"] == "done" and len(rep["chunks"]) == 2
    ref, before, after = rep["heldout_reference"], rep["forget_before"], rep["forget_after"]
    margin = rep["options"]["margin"]
    # The stop rule: EL and MA at the never-seen level within the margin - not above it, and not
    # overshot below it (checked every step; the shared prefix is not ascended on).
    for key in ("el", "ma"):
        assert ref[key] - margin <= after[key] <= ref[key] + margin, (key, after[key], ref[key])
    for chunk in rep["chunks"]:  # each chunk stopped at a step that met the rule
        last = chunk["history"][-1] if chunk["history"] else None
        assert last is None or (last["el"] <= ref["el"] + margin and last["ma"] <= ref["ma"] + margin)
    first = rep["chunks"][0]["history"]  # (the forget set seen so far is the chunk): at the first such step
    assert all(h["el"] > ref["el"] + margin or h["ma"] > ref["ma"] + margin for h in first[:-1])
    assert after["exposure"] < before["exposure"]  # reported, not part of the rule (docs/privacy.md)
    # With the exposure stop the secrets also fall to the never-seen level by exposure (the
    # issue's proof): EL/MA alone leave a secret ranked high among the candidates.
    strict = tmp_path / "unlearned-exposure"
    assert main(["unlearn", str(run_dir), "--forget", str(run_dir / "canaries.jsonl"), "--retain", str(corpus),
                 "--chunk", "2", "--candidates", CANDIDATES, "--val-tokens", "4000", "--stop-on-exposure",
                 "--out", str(strict)]) == 0
    srep = json.loads((strict / "reports" / "unlearning.json").read_text())
    assert srep["status"] == "done" and all(c["reached_reference"] for c in srep["chunks"])
    exposure_margin = srep["options"]["exposure_margin"]
    assert srep["forget_after"]["exposure"] <= ref["exposure"] + exposure_margin < before["exposure"] - 3
    assert srep["val_after"]["loss"] < srep["val_before"]["loss"] * (1 + VAL_LOSS_BOUND)
    assert rep["val_after"]["loss"] < rep["val_before"]["loss"] * (1 + VAL_LOSS_BOUND)
    # A new run that kiln eval loads; the original run is untouched.
    assert (out / "checkpoints").is_dir() and (out / "canaries.jsonl").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-250"]
    again = tmp_path / "again.json"
    assert main(["eval", str(out), "--memorization", "--candidates", CANDIDATES, "--max-tokens", "500",
                 "--out", str(again)]) == 0
    after = json.loads(again.read_text())["parts"]["memorization"]["sequences"]
    assert after["exposure"] == pytest.approx(rep["forget_after"]["exposure"], abs=1e-6)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_never_memorized_sequences_change_nothing(run, tmp_path, capsys):
    run_dir, _ = run
    heldout = [r for r in _rows(run_dir / "canaries.jsonl") if r["heldout"]]
    fresh = [{**r, "heldout": False} for r in heldout[:2]] + heldout[2:]
    out = tmp_path / "out"
    code = main(["unlearn", str(run_dir), "--forget", str(_write(tmp_path / "f.jsonl", fresh)),
                 "--candidates", CANDIDATES, "--val-tokens", "500", "--out", str(out)])
    assert code == 2 and "do not look memorized" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    ("", "no rows"),
    (json.dumps({"text": "x" * 200}) + "\n", "longer than the model's context of 64"),
    (json.dumps({"text": ""}) + "\n", "at least 2 tokens"),
    (json.dumps({"text": "my code is 1-2", "prefix": "my code is ", "secret": "1-2", "digits": 3}) + "\n",
     "canary row"),
])
def test_bad_forget_files_name_the_problem(run, tmp_path, capsys, content, message):
    run_dir, _ = run
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert main(["unlearn", str(run_dir), "--forget", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err
    assert not (tmp_path / "o").exists()


def test_ascent_is_masked_to_the_secret_of_canary_rows():
    from kiln.data.tokenizer import ByteTokenizer
    from kiln.privacy.unlearn import ascent_mask

    tok = ByteTokenizer()
    rows = [{"text": "my code is 1-2", "prefix": "my code is ", "secret": "1-2", "digits": 2}, {"text": "plain"}]
    seqs = [tok.encode(r["text"]) for r in rows]
    canary, plain = ascent_mask(tok, rows, seqs, secret_only=True)
    # Targets are tokens 1..n-1 (target j is byte j + 1): only the digits "1" (byte 11) and "2"
    # (byte 13) are ascended on, not the shared prefix "my code is " or the separator "-".
    assert canary == [False] * 10 + [True, False, True] and plain == [True] * 4
    assert ascent_mask(tok, rows, seqs, secret_only=False)[0] == [True] * 13


def test_an_overshooting_step_is_cut_back_into_the_band():
    import torch

    from kiln.privacy.unlearn import UnlearnOptions, _cut_back

    reference, opts = {"el": 0.5, "ma": 0.5}, UnlearnOptions(margin=0.1, bisect=5)  # band [0.4, 0.6]
    p = torch.ones(3)  # the step took the parameters from 0 to 1; EL = 1 - p falls under 0.4 past p = 0.6

    def check():
        summary = {"el": 1.0 - float(p[0]), "ma": 0.5}
        return summary["el"] <= 0.6, summary

    fraction, done, summary = _cut_back([p], [torch.zeros(3)], check, reference, opts)
    assert 0.6 - 2 ** -5 <= fraction <= 0.6 and torch.equal(p, torch.full((3,), fraction))
    assert done and 0.4 <= summary["el"] <= 0.6
    # An argmax count jumps: when any part of the step leaves the band below, the step is undone
    # (fraction 0, the parameters back where they were) and the rule does not hold there.
    q = torch.ones(3)

    def jump():
        summary = {"el": 0.7 if float(q[0]) == 0.0 else 0.3, "ma": 0.5}
        return summary["el"] <= 0.6, summary

    fraction, done, summary = _cut_back([q], [torch.zeros(3)], jump, reference, opts)
    assert fraction == 0.0 and torch.equal(q, torch.zeros(3)) and not done and summary["el"] == 0.7


@pytest.mark.parametrize("flag, value, message", [("--bisect", "-1", "--bisect=-1 must be >= 0"),
                                                  ("--format-weight", "-0.5", "--format-weight")])
def test_bad_unlearn_options_name_the_flag(tmp_path, capsys, flag, value, message):
    forget = _write(tmp_path / "f.jsonl", [{"text": "some text"}])
    assert main(["unlearn", str(tmp_path / "run"), "--forget", str(forget), flag, value,
                 "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()
