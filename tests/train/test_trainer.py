import json
import math

import pytest
import torch

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.model import loss as loss_mod
from kiln.train.trainer import train

from conftest import tiny_overrides


def rows(run_dir, kind):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == kind:
            out.append(row)
    return out


def cfg_for(text_file, **extra):
    return load_config(None, tiny_overrides(text_file, **extra))


def test_trains_and_writes_the_run_dir(tmp_path, text_file):
    run = tmp_path / "run"
    # metrics.peak_flops=0: the CPU matmul probe measures the peak (the one run that keeps it), MFU below 1
    result = train(cfg_for(text_file, **{"train.steps": 30, "train.eval_every": 10, "optim.lr": 1e-2,
                                         "metrics.peak_flops": 0}), run)
    assert result.steps_done == 30 and result.stop_reason == "completed"
    for name in ("config.toml", "metrics.jsonl", "tokenizer.json", "data/meta.json", "checkpoints/step-30"):
        assert (run / name).exists(), name
    train_rows = rows(run, "train")
    assert [r["step"] for r in train_rows] == list(range(1, 31))
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "memory_mb", "data_wait_ms", "step_ms"):
        assert all(math.isfinite(r[key]) for r in train_rows), key
    assert 0 < train_rows[-1]["mfu"] < 1
    evals = rows(run, "eval")
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert evals[-1]["val_bpb"] == pytest.approx(evals[-1]["val_loss"] / math.log(2), rel=0.05)  # bytes
    assert len(list((run / "checkpoints").glob("step-*"))) == 2  # keep_last


@pytest.mark.parametrize("extra", [{"model.dropout": 0.1}, {"optim.name": "lamb", "train.grad_accum": 2}])
def test_exact_resume_is_bitwise(tmp_path, text_file, extra):
    cfg = {"train.steps": 12, "train.eval_every": 4, "checkpoint.every": 0, **extra}
    straight = tmp_path / "straight"
    train(cfg_for(text_file, **cfg), straight)
    paused = tmp_path / "paused"
    r = train(cfg_for(text_file, **cfg), paused, stop_at=6)
    assert r.steps_done == 6 and "paused" in r.stop_reason
    train(load_config(paused / "config.toml"), paused, resume=True)
    a = {x["step"]: (x["loss"], x["grad_norm"], x["lr"]) for x in rows(straight, "train")}
    b = {x["step"]: (x["loss"], x["grad_norm"], x["lr"]) for x in rows(paused, "train")}
    assert a == b
    assert [e["val_loss"] for e in rows(straight, "eval")] == [e["val_loss"] for e in rows(paused, "eval")]


def test_a_finished_run_run_again_reports_the_losses_it_recorded(tmp_path, text_file):
    # the README's `kiln train` twice: the second finds the last checkpoint at the last step
    cfg = {"train.steps": 6, "train.eval_every": 3, "checkpoint.every": 3}
    first = train(cfg_for(text_file, **cfg), tmp_path / "run")
    again = train(cfg_for(text_file, **cfg), tmp_path / "run")
    assert again.steps_done == 6 and again.stop_reason == "completed"
    assert (again.final_loss, again.last_val_loss) == (first.final_loss, first.last_val_loss)
    assert math.isfinite(again.final_loss) and math.isfinite(again.last_val_loss)


def test_grad_accumulation_matches_bigger_batch(tmp_path, text_file):
    big = train(cfg_for(text_file, **{"train.steps": 1, "train.batch_size": 4, "train.eval_every": 0}), tmp_path / "a")
    acc = train(cfg_for(text_file, **{"train.steps": 1, "train.batch_size": 2, "train.grad_accum": 2,
                                      "train.eval_every": 0}), tmp_path / "b")
    assert acc.final_loss == pytest.approx(big.final_loss, rel=1e-5)
    ga = rows(tmp_path / "a", "train")[0]["grad_norm"]
    gb = rows(tmp_path / "b", "train")[0]["grad_norm"]
    assert gb == pytest.approx(ga, rel=1e-4)


