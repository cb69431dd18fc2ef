"""benchmarks/plan_validation.py --gpu-results: single-GPU cases predicted with the h100 preset and
leave-one-out calibrated, on a small synthetic file whose step times a known device made."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.plan.calibrate import Measurement, predicted_step
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape, rank_memory

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_validation.py"


def _module():
    spec = importlib.util.spec_from_file_location("plan_validation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cases():
    """Four cases timed by an H100 whose efficiency curve differs from the preset's; peak memory
    the model's own, +3% on the last case."""
    truth = load_cluster("h100")
    truth.device.max_efficiency, truth.device.half_efficiency_work = 0.45, 8e5
    out = []
    for i, (dim, layers, batch, ac, compiled) in enumerate(((768, 12, 8, "none", True), (1024, 16, 4, "none", True),
                                                            (2048, 16, 4, "full", True), (768, 12, 8, "none", False))):
        model = ModelConfig(dim=dim, n_layers=layers, n_heads=dim // 64, vocab_size=50304, max_seq_len=1024)
        layout = Layout(micro_batch=batch, ac=ac, compiled=compiled)
        shape = ModelShape.from_config(model, 50304)
        step_s = predicted_step(Measurement("x", shape, layout, 1024, 1.0), truth)
        peak = rank_memory(shape, layout, 1024).total * (1.03 if i == 3 else 1.0)
        out.append({"case": f"case {i}", "shape": f"d{dim}", "step_ms": step_s * 1e3, "peak_mem_gb": peak / 1e9,
                    "plan": {"model": dataclasses.asdict(model), "batch": batch, "seq": 1024, "grad_accum": 1,
                             "ac": ac, "compile": compiled, "loss": "full", "precision": "bf16", "optimizer": "adamw",
                             "cuda_graphs": False}})
    out.append({"case": "no plan: skipped", "shape": "x", "step_ms": 1.0, "peak_mem_gb": 1.0})
    return out


def test_gpu_results_table_preset_and_leave_one_out(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(_cases()))
    out = _module().gpu_validation(str(path), "h100")
    rows = {r["case"]: r for r in out["rows"]}
    assert len(rows) == 4 and out["skipped"] == ["no plan: skipped"]
    for r in rows.values():
        assert abs(r["loo_error"]) < 0.05, r  # the other three pin the true efficiency curve
        assert abs(r["preset_error"]) > 0.05  # the preset's curve is not the truth's
    assert rows["case 3"]["peak_error"] == pytest.approx(1 / 1.03 - 1)
    assert rows["case 0"]["peak_error"] == pytest.approx(0.0)
    assert out["summary"]["time_within_loo"] == 4 and out["summary"]["memory_within"] == 4
    text = capsys.readouterr().out
    assert "| case 2 | d2048 | dp=1x1(ddp) mb=4 ga=1 ac=full compiled |" in text


def test_compiled_peak_is_the_larger_phase():
    shape = ModelShape.from_config(ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304), 50304)
    tokens, casts = 8 * 1024, 2 * (12 * shape.layer_params + shape.vocab * shape.dim)
    eager, compiled = (rank_memory(shape, Layout(micro_batch=8, compiled=c), 1024) for c in (False, True))
    # end of forward: no gradients yet (zeroed to None); the fused loss keeps one bf16 logits tensor
    assert compiled.notes == ["compiled peak at the end of forward"] and compiled.gradients == 0
    assert compiled.temporary == pytest.approx(2 * tokens * shape.vocab + casts)
    assert eager.temporary == pytest.approx(12 * tokens * shape.vocab + casts)  # 3 fp32 logits (eager_loss_logits)
    assert compiled.activations == pytest.approx(12 * shape.act_bytes_per_token(2, True) * tokens)
    # grad_accum > 1: the earlier micro-batches' gradients are resident during forward
    ga = rank_memory(shape, Layout(micro_batch=8, grad_accum=2, compiled=True), 1024)
    assert ga.gradients == ga.parameters and ga.total == pytest.approx(compiled.total + ga.parameters)
    # full AC, one short sequence: the end of backward (all gradients, one block recomputed) is larger
    ac = rank_memory(shape, Layout(micro_batch=1, ac="full", compiled=True), 128)
    assert ac.notes == ["compiled peak at the end of backward"] and ac.gradients == ac.parameters
    assert ac.activations == 0 and ac.temporary == pytest.approx(
        2 * shape.layer_params + (4 * shape.dim + shape.act_bytes_per_token(2, True)) * 128)


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c.update(step_ms="fast"), "cases[0]: step_ms 'fast'"),
    (lambda c: c["plan"].update(batch=0), "cases[0].plan.batch 0"),
    (lambda c: c["plan"].update(precision="int4"), "cases[0].plan.precision 'int4'"),
    (lambda c: c["plan"]["model"].update(colour=1), "cases[0].plan: unknown key model.colour"),
    (lambda c: c["plan"].update(ac="sometimes"), "cases[0].plan.ac 'sometimes'"),
])
def test_bad_gpu_results_name_the_case_and_key(tmp_path, mutate, message):
    cases = _cases()[:1]
    mutate(cases[0])
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(cases))
    with pytest.raises(KilnError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        _module().gpu_validation(str(path))


def test_command_line_bad_file_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    path.write_text("{")
    monkeypatch.setattr(sys, "argv", ["plan_validation.py", "--gpu-results", str(path), "--gpu-out",
                                      str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as exit_:
        _module().main()
    message = str(exit_.value.code)  # what the interpreter prints to stderr, exit status 1
    assert "not JSON" in message and "\n" not in message
    assert not (tmp_path / "out.json").exists()


def test_compiled_memory_bound_terms_count_bytes():
    """elementwise_bytes by hand for a gated RoPE model, and the step's memory-bound term is those
    bytes plus gradient clipping's 12 per parameter at the memory bandwidth; eager runs have none."""
    from kiln.plan.timing import elementwise_bytes, step_time

    shape = ModelShape.from_config(ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                                               vocab_size=128256), 128256)
    d, kv, f = 2048, 512, 8192
    forward = 2 * 6 * d + 2 * 10 * d + 4 * 2 * (d + kv) + 4 * d + 6 * f
    layout = Layout(micro_batch=4, compiled=True)
    assert elementwise_bytes(shape, layout, 2048) == 16 * 3 * forward + 6 * 128256
    h100 = load_cluster("h100")
    t = step_time(shape, layout, 2048, h100)
    params = shape.embedding_params + 16 * shape.layer_params
    bw = h100.device.memory_bandwidth_gbps * 1e9
    assert t.memory_bound == pytest.approx((elementwise_bytes(shape, layout, 2048) * 8192 + 12 * params) / bw)
    assert step_time(shape, Layout(micro_batch=4), 2048, h100).memory_bound == 0
    # full AC runs each block's forward once more
    ac = Layout(micro_batch=4, ac="full", compiled=True)
    assert elementwise_bytes(shape, ac, 2048) == 16 * 4 * forward + 6 * 128256


def test_float8_speeds_up_only_the_block_linears_and_pays_for_casts():
    from kiln.plan.timing import step_time

    shape = ModelShape.from_config(ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                                               vocab_size=128256), 128256)
    h100 = load_cluster("h100")
    bf16, fp8 = (step_time(shape, Layout(micro_batch=4, compiled=True, precision=p), 2048, h100)
                 for p in ("bf16", "float8"))
    linear_share = 6 * 16 * shape.layer_params / (bf16.flops / (4 * 2048))  # of the model FLOPs
    # compute: the linears' share at the float8 peak (1979 vs 989 TFLOP/s), the rest (head, attention) unchanged
    assert fp8.compute == pytest.approx(bf16.compute * (1 - linear_share + linear_share * 989 / 1979))
    assert 1.0 < bf16.compute / fp8.compute < 2.0
    d, kv, f = 2048, 512, 8192
    casts = 7 * (2 * d + 2 * (d + kv) + 2 * d + 3 * (d + f)) * 16 * 8192 + 11 * 16 * shape.layer_params
    assert fp8.memory_bound - bf16.memory_bound == pytest.approx(casts / (h100.device.memory_bandwidth_gbps * 1e9))


@pytest.mark.parametrize("activation,positions,ac,ga", [
    ("swiglu", "rope", "none", 1), ("gelu", "learned", "none", 1), ("swiglu", "rope", "full", 1),
    ("gelu", "learned", "selective", 4)])
def test_eager_count_bounds_the_compiled_one(activation, positions, ac, ga):
    """Per-block compile (every sharded run) is counted with the eager model, by kiln plan and by
    kiln train's refusal (kiln/train/memory.py layout_of): it must not count less than a compiled
    run of the same model needs."""
    model = ModelConfig(dim=1024, n_layers=8, n_heads=16, vocab_size=32000, activation=activation, positions=positions)
    shape = ModelShape.from_config(model, 32000)
    eager, compiled = (rank_memory(shape, Layout(micro_batch=4, grad_accum=ga, ac=ac, compiled=c), 1024).total
                       for c in (False, True))
    assert eager >= compiled


def test_search_plans_one_device_compiled_runs_with_the_compiled_model():
    from kiln.plan.search import search

    shape = ModelShape.from_config(ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304), 50304)
    one = load_cluster("h100")
    one.gpus_per_node = 1
    eager, compiled = (search(shape, one, 1024, 16, compiled=c)[0] for c in (False, True))
    assert compiled.layout.compiled and not eager.layout.compiled
    assert compiled.memory.total == pytest.approx(rank_memory(shape, compiled.layout, 1024).total)
    assert compiled.memory.total < eager.memory.total and compiled.time.memory_bound > 0
    # sharded layouts compile per block (kiln's auto scope): planned with the eager terms
    eight = search(shape, load_cluster("h100"), 1024, 16, compiled=True)
    assert not any(p.layout.compiled for p in eight)
