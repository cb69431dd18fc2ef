"""`kiln eval` end to end on a tiny trained run."""

import json
import math
import os
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from kiln.cli import main
from kiln.config import load_config
from kiln.data.corpus import stdlib_files

TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "data.tokenizer=byte", "data.seq_len=32",
        "model.max_seq_len=32", "train.batch_size=2", "train.steps=3", "train.dtype=fp32",
        "metrics.progress=none", "train.eval_every=0", "metrics.peak_flops=1e12", "schedule.warmup_steps=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("evalcmd")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(p.read_text(errors="replace") for p in list(stdlib_files())[:3])[:40000])
    train(load_config(None, TINY + [f"data.source={corpus}"]), root / "run")
    return root / "run"


def _report(path):
    return json.loads(path.read_text())


@pytest.mark.timeout(120)
def test_default_scores_the_validation_shards(run_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--out", str(out)]) == 0
    ppl = _report(out)["parts"]["perplexity"]
    assert ppl["tokens"] > 0 and math.isfinite(ppl["loss"]) and ppl["ppl"] == pytest.approx(math.exp(ppl["loss"]))
    # Byte tokenizer: every token but EOS is one byte, so bits/byte is the summed loss over bytes.
    assert ppl["bpb"] == pytest.approx(ppl["loss"] * ppl["tokens"] / math.log(2) / ppl["bytes"])
    assert ppl["bytes"] <= ppl["tokens"]
    assert "bits/byte" in capsys.readouterr().out
    # The default report path is RUN_DIR/reports/eval-step-N.json.
    assert main(["eval", str(run_dir), "--max-tokens", "200"]) == 0
    default = _report(run_dir / "reports" / "eval-step-3.json")
    assert default["step"] == 3 and default["parts"]["perplexity"]["tokens"] == 200


@pytest.mark.timeout(120)
def test_held_out_text_files_match_evaluate_texts(run_dir, tmp_path):
    from kiln.eval.load import load_run
    from kiln.eval.perplexity import evaluate_texts

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def add(a, b):\n    return a + b\n" * 5)
    b.write_text("import os\nprint(os.getcwd())\n" * 5)
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--data", str(a), str(b), "--out", str(out)]) == 0
    loaded = load_run(run_dir)
    expected = evaluate_texts(loaded.model, loaded.tokenizer, [a.read_text(), b.read_text()], seq_len=32)
    got = _report(out)["parts"]["perplexity"]
    assert got["loss"] == pytest.approx(expected["loss"]) and got["bytes"] == expected["bytes"]


@pytest.mark.timeout(120)
def test_a_packed_masked_run_is_scored_masked(tmp_path, short_docs_dir, capsys):
    """A run trained with attention inside each packed document (data.windows = "packed_masked")
    is scored so by `kiln eval`: the validation shards with their documents' offsets, --data files
    each one document; neither equals the unmasked score."""
    import numpy as np

    from kiln.data.shards import ShardSet
    from kiln.eval.load import load_run
    from kiln.eval.perplexity import evaluate_texts, evaluate_tokens
    from kiln.train.trainer import train

    run = tmp_path / "run"
    train(load_config(None, TINY + [f"data.source={short_docs_dir}", "data.windows='packed_masked'",
                                    "train.steps=2"]), run)
    out = tmp_path / "r.json"
    assert main(["eval", str(run), "--out", str(out)]) == 0
    loaded = load_run(run)
    val = ShardSet(run / "data", "val")
    ids = np.concatenate([np.asarray(t) for t in val.tokens])
    starts = np.cumsum([0] + [len(t) for t in val.tokens])
    offsets = np.unique(np.concatenate([np.asarray(d) + a for d, a in zip(val.docs, starts)]))
    assert len(offsets) - 1 > len(ids) // 64  # a document boundary in most 32-token windows
    common = dict(seq_len=32, batch_size=8)
    want = evaluate_tokens(loaded.model, loaded.tokenizer, ids, doc_offsets=offsets, **common)
    got = _report(out)["parts"]["perplexity"]
    assert got["tokens"] == want["tokens"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["loss"] != pytest.approx(evaluate_tokens(loaded.model, loaded.tokenizer, ids, **common)["loss"],
                                        rel=1e-6)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def add(a, b):\n    return a + b\n")
    b.write_text("import os\nprint(os.getcwd())\n")
    assert main(["eval", str(run), "--data", str(a), str(b), "--out", str(out)]) == 0
    texts = [a.read_text(), b.read_text()]
    got = _report(out)["parts"]["perplexity"]
    assert got["loss"] == pytest.approx(evaluate_texts(loaded.model, loaded.tokenizer, texts, masked=True,
                                                       **common)["loss"], rel=1e-6)
    assert got["loss"] != pytest.approx(evaluate_texts(loaded.model, loaded.tokenizer, texts, **common)["loss"],
                                        rel=1e-6)
    # a corrupted document index of the validation shards: one line naming the file
    docs = run / "data" / "val-00000.docs.npy"
    swapped = np.load(docs)
    swapped[[1, 2]] = swapped[[2, 1]]  # as many entries as meta.json says, not rising
    np.save(docs, swapped)
    bad = tmp_path / "bad.json"
    assert main(["eval", str(run), "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "val-00000.docs.npy: corrupted document index" in err[0]
    report = _report(bad)  # the failure recorded, no number from the corrupted index
    assert report["parts"] == {} and report["failed"]["part"] == "perplexity"


@pytest.mark.timeout(120)
def test_generation_metrics(run_dir, tmp_path):
    from kiln.eval.genmetrics import all_metrics

    gen = tmp_path / "gen.jsonl"
    rows = [{"prompt": "def f(", "reference": "x):"}, {"prompt": "import ", "reference": ["os", "sys"], "stop": "\n"},
            {"prompt": "class ", "reference": "A:"}]
    gen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--skip-perplexity", "--gen-file", str(gen), "--max-new-tokens", "8",
                 "--out", str(out)]) == 0
    part = _report(out)["parts"]["generation"]
    assert part["n"] == 3 and len(part["samples"]) == 3
    assert "\n" not in part["samples"][1]["prediction"]
    recomputed = all_metrics([s["prediction"] for s in part["samples"]], [s["reference"] for s in part["samples"]])
    for key in ("bleu", "chrf", "rouge1", "rouge2", "rougeL", "exact_match"):
        assert part[key] == pytest.approx(recomputed[key])
    # Greedy decoding is deterministic.
    assert main(["eval", str(run_dir), "--skip-perplexity", "--gen-file", str(gen), "--max-new-tokens", "8",
                 "--out", str(tmp_path / "again.json")]) == 0
    assert _report(tmp_path / "again.json")["parts"]["generation"]["samples"] == part["samples"]


@pytest.mark.timeout(180)
def test_passk_on_a_problem_file(run_dir, tmp_path):
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        json.dumps({"task_id": "t/one", "prompt": "def one():\n", "tests": "assert one() == 1\n",
                    "entry_point": "one"}) + "\n"
        + json.dumps({"task_id": "t/two", "prompt": "def two():\n", "entry_point": "two",
                      "tests": "def check(candidate):\n    assert candidate() == 2\n"}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--skip-perplexity", "--passk-file", str(problems), "--n-samples", "2",
                 "--k", "1,2", "--passk-max-new-tokens", "16", "--sample-timeout", "5", "--out", str(out)]) == 0
    part = _report(out)["parts"]["passk"]
    assert set(part["pass_at_k"]) == {"pass@1", "pass@2"} and part["n_problems"] == 2
    for task in ("t/one", "t/two"):
        stats = part["per_task"][task]
        assert stats["n"] == 2 and sum(stats["statuses"].values()) == 2
        # A 3-step model writes noise: its programs fail or crash, and the evaluator keeps going.
        assert stats["correct"] == 0
    assert part["pass_at_k"]["pass@1"] == 0.0 and part["isolation"]


@pytest.mark.timeout(180)
def test_passk_cli_passes_a_correct_completion_and_fails_forgeries(run_dir, tmp_path, monkeypatch):
    import kiln.eval.passk
    import kiln.model.generate
    from kiln.eval.sandbox import _bwrap_probe

    if _bwrap_probe()[0] is None and not os.environ.get("KILN_REQUIRE_SANDBOX"):
        pytest.skip(f"no namespace sandbox here: {_bwrap_probe()[1]}")
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        json.dumps({"task_id": "t/one", "prompt": "def one():\n", "tests": "assert one() == 1\n",
                    "entry_point": "one"}) + "\n"
        + json.dumps({"task_id": "t/two", "prompt": "def two():\n", "entry_point": "two",
                      "tests": "def check(candidate):\n    assert candidate() == 2\n"}) + "\n")
    liar = "    class Liar:\n        def __eq__(self, other):\n            return True\n    return Liar()\n"
    forge = ("    import sys, os\n    f = sys._getframe()\n    while f is not None:\n"
             "        if 'nonce' in f.f_locals:\n            os.write(f.f_locals['done_w'], f.f_locals['nonce'])\n"
             "            os._exit(0)\n        f = f.f_back\n    os._exit(0)\n")
    # The model's text is replaced (in generation order) by known completions; the rest is the CLI's path.
    queue = iter(["    return 1\n", liar, "    return 2\n", forge])
    monkeypatch.setattr(kiln.model.generate, "generate", lambda *a, **k: [])
    monkeypatch.setattr(kiln.eval.passk, "truncate_completion", lambda text: next(queue))
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--skip-perplexity", "--passk-file", str(problems), "--n-samples", "2",
                 "--k", "1", "--sample-timeout", "8", "--out", str(out)]) == 0
    part = _report(out)["parts"]["passk"]
    one, two = part["per_task"]["t/one"], part["per_task"]["t/two"]
    assert one["correct"] == 1 and one["statuses"] == {"passed": 1, "error": 1}  # the lying __eq__
    assert two["correct"] == 1 and two["statuses"] == {"passed": 1, "failed": 1}  # the forged token
    assert part["pass_at_k"]["pass@1"] == 0.5 and part["isolation"]["sandbox"] == "bwrap"