def test_non_finite_steps_are_skipped_then_stop(tmp_path, text_file, monkeypatch):
    real_loss = loss_mod.lm_loss
    calls = {"n": 0}

    def flaky(logits, targets):
        calls["n"] += 1
        loss = real_loss(logits, targets)
        return loss * float("nan") if calls["n"] in (3,) or calls["n"] > 6 else loss

    monkeypatch.setattr(loss_mod, "lm_loss", flaky)
    run = tmp_path / "nan"
    with pytest.raises(KilnError, match="3 non-finite steps in a row"):
        # the full loss on any device (`auto` takes the chunked one on a GPU, which lm_loss is not)
        train(cfg_for(text_file, **{"train.max_nonfinite_steps": 3, "train.eval_every": 0,
                                    "train.loss": "'full'"}), run)
    skipped = [r["step"] for r in rows(run, "train") if r["skipped"]]
    assert skipped == [3, 7, 8, 9]


def test_early_stopping(tmp_path, text_file):
    run = tmp_path / "es"
    result = train(cfg_for(text_file, **{"train.steps": 200, "train.eval_every": 2, "optim.lr": 1e-7,
                                         "schedule.warmup_steps": 0, "train.early_stopping_patience": 2,
                                         "train.early_stopping_min_delta": 0.5}), run)
    assert result.stop_reason.startswith("early stop") and result.steps_done == 6
    assert (run / "checkpoints" / "step-6").is_dir()


def test_extra_eval_sets(tmp_path, text_file):
    extra = tmp_path / "held-out.txt"
    extra.write_text("print('hello world')\n" * 200)
    run = tmp_path / "ev"
    train(cfg_for(text_file, **{"train.steps": 2, "train.eval_every": 2, "train.eval_sets": f"[{str(extra)!r}]"}), run)
    row = rows(run, "eval")[0]
    assert {"held_out_loss", "held_out_ppl", "held_out_bpb", "val_loss"} <= row.keys()


def test_fresh_start_refuses_existing_checkpoints(tmp_path, text_file):
    run = tmp_path / "r"
    train(cfg_for(text_file, **{"train.steps": 2, "train.eval_every": 0}), run)
    with pytest.raises(KilnError, match="already has checkpoints"):
        train(cfg_for(text_file, **{"train.steps": 2}), run, resume=False)
    with pytest.raises(KilnError, match="no checkpoint to resume"):
        train(cfg_for(text_file), tmp_path / "empty", resume=True)


def test_float8_on_cpu_is_refused_before_anything_is_written(tmp_path, text_file):
    """float8 is GPU-only: the one-line refusal comes before the run directory, the shards or the
    model exist (it used to come from parallelize, after the shards were written)."""
    run = tmp_path / "r"
    with pytest.raises(KilnError, match=r"train\.float8=true needs a CUDA GPU"):
        train(cfg_for(text_file, **{"train.float8": "true", "train.device": "cpu"}), run)
    assert not run.exists()


def test_seq_len_larger_than_data(tmp_path):
    p = tmp_path / "small.txt"
    p.write_text("tiny corpus " * 3)
    with pytest.raises(KilnError, match="seq_len"):
        train(cfg_for(p), tmp_path / "r")


@pytest.mark.parametrize("mode", ["full", "selective", "every_k:3", "op"])
def test_activation_checkpointing_matches_plain(tmp_path, text_file, mode):
    # "op" with dropout is refused (test_op_checkpointing_with_dropout_is_one_line)
    base = {"train.steps": 3, "train.eval_every": 0, "model.dropout": 0.0 if mode == "op" else 0.1,
            "model.n_layers": 3}
    plain = train(cfg_for(text_file, **base), tmp_path / "plain")
    ac = train(cfg_for(text_file, **base, **{"train.activation_checkpointing": mode}), tmp_path / mode)
    a = [r["loss"] for r in rows(tmp_path / "plain", "train")]
    b = [r["loss"] for r in rows(tmp_path / mode, "train")]
    assert b == pytest.approx(a, rel=1e-5)
    assert ac.steps_done == plain.steps_done == 3


