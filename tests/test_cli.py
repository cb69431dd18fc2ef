"""End to end through the `kiln` command line, as a user runs it."""

import json
import subprocess

import pytest

from conftest import kiln_cmd, tiny_overrides


def kiln(*args, cwd=None, timeout=300):
    return subprocess.run(kiln_cmd() + list(args), capture_output=True, text=True, cwd=cwd, timeout=timeout)


def sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


@pytest.mark.timeout(600)
def test_train_generate_eval_resume(tmp_path, text_file):
    run = tmp_path / "run"
    p = kiln("train", "--run-dir", str(run), *sets(tiny_overrides(text_file, **{"train.steps": 12})), "--stop-at", "6")
    assert p.returncode == 0, p.stderr
    assert "paused at step 6" in p.stdout
    p = kiln("train", "--resume", str(run))
    assert p.returncode == 0, p.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 13))
    assert "step 12/12" in p.stderr  # plain progress lines off a TTY

    p = kiln("generate", str(run), "--prompt", "def ", "--max-tokens", "20", "--seed", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("def ") and len(p.stdout) > 5

    p = kiln("eval", str(run), "--data", str(text_file), "--robustness", "upper,typos:0.05", "--max-tokens", "2000")
    assert p.returncode == 0, p.stderr
    assert "bits/byte" in p.stdout and "upper delta loss" in p.stdout
    report = json.loads((run / "reports" / "eval-step-12.json").read_text())
    assert report["parts"]["robustness"]["upper"]["delta_loss"] == pytest.approx(
        report["parts"]["robustness"]["upper"]["loss"] - report["parts"]["robustness"]["clean"]["loss"])

    p = kiln("report", str(run))
    assert p.returncode == 0, p.stderr
    assert (run / "reports" / "report.html").is_file()


@pytest.mark.parametrize("args, message", [
    (["train", "--set", "train.stepz=3"], "unknown key train.stepz"),
    (["train", "--set", "optim.lr=fast"], "optim.lr='fast' has the wrong type; expected float"),
    (["train", "missing.toml"], "config file missing.toml not found"),
    (["train", "--set", "data.source=/no/such/corpus.txt", "--set", "data.tokenizer=byte"], "not found"),
    (["train", "--resume", "/no/such/run"], "has no checkpoints"),
    (["generate", "/no/such/run"], "not found"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, args, message):
    p = kiln(*args, "--run-dir", str(tmp_path / "r"), cwd=tmp_path) if args[0] == "train" and "--resume" not in args \
        else kiln(*args, cwd=tmp_path)
    assert p.returncode == 2
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0, p.stderr


def test_bad_corpus_is_reported(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1") * 100)
    p = kiln("train", "--run-dir", str(tmp_path / "r"), "--set", f"data.source='{bad}'", "--set", "data.tokenizer=byte")
    assert p.returncode == 2 and "not UTF-8" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("argv, absent", [
    (["--help"], "torch"),
    (["prep", "--help"], "torch"),
    (["report", "--help"], "torch"),
    (["sweep", "--help"], "torch.distributed.checkpoint"),
])
def test_light_commands_import_no_torch(argv, absent):
    """Only the chosen command's module is imported: `kiln --help` and `kiln prep` start fast."""
    import subprocess
    import sys

    code = ("import sys\nfrom kiln.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(%r in sys.modules)" % (argv, absent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