@pytest.mark.timeout(60)
def test_passk_refuses_to_run_without_a_sandbox_unless_asked(run_dir, tmp_path, monkeypatch, capsys):
    import kiln.eval.sandbox
    import kiln.model.generate

    def no_generation(*args, **kwargs):
        raise AssertionError("generation must not start when the sandbox is refused")

    monkeypatch.setattr(kiln.model.generate, "generate", no_generation)
    monkeypatch.setattr(kiln.eval.sandbox, "_bwrap_probe", lambda: (None, "namespaces refused (test)"))
    assert main(["eval", str(run_dir), "--skip-perplexity", "--passk-file"]) == 2
    assert "--passk-allow-unsandboxed" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_lm_eval_local_task_through_the_cli(run_dir, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i} +", "choices": [" 1", " x"], "answer": 0}) + "\n"
                            for i in range(4)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kiln_cli_mc.yaml").write_text(
        f"task: kiln_cli_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    out = tmp_path / "r.json"
    # A fresh process, so the offline switches are in force when `datasets` is first imported.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "eval", str(run_dir), "--skip-perplexity",
                           "--lm-eval", "kiln_cli_mc", "--lm-eval-include", str(tasks), "--limit", "3",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kiln_cli_mc" in proc.stdout
    results = _report(out)["parts"]["lm_eval"]["results"]["kiln_cli_mc"]
    assert 0.0 <= results["acc,none"] <= 1.0


