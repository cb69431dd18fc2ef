import math

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig, from_dict
from kiln.errors import ConfigError
from kiln.model.moe import MoE
from kiln.model.transformer import FeedForward, Transformer, count_params, ffn_hidden_size, flops_per_token


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 53, "dim": 16, "n_layers": 2, "n_heads": 2, "max_seq_len": 16,
                          "moe_experts": 4, **kw})


def build(**kw) -> Transformer:
    model = Transformer(cfg(**kw))
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, gates (renormalized for k > 1), weighted expert MLPs."""
    ex = moe.experts
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            probs = (x[b, t].float() @ moe.router.weight.float().t()).softmax(-1)
            gates, idx = probs.topk(moe.top_k)
            if moe.top_k > 1:
                gates = gates / gates.sum()
            for g, e in zip(gates, idx):
                h = ex.act(x[b, t] @ ex.w1[e])
                if ex.w3 is not None:
                    h = h * (x[b, t] @ ex.w3[e])
                out[b, t] += g * (h @ ex.w2[e])
    return out


@pytest.mark.parametrize("top_k,activation", [(1, "swiglu"), (2, "gelu"), (3, "geglu")])
def test_dropless_moe_equals_token_by_token_definition(top_k, activation):
    moe = build(moe_top_k=top_k, moe_capacity_factor=0.0, activation=activation).layers[0].feed_forward
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.last_dropped_fraction.item() == 0.0


def test_capacity_drops_overflow_in_token_order_and_dropped_tokens_pass_nothing():
    moe = build(moe_top_k=1, moe_capacity_factor=1.0).layers[0].feed_forward
    with torch.no_grad():  # route every token to expert 2: capacity ceil(1.0 * 1 * 8 / 4) = 2 per sequence
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 10.0
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2))
    x[..., 0] = 1.0
    out = moe(x)
    full = reference_moe(moe, x)
    torch.testing.assert_close(out[:, :2], full[:, :2], rtol=1e-5, atol=1e-6)  # first 2 tokens kept
    assert torch.all(out[:, 2:] == 0)  # the rest dropped (the residual carries them)
    assert moe.last_dropped_fraction.item() == pytest.approx(6 / 8)


def test_aux_and_z_loss_values_for_a_uniform_router():
    moe = build(moe_top_k=1).layers[0].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(2, 8, 16))
    # Uniform probabilities P_e = 1/E; ties send every token to one expert, f = (1, 0, 0, 0):
    # E * sum f_e P_e = 1 (Switch's minimum is also 1, at perfect balance); z = log(E)^2.
    assert moe.last_aux_loss.item() == pytest.approx(1.0)
    assert moe.last_z_loss.item() == pytest.approx(math.log(4) ** 2)


def test_aux_loss_is_lowest_when_balanced():
    moe = build(moe_top_k=1, moe_experts=2).layers[0].feed_forward
    x = torch.zeros(1, 4, 16)
    x[0, :2, 0], x[0, 2:, 0] = 1.0, -1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 5.0, -5.0
    moe(x)
    balanced = moe.last_aux_loss.item()
    x[0, :, 0] = 1.0
    moe(x)
    assert balanced == pytest.approx(1.0, abs=1e-3) and moe.last_aux_loss.item() > 1.9


def test_routing_does_not_depend_on_how_the_batch_is_split():
    # Capacity and the balancing loss are per sequence: what makes N data-parallel ranks equal one process.
    moe = build(moe_top_k=2, moe_capacity_factor=0.5).layers[1].feed_forward
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))
    whole = moe(x)
    aux_whole = moe.last_aux_loss
    halves = [moe(x[:2]), moe(x[2:])]
    torch.testing.assert_close(whole, torch.cat(halves))
    aux_halves = moe.last_aux_loss
    moe(x[:2])
    torch.testing.assert_close(aux_whole, (moe.last_aux_loss + aux_halves) / 2)


def test_router_runs_in_fp32_under_bf16_autocast():
    moe = build().layers[0].feed_forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(1, 8, 16))
    assert moe.last_z_loss.dtype == torch.float32 and moe.last_aux_loss.dtype == torch.float32


def test_model_loss_adds_weighted_aux_losses_and_exposes_them():
    model = build(moe_aux_loss_weight=0.5, moe_z_loss_weight=0.25)
    tokens = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(4))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    aux, z = model.moe_losses
    plain = F.cross_entropy(model(tokens[:, :-1]).view(-1, 53), tokens[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(plain.item() + 0.5 * aux.item() + 0.25 * z.item(), rel=1e-6)
    assert not model.moe_losses.requires_grad
    loss.backward()
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0


def test_dense_path_unchanged_and_moe_every():
    dense = Transformer(cfg(moe_experts=0))
    assert all(isinstance(b.feed_forward, FeedForward) for b in dense.layers)
    assert dense.moe_losses is None
    mixed = Transformer(cfg(n_layers=4, moe_every=2))
    kinds = [type(b.feed_forward) for b in mixed.layers]
    assert kinds == [FeedForward, MoE, FeedForward, MoE]


def test_active_parameters_and_flops_count_top_k_experts():
    model = build(moe_top_k=2)
    counts = count_params(model)
    per_expert = model.layers[0].feed_forward.experts.params_per_expert()
    assert counts["total"] - counts["active"] == 2 * (4 - 2) * per_expert
    dense_like = build(moe_experts=0)
    router = 4 * 16
    flops_gap = flops_per_token(model, 8) - flops_per_token(dense_like, 8)
    assert flops_gap == pytest.approx(6 * 2 * (router + per_expert))  # 2 layers: router + one extra expert


def test_expert_init_is_per_expert_and_scaled_like_the_dense_ffn():
    model = build(n_layers=4, moe_experts=8)
    w1, w2 = model.layers[0].feed_forward.experts.w1, model.layers[0].feed_forward.experts.w2
    assert not torch.equal(w1[0], w1[1])
    assert w1.std().item() == pytest.approx(0.02, rel=0.1)  # gpt2 scheme: std, residual std / sqrt(2L)
    assert w2.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


@pytest.mark.parametrize("raw,key", [
    ({"model": {"moe_experts": 2, "moe_top_k": 3}}, "model.moe_top_k=3"),
    ({"model": {"moe_experts": 6}, "parallel": {"ep": 4}}, "parallel.ep=4 must divide model.moe_experts=6"),
    ({"parallel": {"ep": 2}}, "parallel.ep=2 needs a mixture-of-experts model"),
    ({"model": {"moe_capacity_factor": -1.0}}, "model.moe_capacity_factor=-1.0"),
    ({"parallel": {"diloco_outer_momentum": 1.0}}, "parallel.diloco_outer_momentum=1.0"),
])
def test_bad_moe_and_diloco_settings_are_one_line_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        from_dict(raw).validate()


@pytest.mark.parametrize("kw", [dict(moe_top_k=2), dict(n_layers=4, moe_every=2, activation="gelu"),
                                dict(n_layers=4, moe_every=2, moe_hidden=8, moe_experts=8, moe_top_k=3),
                                dict(moe_top_k=2, moe_shared_experts=2, moe_hidden=8),
                                dict(n_layers=4, moe_every=2, moe_shared_experts=1, moe_shared_gate=True)])
def test_memory_planner_counts_the_experts(kw):
    from kiln.plan.memory import ModelShape

    model = Transformer(cfg(**kw))
    counts = count_params(model)
    shape = ModelShape.from_config(model.cfg, 53)
    assert shape.params == counts["total"]
    assert shape.active_params == counts["active"]
    assert shape.expert_params == sum(p.numel() for m in model.modules() if isinstance(m, MoE)
                                      for p in m.experts.parameters())


def test_fine_grained_experts_are_moe_hidden_wide():
    model = build(n_layers=2, moe_every=2, moe_hidden=8, moe_experts=8, moe_top_k=3, moe_capacity_factor=0.0)
    dense, moe = model.layers[0].feed_forward, model.layers[1].feed_forward
    assert dense.w1.weight.shape == (ffn_hidden_size(model.cfg), 16)
    assert moe.experts.w1.shape == (8, 16, 8) and moe.experts.w2.shape == (8, 8, 16)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-6)


# Sync-free forward (no expert parallelism): with torch's grouped matmul the forward never reads
# the device from the host. Two checks: Python-level reads (.item/.tolist/bool/int/float of a
# tensor) raise, and FakeTensorMode (no data at all: boolean indexing, nonzero, bincount and
# .item raise there) runs it in bf16, the dtype torch's grouped-matmul meta function takes.
# torch 2.6 has no F.grouped_mm: kiln's MoE runs its split loop there (moe.grouped_mm_runs)
NEEDS_GROUPED_MM = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),
                                      reason=f"torch {torch.__version__} has no torch.nn.functional.grouped_mm")
SYNC_CASES = [dict(moe_top_k=1, moe_capacity_factor=1.0), dict(moe_top_k=2, moe_capacity_factor=0.0, activation="gelu")]


def forward_refusing_host_reads(moe, x):
    from unittest import mock

    def refuse(*_args, **_kwargs):
        raise AssertionError("host read of a device tensor in the MoE forward")

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    with mock.patch.multiple(torch.Tensor, **{n: refuse for n in names}):
        return moe(x)


def forward_without_data(moe, x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return moe.to(torch.bfloat16)(x.to(torch.bfloat16))


@NEEDS_GROUPED_MM
@pytest.mark.parametrize("kw", SYNC_CASES)
def test_moe_forward_reads_nothing_on_the_host(kw, monkeypatch):
    moe = build(**kw).layers[0].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    out = forward_refusing_host_reads(moe, x)
    monkeypatch.setattr("kiln.model.moe.grouped_mm_runs", lambda *a: False)  # the split loop: as before
    torch.testing.assert_close(out, moe(x), rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    assert forward_without_data(moe, x).shape == x.shape


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),  # the same releases as NEEDS_GROUPED_MM
                    reason=f"torch {torch.__version__}'s FakeTensorMode refuses the mixed devices of this check")
@pytest.mark.parametrize("kw", SYNC_CASES)
def test_host_read_checks_fail_for_the_split_loop(kw, monkeypatch):
    # Negative control: the loop over experts (unaligned shapes) reads its split sizes on the host.
    monkeypatch.setattr("kiln.model.moe.grouped_mm_runs", lambda *a: False)
    moe = build(**kw).layers[0].feed_forward
    x = torch.randn(2, 8, 16)
    with pytest.raises(AssertionError, match="host read"):
        forward_refusing_host_reads(moe, x)
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        forward_without_data(moe, x)


@NEEDS_GROUPED_MM
@pytest.mark.parametrize("kw", SYNC_CASES)
def test_grouped_matmul_and_split_loop_agree_with_drops(kw, monkeypatch):
    """Outputs and gradients (input, router, experts) of the two expert paths, fp32, 1e-5;
    the capacity case drops assignments (their rows must pass nothing, not even a NaN)."""
    def run(grouped):
        monkeypatch.setattr("kiln.model.moe.grouped_mm_runs", lambda *a: grouped)
        moe = build(**kw).layers[0].feed_forward
        x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out, x.grad, moe.router.weight.grad, moe.experts.w1.grad, moe.experts.w2.grad], moe
    grouped, moe = run(True)
    loop, _ = run(False)
    for a, b in zip(grouped, loop):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if kw["moe_capacity_factor"]:
        assert moe.last_dropped_fraction.item() > 0  # the case exercises dropping


@NEEDS_GROUPED_MM
def test_grouped_mm_runs_only_where_torch_takes_it():
    from kiln.model.moe import grouped_mm_runs

    assert grouped_mm_runs(torch.zeros(2, 16), torch.zeros(4, 16, 64))
    assert not grouped_mm_runs(torch.zeros(2, 6), torch.zeros(4, 6, 64))  # 24-byte rows
    assert not grouped_mm_runs(torch.zeros(2, 16), torch.zeros(4, 16, 10))


@NEEDS_GROUPED_MM
def test_grouped_mm_is_not_traced_by_compile_outside_bf16(monkeypatch):
    """torch.compile traces with grouped_mm's meta function, which takes bf16 only: an fp32 MoE
    under `train.compile=true` must take the loop (it failed to compile before this rule)."""
    from kiln.model.moe import grouped_mm_runs

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not grouped_mm_runs(torch.zeros(2, 16), torch.zeros(4, 16, 64))
    assert grouped_mm_runs(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 64, dtype=torch.bfloat16))