def test_op_checkpointing_with_dropout_is_one_line(tmp_path, text_file, capsys):
    from kiln.cli import main

    run = tmp_path / "run"
    sets = {"model.dropout": 0.1, "train.activation_checkpointing": "'op'"}
    args = [x for o in tiny_overrides(text_file, **sets) for x in ("--set", o)]
    assert main(["train", "--run-dir", str(run), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "train.activation_checkpointing='op' with model.dropout=0.1 is not supported" in lines[0]
    assert not run.exists()
    load_config(None, tiny_overrides(text_file, **{**sets, "model.dropout": 0.0}))


def test_shards_are_cached_and_foreign_dirs_left_alone(tmp_path, text_file):
    run = tmp_path / "r"
    train(cfg_for(text_file, **{"train.steps": 1, "train.eval_every": 0}), run)
    meta = (run / "data" / "meta.json").stat().st_mtime_ns
    # same data settings in another run dir sharing the shard dir: reused, not rewritten
    shared = {"data.shards_dir": f"'{run / 'data'}'", "train.steps": 1, "train.eval_every": 0}
    train(cfg_for(text_file, **shared), tmp_path / "r3")
    assert (run / "data" / "meta.json").stat().st_mtime_ns == meta
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(KilnError, match="not kiln shards"):
        train(cfg_for(text_file, **{"data.shards_dir": f"'{foreign}'"}), tmp_path / "r4")
    assert (foreign / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("case", ["cannot sum", "hsdp"])
def test_fsdp_on_cpu_where_gloo_sums_and_fsdp2_cannot_sum_instead_is_one_line(tmp_path, text_file, monkeypatch,
                                                                                capsys, case):
    """Where gloo's AVG reduce-scatter sums and FSDP2 cannot be told to sum and divide (kiln/
    torch_compat.py fsdp_can_force_sum): 2.6-like, none; 2.7, not for HSDP, whose all-reduce asks
    gloo for AVG. Training would run on the sum of the ranks' gradients (or fail at the first
    all-reduce), so kiln says so once the mesh is built (its probe), before any work."""
    from kiln import torch_compat
    from kiln.cli import main
    from kiln.parallel.dims import ParallelDims

    monkeypatch.setattr(torch_compat, "fsdp_runs_on_cpu", lambda: True)
    monkeypatch.setattr(torch_compat, "gloo_reduce_scatter_averages", lambda: False)
    monkeypatch.setattr(torch_compat, "fsdp_can_force_sum", lambda hsdp=False: case == "hsdp" and not hsdp)
    monkeypatch.setattr(ParallelDims, "build_mesh", lambda self, device_type, **kwargs: None)  # one process: no group
    world = 4 if case == "hsdp" else 2
    for key, value in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "fsdp"
    args = ["train", "--run-dir", str(run)]
    layout = ({"parallel.dp_mode": "'fsdp'", "parallel.dp_replicate": "2", "parallel.dp_shard": "2"}
              if case == "hsdp" else {"parallel.dp_mode": "'zero2'"})
    for o in tiny_overrides(text_file, **{"train.device": "'cpu'", **layout}):
        args += ["--set", o]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    mode = "fsdp" if case == "hsdp" else "zero2"
    assert len(lines) == 1 and f"parallel.dp_mode='{mode}' on CPU" in lines[0] and "gloo sums" in lines[0], lines
    assert "'ddp'" in lines[0] and not run.exists()
    assert ("parallel.dp_replicate=1" in lines[0]) == (case == "hsdp")


def test_fsdp_on_cpu_with_a_torch_whose_fsdp2_cannot_run_there_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    """torch 2.6's FSDP2 fails at the first all-gather on CPU (its CPU streams record no events,
    kiln/torch_compat.py); kiln says so before any work, naming the setting that runs instead."""
    from kiln import torch_compat
    from kiln.cli import main

    monkeypatch.setattr(torch_compat, "fsdp_runs_on_cpu", lambda: False)
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "fsdp"
    args = ["train", "--run-dir", str(run)]
    for o in tiny_overrides(text_file, **{"train.device": "'cpu'"}):
        args += ["--set", o]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "parallel.dp_mode='fsdp' on CPU" in lines[0] and "'ddp'" in lines[0], lines
    assert not run.exists()


def test_a_derived_grad_accum_is_one_event_printed_once(tmp_path, text_file, capsys):
    cfg = cfg_for(text_file, **{"train.steps": 2, "train.eval_every": 0, "train.batch_size": 2,
                                "train.global_batch_size": 8})
    train(cfg, tmp_path / "run")
    out = capsys.readouterr()
    note = "train.grad_accum=4 (the config had 1): train.global_batch_size=8 = train.batch_size=2 x 1"
    assert (out.out + out.err).count(note) == 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["message"] for r in rows if r["kind"] == "event" and note in r["message"]]
    (run,) = [r for r in rows if r["kind"] == "run"]
    assert (run["grad_accum"], run["global_batch_size"], run["tokens_per_step"]) == (4, 8, 8 * 32)
    assert "global_batch_size = 8" in (tmp_path / "run" / "config.toml").read_text()
