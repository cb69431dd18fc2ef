"""The eval-part registry, its options and the report file, without a trained model."""

import argparse
import json
from types import SimpleNamespace

import pytest

from kiln.commands import eval as eval_command
from kiln.errors import DataError, KilnError
from kiln.eval import parts as parts_mod
from kiln.eval.parts import PARTS, EvalOptions, run_parts, wanted_parts
from kiln.eval.results import earlier_parts, summary_rows


def test_registry_order_and_selection():
    assert list(PARTS) == ["perplexity", "generation", "passk", "robustness", "lm_eval", "memorization"]
    assert wanted_parts(EvalOptions("r")) == ["perplexity"]
    both = EvalOptions("r", lm_eval="x", gen_file="g.jsonl", skip_perplexity=True)
    assert wanted_parts(both) == ["generation", "lm_eval"]
    with pytest.raises(KilnError, match="nothing to evaluate"):
        wanted_parts(EvalOptions("r", skip_perplexity=True))


def test_command_defaults_are_the_options_defaults():
    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    assert EvalOptions.from_namespace(p.parse_args(["RUN"])) == EvalOptions("RUN")


@pytest.mark.parametrize("change,message", [({"batch_size": 0}, "--batch-size=0 must be > 0"),
                                            ({"max_tokens": -1}, "--max-tokens"),
                                            ({"top_p": 0.0}, "--top-p"),
                                            ({"k": "1,x"}, "comma list of integers"),
                                            ({"k": "3", "n_samples": 2}, "--n-samples >= 3"),
                                            ({"dtype": "fp8"}, "--dtype"),
                                            ({"limit": 0.0}, "--limit")])
def test_bad_options_are_one_line_errors(change, message):
    with pytest.raises(KilnError, match=message):
        EvalOptions("r", **change).validate()


def _fake_parts(monkeypatch, fail_in: str):
    def ok(loaded, options):
        return {"value": 1}

    def bad(loaded, options):
        raise DataError("x.jsonl:2: missing field")

    monkeypatch.setattr(parts_mod, "PARTS", {"perplexity": ok, "generation": bad if fail_in == "generation" else ok})


def test_a_failing_part_leaves_the_finished_ones(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, "generation")
    loaded = SimpleNamespace(run_dir=tmp_path, step=3)
    out = tmp_path / "reports" / "eval-step-3.json"
    with pytest.raises(DataError):
        run_parts(loaded, ["perplexity", "generation"], EvalOptions("r"), out)
    report = json.loads(out.read_text())
    assert report["parts"]["perplexity"]["value"] == 1 and "generation" not in report["parts"]
    assert report["failed"] == {"part": "generation", "error": "DataError: x.jsonl:2: missing field"}
    assert not list(out.parent.glob("*.tmp"))
    # the next run of the same checkpoint keeps the earlier part
    _fake_parts(monkeypatch, "")
    report = run_parts(loaded, ["generation"], EvalOptions("r"), out)
    assert set(report["parts"]) == {"perplexity", "generation"} and report["failed"] is None
    # another checkpoint starts afresh
    assert set(run_parts(SimpleNamespace(run_dir=tmp_path, step=4), ["generation"], EvalOptions("r"), out)["parts"]) \
        == {"generation"}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"step": 3, "parts": [1]}', "\udcff"])
def test_an_unreadable_report_is_moved_aside_not_overwritten(tmp_path, text, capsys):
    path = tmp_path / "r.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert earlier_parts(path, 3) == {}
    assert (tmp_path / "r.json.unreadable").read_bytes() == text.encode("utf-8", "surrogateescape")
    assert not path.exists() and "moved it to" in capsys.readouterr().out


def test_summary_rows():
    report = {"parts": {"perplexity": {"loss": 1.0, "ppl": 2.718, "bpb": 1.44, "tokens": 10},
                        "robustness": {"clean": {"delta_loss": 0.0}, "upper": {"delta_loss": 0.5}}}}
    assert ("perplexity", "tokens", "10") in summary_rows(report)
    assert ("robustness", "upper delta loss", "+0.5000") in summary_rows(report)