@pytest.mark.timeout(120)
def test_partial_results_survive_a_failing_part(run_dir, tmp_path, capsys):
    gen = tmp_path / "gen.jsonl"
    gen.write_text('{"prompt": "a", "reference": "b"}\n{"prompt": "a"}\n')
    out = tmp_path / "r.json"
    code = main(["eval", str(run_dir), "--max-tokens", "100", "--gen-file", str(gen), "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{gen}:2: missing field 'reference'" in err and len(err.strip().splitlines()) == 1
    report = _report(out)
    assert report["parts"]["perplexity"]["tokens"] == 100
    assert report["failed"]["part"] == "generation" and "reference" in report["failed"]["error"]


@pytest.mark.timeout(60)
def test_bad_input_gives_one_line_errors(run_dir, tmp_path, capsys):
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    assert main(["eval", str(empty_run)]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--passk-file", "--n-samples", "1", "--k", "1,5"]) == 2
    assert "--n-samples >= 5" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--data", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt not found" in capsys.readouterr().err
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a", "reference": "b"}\n\n{"prompt": "a", "reference": 3}\n')
    assert main(["eval", str(run_dir), "--skip-perplexity", "--gen-file", str(bad_json)]) == 2
    assert f"{bad_json}:3: field 'reference' must be a string or a list" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_later_eval_keeps_earlier_parts_of_the_same_checkpoint(run_dir, tmp_path):
    out = tmp_path / "r.json"
    assert main(["eval", str(run_dir), "--max-tokens", "50", "--out", str(out)]) == 0
    gen = tmp_path / "gen.jsonl"
    gen.write_text('{"prompt": "def ", "reference": "f():"}\n')
    assert main(["eval", str(run_dir), "--skip-perplexity", "--gen-file", str(gen), "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    parts = _report(out)["parts"]
    assert parts["perplexity"]["tokens"] == 50 and parts["generation"]["n"] == 1
    out.write_text("{not json")
    assert main(["eval", str(run_dir), "--max-tokens", "20", "--out", str(out)]) == 0
    assert (tmp_path / "r.json.unreadable").read_text() == "{not json"
    assert set(_report(out)["parts"]) == {"perplexity"}
