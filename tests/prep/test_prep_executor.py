import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main as kiln_main
from kiln.data.shards import ShardSet
from kiln.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from prep_testlib import make_corpus, output_files, write_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_cli_end_to_end_with_global_step(tmp_path, capsys):
    raw = make_corpus(tmp_path)
    out = tmp_path / "out"
    cfg = write_config(tmp_path, raw, out, workers=1, per_shard=5)
    assert kiln_main(["prep", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "kiln prep" in printed and "data.source=" in printed
    report = json.loads((out / "prep_report.json").read_text())
    steps = report["steps"]
    # 24 prose + 2 duplicates + short + binary = 28 text files, 7 JSONL lines.
    assert steps["read"]["docs_in"] == 35
    assert steps["read"]["dropped"] == {"read:binary": 1, "read:bad_json": 1}
    assert steps["gopher_quality"]["dropped"] == {"gopher:word_count": 1}
    assert steps["test_exact_dedup"]["dropped"] == {"exact_dup": 2}
    assert steps["test_exact_dedup"]["info"] == {"duplicates": 2}
    assert report["run"]["global_steps"]["test_exact_dedup"] == {
        "docs_indexed": 32, "state_bytes_per_doc": 16, "state_bytes_estimate": 32 * 16}
    # doc005.txt and records.jsonl line 6 (a copy of it plus a suffix) hold an email and a phone number.
    assert steps["pii"]["modified"] == {"pii:EMAIL": 2, "pii:PHONE_NUMBER": 2}
    assert report["totals"]["docs_out"] == 35 - 2 - 1 - 2
    # Every removed document is accounted for, with its step and reason.
    removed = [json.loads(l) for l in (out / "removed.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in removed) == ["exact_dup", "exact_dup", "gopher:word_count"]
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["file"], r["line"], r["reason"]) for r in rejects} == {("binary.txt", None, "read:binary"),
                                                                        ("records.jsonl", 7, "read:bad_json")}
    # The token shards are what `kiln train --set data.source=DIR` reads.
    train, val = ShardSet(out / "tokens", "train"), ShardSet(out / "tokens", "val")
    assert train.n_docs + val.n_docs == 30 and train.n_docs > 0 and val.n_docs > 0
    tok = load_tokenizer(out / "tokens" / "tokenizer.json")
    all_text = "".join(tok.decode(train.document(s, d)) for s in range(len(train.docs))
                       for d in range(train.docs[s].shape[0] - 1))
    assert "jane.doe@example.org" not in all_text and "<EMAIL>" in all_text
    html = (out / "prep_report.html").read_text()
    assert "<svg" in html and "gopher:word_count" in html and "<script" not in html and "src=" not in html


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    raw = make_corpus(tmp_path)
    cfg = write_config(tmp_path, raw, tmp_path / "out")
    cfg.write_text(cfg.read_text() + '\n[[step]]\ntype = "no_such_step"\n')
    assert kiln_main(["prep", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "no_such_step" in err and str(cfg) in err and "[[step]] #6" in err
    cfg.write_text(cfg.read_text().replace('type = "no_such_step"', 'type = "pii"\nbogus_key = 1'))
    assert kiln_main(["prep", str(cfg)]) == 2
    assert "bogus_key" in capsys.readouterr().err
    cfg.write_text(cfg.read_text().replace("bogus_key = 1", ""))
    assert kiln_main(["prep", str(cfg), "--set", "output.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err


def _run_cli(cfg: Path, *extra: str) -> subprocess.Popen:
    code = ("import sys; sys.path.insert(0, %r); import prep_testlib; from kiln.cli import main; "
            "sys.exit(main(sys.argv[1:]))" % str(Path(__file__).parent))
    return subprocess.Popen([sys.executable, "-c", code, "prep", str(cfg), *extra], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.timeout(180)
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    raw = make_corpus(tmp_path)
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    ref = _run_cli(write_config(tmp_path, raw, ref_out, per_shard=3, slow=0.05))
    cfg = write_config(tmp_path, raw, out, per_shard=3, slow=0.05)
    proc = _run_cli(cfg)
    done_dir = out / ".work" / "done" / "final"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if done_dir.is_dir() and len(list(done_dir.glob("*.json"))) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in (out / "documents").glob("*.zst")}
    assert finished and not (out / "tokens" / "meta.json").exists()
    rerun = _run_cli(cfg)
    assert rerun.wait(timeout=150) == 0, rerun.stderr.read().decode()
    assert ref.wait(timeout=150) == 0, ref.stderr.read().decode()
    for name, mtime in finished.items():  # finished shards were not redone
        assert (out / "documents" / name).stat().st_mtime_ns == mtime
    assert json.loads((out / "prep_report.json").read_text())["run"]["resumed"] is True
    assert output_files(out) == output_files(ref_out)
    ref_report = json.loads((ref_out / "prep_report.json").read_text())
    report = json.loads((out / "prep_report.json").read_text())
    assert report["steps"] == ref_report["steps"] and report["tokens"]["tokens"] == ref_report["tokens"]["tokens"]


@pytest.mark.timeout(240)
def test_ray_and_local_executors_give_identical_outputs(tmp_path):
    ray = pytest.importorskip("ray")
    import prep_testlib

    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import load_prep_config

    raw = make_corpus(tmp_path)
    local_out, ray_out = tmp_path / "local", tmp_path / "ray"
    run_prep(load_prep_config(write_config(tmp_path, raw, local_out, workers=2)))
    ray.cloudpickle.register_pickle_by_value(prep_testlib)  # the toy steps live outside the package
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_prep(load_prep_config(write_config(tmp_path, raw, ray_out, executor="ray", workers=2)))
    finally:
        ray.shutdown()
    assert output_files(local_out) == output_files(ray_out)
    a = json.loads((local_out / "prep_report.json").read_text())
    b = json.loads((ray_out / "prep_report.json").read_text())
    assert a["steps"] == b["steps"] and a["tokens"]["tokens"] == b["tokens"]["tokens"]


def test_example_config_runs_on_a_directory_of_text_files(tmp_path):
    raw = make_corpus(tmp_path)
    out = tmp_path / "prepped"
    example = REPO / "configs" / "prep" / "example.toml"
    assert kiln_main(["prep", str(example), "--set", f"input.path={str(raw)!r}", f"output.dir={str(out)!r}",
                      "tokenize.vocab_size=300", "run.progress='none'", "--workers", "1"]) == 0
    assert ShardSet(out / "tokens", "train").n_docs > 0
    meta = json.loads((out / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and set(meta["splits"]) == {"train", "val"}


def test_refuses_to_overwrite_foreign_output(tmp_path, capsys):
    raw = make_corpus(tmp_path)
    out = tmp_path / "out"
    (out / "documents").mkdir(parents=True)
    (out / "documents" / "mine.txt").write_text("precious")
    assert kiln_main(["prep", str(write_config(tmp_path, raw, out))]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (out / "documents" / "mine.txt").read_text() == "precious"


def test_python_api_parquet_output_and_changed_input_starts_over(tmp_path):
    from kiln.prep.executor import run_prep
    from kiln.prep.pipeline import OutputConfig, PrepConfig, RunConfig, TokenizeConfig
    from kiln.prep.quality import GopherQuality, GopherQualityConfig
    from kiln.prep.readers import ReaderConfig
    from kiln.prep.writers import read_docs

    raw = make_corpus(tmp_path)

    def config():
        return PrepConfig(input=ReaderConfig(path=str(raw)), output=OutputConfig(dir=str(tmp_path / "o"), docs_format="parquet"),
                          tokenize=TokenizeConfig(tokenizer="byte", val_fraction=0.2),
                          run=RunConfig(workers=1, progress="none"),
                          steps=[GopherQuality(GopherQualityConfig(min_words=20))])

    first = run_prep(config())
    parts = sorted((tmp_path / "o" / "documents").glob("*.parquet"))
    assert sum(1 for p in parts for _ in read_docs(p)) == first["totals"]["docs_out"] == 32
    (raw / "extra.txt").write_text(" ".join(["the words of an extra document"] * 10))
    second = run_prep(config())
    assert second["run"]["resumed"] is False and second["totals"]["docs_out"] == 33
    third = run_prep(config())
    assert third["run"]["resumed"] is True and third["steps"] == second["steps"]


def _jsonl_config(tmp_path: Path, records: list[str], **run: object) -> tuple[Path, Path]:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text("".join(r + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "out"
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in run.items())
    cfg = tmp_path / "prep.toml"
    cfg.write_text(f'[input]\npath = "{raw}"\n[output]\ndir = "{out}"\n[tokenize]\ntokenizer = "byte"\n'
                   f'val_fraction = 0.2\n[run]\nworkers = 1\nprogress = "none"\n{extra}', encoding="utf-8")
    return cfg, out


def test_nothing_kept_fails_in_one_line_and_keeps_what_was_read(tmp_path, capsys):
    # A wrong input.text_field: every record is rejected; before, this exited 0 with empty shards.
    cfg, out = _jsonl_config(tmp_path, [json.dumps({"body": f"document number {i}"}) for i in range(40)])
    assert kiln_main(["prep", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln prep: error: no document kept")
    assert "all 40 input records" in err[0] and "read:missing_text_field 40" in err[0]
    assert "check input.text_field" in err[0] and "'text'" in err[0]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 40 and {r["reason"] for r in rejects} == {"read:missing_text_field"}
    assert json.loads((out / "prep_report.json").read_text())["totals"]["docs_out"] == 0
    assert not (out / "tokens").exists()  # no empty shards for `kiln train` to pick up
    # The fix named in the message works.
    assert kiln_main(["prep", str(cfg), "--set", 'input.text_field="body"']) == 0
    assert ShardSet(out / "tokens", "train").n_docs + ShardSet(out / "tokens", "val").n_docs == 40


def test_nothing_kept_by_a_filter_step_names_the_step_reason(tmp_path, capsys):
    raw = make_corpus(tmp_path)
    cfg = write_config(tmp_path, raw, tmp_path / "out")
    assert kiln_main(["prep", str(cfg), "--set", "step.gopher_quality.min_words=100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no document kept: all 35 input records were dropped" in err[0]
    assert "by gopher:word_count 33, read:bad_json 1, read:binary 1;" in err[0]


def test_reject_share_above_the_limit_warns_with_top_reasons(tmp_path, capsys):
    good = [json.dumps({"text": f"a perfectly fine document {i}"}) for i in range(4)]
    cfg, out = _jsonl_config(tmp_path, good + ["{broken"] * 5 + ["[1, 2]"])
    assert kiln_main(["prep", str(cfg)]) == 0
    printed = capsys.readouterr().out
    warning = ("the reader rejected 6 of 10 input records (60.0%), more than run.max_reject_share=0.5: "
               "read:bad_json 5, read:not_object 1")
    assert warning in " ".join(printed.split())
    assert any(w.startswith(warning) for w in json.loads((out / "prep_report.json").read_text())["warnings"])
    assert kiln_main(["prep", str(cfg), "--set", "run.max_reject_share=0.6"]) == 0  # 60% is not more than 60%
    assert "max_reject_share" not in capsys.readouterr().out
    assert not any("max_reject_share" in w for w in json.loads((out / "prep_report.json").read_text())["warnings"])
    assert kiln_main(["prep", str(cfg), "--set", "run.max_reject_share=1.5"]) == 2
    assert "run.max_reject_share=1.5 must be in [0, 1]" in capsys.readouterr().err


def test_prep_command_imports_no_torch(tmp_path):
    """`kiln prep` must not pay for torch (and its distributed checkpointing) at start-up."""
    raw = make_corpus(tmp_path)
    cfg = write_config(tmp_path, raw, tmp_path / "out")
    code = ("import sys, argparse; sys.path.insert(0, %r); import prep_testlib; from kiln.commands import prep; "
            "p = argparse.ArgumentParser(); prep.add_arguments(p); rc = prep.run(p.parse_args([%r])); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'scipy')); "
            "print('HEAVY', heavy); sys.exit(rc)" % (str(Path(__file__).parent), str(cfg)))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout
