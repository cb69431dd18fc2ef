"""model.fused_projections: q/k/v (and a gated MLP's w1/w3) as one GEMM over concatenated weights
gives the loss and every parameter's gradient of the separate Linears, in eager mode, under
torch.compile (CPU inductor) and under FSDP2 on 2 gloo ranks (fused path taken); tensor
parallel, float8-style Linear subclasses and hooked Linears fall back to the separate calls.

Tolerance: fp32, loss relative 1e-6 and gradients rtol 1e-5 / atol 1e-7 in one process (the
fused GEMM only changes how the matmul library blocks the same dot products); on 2 ranks rtol
1e-4 / atol 1e-6, since averaging two half-batch gradients also reorders the sums. A fusion that
hands the wrong slice to a projection misses these by orders of magnitude
(test_tolerance_catches_a_wrong_split).
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import ModelConfig, load_config
from kiln.errors import ConfigError
from kiln.model import transformer as tr
from kiln.model.transformer import Transformer, fusable
from kiln.train.system import resolve_fused_projections

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)

LOSS_REL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-7
RANKS_RTOL, RANKS_ATOL = 1e-4, 1e-6
BATCH, SEQ = 4, 16

# MHA and GQA, gated (SwiGLU) and plain (GeLU) MLP, with and without biases.
CONFIGS = {
    "mha_gated": dict(),
    "gqa_gated_bias": dict(n_kv_heads=2, bias=True),
    "gqa_gated_qkv_bias": dict(n_kv_heads=2, qkv_bias=True),  # Qwen2: q/k/v fused with biases, w1/w3 without
    "mha_gelu_bias": dict(activation="gelu", bias=True, norm="layernorm", positions="learned"),
    "gqa_gelu": dict(n_kv_heads=1, activation="gelu"),
}


def config(fused: bool, **kw) -> ModelConfig:
    base = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, fused_projections=fused)
    return ModelConfig(**{**base, **kw})


def build(fused: bool, **kw) -> Transformer:
    model = Transformer(config(fused, **kw))
    model.init_weights(torch.Generator().manual_seed(0))
    if kw.get("bias") or kw.get("qkv_bias"):  # init zeroes biases; give them values so a misplaced bias slice shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def batch(rows=slice(None)):
    tokens = torch.randint(0, 61, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))[rows]
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model):
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    # (a compiled block names its parameters through _orig_mod)
    return loss.item(), {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()}


def count_fused_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = tr.fused_linear

    def counting(x, linears):
        calls[0] += 1
        return original(x, linears)

    monkeypatch.setattr(tr, "fused_linear", counting)
    return calls


def assert_same(got, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL, loss_rel=LOSS_REL):
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert loss == pytest.approx(ref_loss, rel=loss_rel)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("name", CONFIGS)
def test_fused_forward_and_backward_match_separate_linears(name, monkeypatch):
    kw = CONFIGS[name]
    expected = loss_and_grads(build(False, **kw))
    calls = count_fused_calls(monkeypatch)
    got = loss_and_grads(build(True, **kw))
    gated = kw.get("activation", "swiglu") != "gelu"
    assert calls[0] == 2 * (2 if gated else 1)  # per layer: q/k/v, and w1/w3 when gated
    assert_same(got, expected)


def test_tolerance_catches_a_wrong_split(monkeypatch):
    expected = loss_and_grads(build(False, n_kv_heads=2))
    original = tr.fused_linear

    def k_and_v_swapped(x, linears):  # a fusion bug: the key projection's slice read as the value
        out = original(x, linears)
        return (out[0], out[2], out[1]) if len(out) == 3 else out

    monkeypatch.setattr(tr, "fused_linear", k_and_v_swapped)
    with pytest.raises(AssertionError):
        assert_same(loss_and_grads(build(True, n_kv_heads=2)), expected)


def test_the_config_key_reaches_every_block():
    cfg = load_config(None, ["model.fused_projections=true", "model.vocab_size=61", "model.dim=32",
                             "model.n_heads=4", "model.n_layers=2"])
    model = Transformer(cfg.model)
    assert all(b.attention.fused_projections and b.feed_forward.fused_projections for b in model.layers)
    assert ModelConfig().fused_projections == "auto"  # the default, chosen in benchmarks/README.md
    unresolved = Transformer(replace(cfg.model, fused_projections="auto"))  # evaluation, export
    assert not any(b.attention.fused_projections for b in unresolved.layers)


@pytest.mark.parametrize("value, device, fsdp, fused", [
    ("auto", "cuda", False, True), ("auto", "cuda", True, False), ("auto", "cpu", False, False),
    (True, "cpu", True, True), (False, "cuda", False, False)])
def test_auto_fuses_on_a_gpu_unless_fsdp_shards_the_weights(value, device, fsdp, fused):
    assert resolve_fused_projections(value, torch.device(device), fsdp) is fused


def test_build_model_resolves_auto_and_a_resumed_run_may_differ(tmp_path):
    from kiln.parallel.dims import ParallelDims
    from kiln.train.run_files import RESUMABLE
    from kiln.train.trainer import build_model

    cfg = load_config(None, ["model.vocab_size=61", "model.dim=32", "model.n_heads=4", "model.n_layers=2"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
    model = build_model(cfg, dims, torch.device("cpu"))
    assert cfg.model.fused_projections is False and not model.layers[0].attention.fused_projections
    assert "model.fused_projections" in RESUMABLE  # a run started on a GPU (fused) continues on a CPU


class StandInFloat8Linear(nn.Linear):
    """Like torchao's Float8Linear: an nn.Linear subclass whose forward does its own (quantized)
    matmul; here the weight is rounded to a coarse grid so a bypassed forward shows in the output."""

    calls = 0

    def forward(self, x):
        StandInFloat8Linear.calls += 1
        return nn.functional.linear(x, torch.round(self.weight * 8) / 8, self.bias)


def test_linear_subclasses_and_hooked_linears_are_never_fused(monkeypatch):
    model = build(True, n_kv_heads=2)
    block = model.layers[0]
    assert fusable(block.attention.wq, block.attention.wk, block.attention.wv)
    quantized = StandInFloat8Linear(32, 32 // 4 * 2, bias=False)
    quantized.weight = block.attention.wk.weight
    block.attention.wk = quantized
    assert not fusable(block.attention.wq, block.attention.wk, block.attention.wv)
    seen = []
    block.feed_forward.w3.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert not fusable(block.feed_forward.w1, block.feed_forward.w3)
    calls = count_fused_calls(monkeypatch)
    StandInFloat8Linear.calls = 0
    x, y = batch()
    model(x, y).backward()
    # Layer 0 runs both subclass and hook; layer 1 still fuses both of its groups.
    assert StandInFloat8Linear.calls == 1 and len(seen) == 1 and calls[0] == 2
    assert fusable(model.layers[1].attention.wq, model.layers[1].attention.wk, model.layers[1].attention.wv)


def test_mixed_biases_are_not_fused():
    with_bias, without = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
    assert not fusable(with_bias, without) and fusable(with_bias, nn.Linear(4, 2))


@pytest.mark.timeout(240)
def test_compiled_fused_blocks_match_eager_separate_linears(monkeypatch):
    # kiln's per-block compile (fullgraph=True: the fusable() checks must trace without a graph
    # break), CPU inductor, against the eager separate Linears
    from kiln.parallel.parallelize import apply_compile

    kw = {**CONFIGS["gqa_gated_bias"], "n_layers": 1}
    expected = loss_and_grads(build(False, **kw))
    model = build(True, **kw)
    calls = count_fused_calls(monkeypatch)
    apply_compile(model, "blocks")
    got = loss_and_grads(model)
    assert calls[0] >= 2  # traced through fused_linear (q/k/v and w1/w3), not the separate Linears
    # inductor also fuses the elementwise ops around the GEMMs, which reorders a few more sums
    assert_same(got, expected, rtol=1e-4, atol=1e-6, loss_rel=1e-5)


# ---------------------------------------------------------------------------- 2 gloo ranks


def _fsdp_and_tp_rank(rank, world, kw):
    """FSDP2 (kiln's apply_data_parallel, half the batch per rank) then TP (kiln's plan, the
    whole batch): (loss, full gradients, fused_linear calls) for each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import torch.distributed as dist

    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import apply_data_parallel
    from kiln.parallel.tensor_parallel import tp_plan

    calls = [0]
    original = tr.fused_linear

    def counting(x, linears):
        calls[0] += 1
        return original(x, linears)

    tr.fused_linear = counting

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = {}
    job = load_config(None, ["parallel.dp_mode=fsdp"])
    dims = ParallelDims(1, world, 1, 1, 1, 1, world, rank, dp_mode="fsdp")
    dims.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = build(True, **kw)  # same seed on every rank: the same full weights, then sharded
    apply_data_parallel(model, dims, job, torch.device("cpu"))
    x, y = batch(slice(rank * BATCH // world, (rank + 1) * BATCH // world))
    loss = model(x, y)
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # the mean: gloo refuses AVG on torch 2.7
    loss /= world
    out["fsdp"] = (loss.item(), {n: full(p.grad) for n, p in model.named_parameters()}, calls[0])

    calls[0] = 0
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(config(True, **kw))
    parallelize_module(model, mesh, tp_plan(model))
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))  # also the RoPE tables (buffers)
    reference = dict(build(True, **kw).named_parameters())
    with torch.no_grad():  # the one-process weights, sharded as the plan places them
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(reference[name].detach(), mesh, p.placements))
    x, y = batch()
    loss = full(model(x, y))
    loss.backward()
    out["tp"] = (loss.item(), {n: full(p.grad) for n, p in model.named_parameters()}, calls[0])
    return out


@pytest.mark.timeout(240)
def test_fsdp2_fuses_and_tp_falls_back_both_matching_one_process(tmp_path):
    kw = CONFIGS["gqa_gated_bias"]
    expected = loss_and_grads(build(False, **kw))
    per_rank = run_ranks(_fsdp_and_tp_rank, 2, tmp_path, kw, timeout=200)
    for got in per_rank:
        fsdp_loss, fsdp_grads, fsdp_calls = got["fsdp"]
        assert fsdp_calls == 2 * 2  # FSDP2 unshards to plain tensors in forward: both groups fuse per layer
        assert_same((fsdp_loss, fsdp_grads), expected, RANKS_RTOL, RANKS_ATOL, loss_rel=1e-5)
        tp_loss, tp_grads, tp_calls = got["tp"]
        assert tp_calls == 0  # DTensor weights and TP's hooks: the separate Linears run
        assert_same((tp_loss, tp_grads), expected, RANKS_RTOL, RANKS_ATOL, loss_rel=1e-5)


@pytest.mark.parametrize("value, message", [
    ('"yes"', "model.fused_projections='yes' is not true, false or 'auto'"),
    ("2", "model.fused_projections=2 has the wrong type; expected bool | str"),
    ('"True"', "model.fused_projections='True' is not true, false or 'auto'")])
def test_a_bad_value_is_one_line_naming_the_key_and_what_it_takes(tmp_path, value, message):
    job = tmp_path / "job.toml"
    job.write_text(f"[model]\nfused_projections = {value}\n")
    for attempt in (lambda: load_config(job), lambda: load_config(None, [f"model.fused_projections={value}"])):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert message in str(err.value) and "\n" not in str(err.value)
