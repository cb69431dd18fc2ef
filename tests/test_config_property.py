"""`kiln train` either trains or prints one line naming a key: never a traceback (issue 10).

Runs the CLI in-process on a tiny byte-tokenized corpus with `--steps 1`: a fixed list of the
values the issue reported, then hypothesis-generated override sets (valid and invalid values,
NaN/inf, negatives, huge numbers, wrong types) over most keys.
"""

import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main
from kiln.config import JobConfig
from kiln.data.corpus import stdlib_files

KEYS = {f"{section}.{key}" for section, keys in JobConfig().to_dict().items() for key in keys}
NAMES_A_KEY = re.compile("|".join(re.escape(k) for k in sorted(KEYS, key=len, reverse=True)) + r"|--stop-at")
TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=64", "data.tokenizer='byte'",
        "data.seq_len=32", "train.batch_size=2", "train.eval_every=1", "train.eval_batches=1", "train.dtype='fp32'",
        "metrics.progress='none'", "metrics.peak_flops=1e12", "schedule.warmup_steps=1", "checkpoint.every=0",
        "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    parts, size = [], 0
    for f in stdlib_files():
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size > 40_000:
            break
    path.write_text("\n".join(parts)[:40_000], encoding="utf-8")
    return path


def run_train(corpus: Path, overrides: list[str], extra: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """rc and stderr lines of `kiln train` (in-process) on the tiny config plus `overrides`."""
    import contextlib
    import io

    threads = torch.get_num_threads()
    err = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        args = ["train", "--run-dir", str(Path(tmp) / "run"), "--steps", "1", *extra]
        for item in [*TINY, f"data.source={str(corpus)!r}", *overrides]:
            args += ["--set", item]
        try:
            rc = main(args)
        finally:
            torch.set_num_threads(threads)  # train.threads is process-wide
    return rc, err.getvalue().strip().splitlines()


def assert_ran_or_named_a_key(rc: int, err: list[str], overrides: list[str]) -> None:
    assert rc in (0, 2), (overrides, rc, err)
    if rc == 2:
        assert len(err) == 1 and err[0].startswith("kiln train: error: "), (overrides, err)
        assert NAMES_A_KEY.search(err[0]), (overrides, err)


# value -> the key the one-line error must name (the cases issue 10 listed)
ISSUE_CASES = [
    ("model.n_kv_heads=-2", "model.n_kv_heads"), ("model.ffn_hidden=-5", "model.ffn_hidden"),
    ("train.threads=-1", "train.threads"), ("model.init_std=-1", "model.init_std"),
    ("optim.lr=nan", "optim.lr"), ("train.device=bogus", "train.device"),
    ("model.dim=1000000000", "model.dim"), ("model.vocab_size=1000000000", "model.vocab_size"),
    ("data.vocab_size=1000000000", "data.vocab_size"), ("model.n_layers=1000000", "model.n_layers"),
    ("model.norm_eps=-1", "model.norm_eps"), ("model.rope_theta=0", "model.rope_theta"),
    ("model.rope_theta=-5", "model.rope_theta"), ("optim.lr=inf", "optim.lr"),
    ("optim.weight_decay=nan", "optim.weight_decay"), ("train.eval_every=-1", "train.eval_every"),
    ("data.prefetch=-3", "data.prefetch"), ("metrics.peak_flops=-1", "metrics.peak_flops"),
    ("train.eval_sets=['missing-eval.txt']", "train.eval_sets"),
    ("data.tokenizer=bpe", None),  # with data.vocab_size=10**9 below: refused before BPE training
]


@pytest.mark.parametrize("override, key", ISSUE_CASES)
def test_issue_values_give_one_line_naming_the_key(corpus, override, key):
    overrides = [override] if key else [override, "data.vocab_size=1000000000"]
    rc, err = run_train(corpus, overrides)
    assert rc == 2 and len(err) == 1, err
    assert re.search(re.escape(key or "data.vocab_size") + "[=:]", err[0]), err


@pytest.mark.parametrize("stop_at", ["-5", "0"])
def test_stop_at_must_be_a_positive_step(corpus, stop_at):
    rc, err = run_train(corpus, [], ("--stop-at", stop_at))
    assert rc == 2 and err == [f"kiln train: error: --stop-at={stop_at} must be > 0 (a training step to pause after)"]


def test_the_tiny_config_trains(corpus):
    assert run_train(corpus, []) == (0, [])


def _values(valid: list[str], invalid: list[str]) -> st.SearchStrategy[str]:
    # Mostly valid values, so that some sets get past the config and train a step.
    good = st.sampled_from(valid)
    return st.one_of(good, good, good, st.sampled_from(invalid))


BAD_INT = ["0", "-1", "-7", "1000000000", "1000000000000000000", "99999999999999999999999", "1.5", "true",
           "nan", "'x'", "[1, 2]", "abc"]
BAD_FLOAT = ["-1.0", "0", "nan", "inf", "-inf", "1e308", "1e400", "true", "'x'", "[0.1]", "2"]
BAD_STR = ["bogus", "1", "true", "[1]", "''", "'cuda:x'"]
SPACE = {
    "model.dim": _values(["16", "32", "48", "64"], BAD_INT),
    "model.n_layers": _values(["1", "2"], BAD_INT),
    "model.n_heads": _values(["1", "2", "4"], BAD_INT),
    "model.n_kv_heads": _values(["0", "1", "2"], BAD_INT),
    "model.ffn_hidden": _values(["0", "16", "100"], BAD_INT),
    "model.multiple_of": _values(["1", "8", "64"], BAD_INT),
    "model.max_seq_len": _values(["32", "64", "128"], BAD_INT),
    "model.vocab_size": _values(["0", "257", "300"], BAD_INT),
    "model.norm_eps": _values(["1e-5", "1e-6"], BAD_FLOAT),
    "model.rope_theta": _values(["10000.0", "500"], BAD_FLOAT),
    "model.dropout": _values(["0.0", "0.1"], BAD_FLOAT + ["1.0"]),
    "model.init_std": _values(["0.02", "0.1"], BAD_FLOAT),
    "model.norm": _values(["rmsnorm", "layernorm", "none"], BAD_STR),
    "model.activation": _values(["gelu", "swiglu", "geglu"], BAD_STR),
    "model.positions": _values(["rope", "learned"], BAD_STR),
    "model.init": _values(["normal", "gpt2", "ds_init", "t_fixup"], BAD_STR),
    "model.tie_embeddings": _values(["true", "false"], ["1", "'yes'"]),
    "data.seq_len": _values(["8", "16", "32", "64"], BAD_INT),
    "data.prefetch": _values(["1", "2"], BAD_INT),
    "data.max_bytes": _values(["0", "20000"], BAD_INT),
    "data.vocab_size": _values(["300", "512"], BAD_INT),
    "data.tokenizer": _values(["byte", "bpe"], ["missing.json"]),
    "data.val_fraction": _values(["0.05", "0.2"], BAD_FLOAT + ["1.0"]),
    "optim.name": _values(["adamw", "adafactor", "lamb", "lion", "muon", "sgd"], BAD_STR),
    "optim.implementation": _values(["auto", "foreach", "single"], BAD_STR),
    "optim.lr": _values(["1e-3", "0.01"], BAD_FLOAT),
    "optim.eps": _values(["1e-8"], BAD_FLOAT),
    "optim.weight_decay": _values(["0.0", "0.1"], BAD_FLOAT),
    "optim.momentum": _values(["0.0", "0.9"], BAD_FLOAT + ["1.0"]),
    "optim.betas": _values(["[0.9, 0.95]"], ["[0.9]", "[0.9, nan]", "[1.5, 0.9]", "0.9", "['a', 'b']"]),
    "optim.muon_adam_lr": _values(["1e-3"], BAD_FLOAT),
    "schedule.name": _values(["cosine", "linear", "step", "wsd", "constant", "plateau"], BAD_STR),
    "schedule.warmup_steps": _values(["0", "5"], BAD_INT),
    "schedule.min_lr_ratio": _values(["0.0", "0.5"], BAD_FLOAT),
    "schedule.gamma": _values(["0.5"], BAD_FLOAT),
    "schedule.step_size": _values(["1", "10"], BAD_INT),
    "train.batch_size": _values(["1", "2", "4"], BAD_INT),
    "train.grad_accum": _values(["1", "2"], BAD_INT),
    "train.eval_every": _values(["0", "1"], BAD_INT),
    "train.eval_batches": _values(["1", "3"], BAD_INT),
    "train.threads": _values(["0", "1"], BAD_INT),
    "train.seed": _values(["0", "7"], BAD_INT),
    "train.device": _values(["cpu", "auto"], BAD_STR),
    "train.dtype": _values(["fp32", "bf16", "auto"], BAD_STR + ["fp16"]),
    "train.activation_checkpointing": _values(["none", "full", "selective", "op", "every_k:2"], BAD_STR + ["'every_k:0'"]),
    "train.clip_grad_norm": _values(["0.0", "1.0"], BAD_FLOAT),
    "train.max_nonfinite_steps": _values(["1", "5"], BAD_INT),
    "train.eval_sets": _values(["[]"], ["['missing.txt']", "'x.txt'", "[1]"]),
    "checkpoint.every": _values(["0", "1"], BAD_INT),
    "checkpoint.keep_last": _values(["1", "2"], BAD_INT),
    "metrics.log_every": _values(["1", "10"], BAD_INT),
    "metrics.peak_flops": _values(["1e12"], BAD_FLOAT),
    "metrics.progress": _values(["none", "plain"], BAD_STR),
    "parallel.dp_shard": _values(["-1", "1"], BAD_INT),
    "parallel.tp": _values(["1"], BAD_INT),
}
override_sets = st.lists(st.sampled_from(sorted(SPACE)), min_size=1, max_size=6, unique=True).flatmap(
    lambda keys: st.tuples(*[SPACE[k].map(lambda v, k=k: f"{k}={v}") for k in keys]))


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=override_sets)
def test_random_overrides_train_or_name_a_key(corpus, overrides):
    rc, err = run_train(corpus, list(overrides))
    assert_ran_or_named_a_key(rc, err, list(overrides))
    OUTCOMES.append(rc)


OUTCOMES: list[int] = []


def test_property_sets_reached_both_outcomes():
    # Guards the strategy itself: a generator that only ever fails (or only ever trains) tests little.
    if not OUTCOMES:
        pytest.skip("run together with test_random_overrides_train_or_name_a_key")
    assert 0 in OUTCOMES and 2 in OUTCOMES, OUTCOMES
