"""MoE routing options: sigmoid scores (DeepSeek-V3), gates left unnormalized (Qwen3-MoE's
norm_topk_prob=false), auxiliary-loss-free balancing (model.moe_bias_update_rate), and shared
experts (model.moe_shared_experts, optionally gated).
Layouts other than one process: tests/parallel/test_expert_bias_balancing.py."""

import contextlib

import pytest
import torch

from kiln.config import ModelConfig, from_dict
from kiln.errors import ConfigError
from kiln.model.moe import MoE, moe_layers, balance_experts
from kiln.model.transformer import Transformer
from kiln.train.step import train_step


def build(**kw) -> Transformer:
    cfg = ModelConfig(**{"vocab_size": 53, "dim": 16, "n_layers": 2, "n_heads": 2, "max_seq_len": 16,
                         "moe_experts": 4, "moe_capacity_factor": 0.0, **kw})
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: scores (softmax or sigmoid), the top k of scores + bias, gates = the
    unbiased scores of those, renormalized for k > 1 when the layer normalizes."""
    ex, out = moe.experts, torch.zeros_like(x)
    bias = moe.expert_bias if moe.expert_bias is not None else torch.zeros(moe.n_experts)
    per = moe.n_experts // moe.groups
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            logits = x[b, t].float() @ moe.router.weight.float().t()
            scores = logits.sigmoid() if moe.router_kind == "sigmoid" else logits.softmax(-1)
            choice = (scores + bias).tolist()
            # group-limited: rate each group by its two best choices, keep the topk_groups best
            rating = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(moe.groups)]
            kept = sorted(range(moe.groups), key=lambda g: -rating[g])[:moe.topk_groups]
            allowed = [e for e in range(moe.n_experts) if e // per in kept]
            idx = torch.tensor(sorted(allowed, key=lambda e: -choice[e])[:moe.top_k])
            gates = scores[idx]
            if moe.top_k > 1 and moe.norm_gates:
                gates = gates / gates.sum()
            gates = gates * moe.gate_scale
            for g, e in zip(gates, idx):
                h = ex.act(x[b, t] @ ex.w1[e]) * (x[b, t] @ ex.w3[e])
                out[b, t] += g * (h @ ex.w2[e])
    return out


@pytest.mark.parametrize("kw", [dict(moe_router="sigmoid", moe_top_k=2), dict(moe_router="sigmoid", moe_top_k=1),
                                dict(moe_top_k=2, moe_norm_gates=False),
                                dict(moe_router="sigmoid", moe_top_k=3, moe_bias_update_rate=0.01),
                                dict(moe_top_k=2, moe_bias_update_rate=0.01),
                                # DeepSeek-V3's routing: 8 experts in 4 groups, the best 2 groups, scale 2.5
                                dict(moe_router="sigmoid", moe_top_k=3, moe_experts=8, moe_groups=4, moe_topk_groups=2,
                                     moe_gate_scale=2.5, moe_bias_update_rate=0.01),
                                dict(moe_top_k=2, moe_experts=8, moe_groups=8, moe_topk_groups=3)])
def test_routing_equals_the_token_by_token_definition(kw):
    moe = build(**kw).layers[0].feed_forward
    if moe.expert_bias is not None:  # large enough to change picks
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, 0.2, -0.1, 0.05, 0.0][:moe.n_experts]))
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_group_limited_routing_keeps_each_token_within_its_best_groups():
    moe = build(moe_experts=8, moe_top_k=2, moe_groups=4, moe_topk_groups=1).layers[0].feed_forward
    _, expert, _, _ = moe.route(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(8)))
    pairs = expert.view(2, 2, 8)  # (B, k, T): each token's two experts, k-major
    assert torch.equal(pairs[:, 0] // 2, pairs[:, 1] // 2)  # both in one group of 2
    free = build(moe_experts=8, moe_top_k=2).layers[0].feed_forward
    _, expert, _, _ = free.route(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(8)))
    pairs = expert.view(2, 2, 8)
    assert not torch.equal(pairs[:, 0] // 2, pairs[:, 1] // 2)  # a control: unlimited routing crosses groups


def test_bias_picks_the_experts_but_does_not_weigh_them():
    moe = build(moe_top_k=1, moe_bias_update_rate=0.01, moe_router="sigmoid").layers[0].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2))
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # beats any sigmoid score gap
    token, expert, gate, keep = moe.route(x)
    assert torch.all(expert == 2) and keep.all()
    scores = (x.reshape(-1, 16) @ moe.router.weight.t()).sigmoid()[:, 2]
    torch.testing.assert_close(gate, scores[token])  # its own score, not score + bias
    assert moe.last_load.tolist() == [0.0, 0.0, 16.0, 0.0]  # both sequences' assignments


def test_sigmoid_balancing_loss_uses_normalized_scores():
    moe = build(moe_router="sigmoid", moe_top_k=2).layers[0].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()  # every score sigmoid(0) = 1/2, normalized 1/E: a balanced router
    moe(torch.randn(2, 8, 16))
    assert moe.last_aux_loss.item() == pytest.approx(1.0)  # E * sum_e (1/E)(1/E) for any f summing to 1


def test_update_moves_each_bias_by_the_sign_of_mean_minus_load():
    model = build(moe_bias_update_rate=0.25)
    moes = moe_layers(model)
    loads = torch.tensor([[1.0, 2.0, 3.0, 6.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    max_load = balance_experts(moes, loads.clone(), torch.tensor(False), 0.25)
    assert max_load.item() == 2.0  # 6 assignments against a mean of 3
    assert moes[0].expert_bias.tolist() == [0.25, 0.25, 0.0, -0.25]  # mean 3: the one at 3 stays
    assert moes[1].expert_bias.tolist() == [0.0] * 4  # balanced: nothing moves
    balance_experts(moes, loads.clone(), torch.tensor(True), 0.25)  # a skipped step changes nothing
    assert moes[0].expert_bias.tolist() == [0.25, 0.25, 0.0, -0.25]


def _steps(model, batches, micro: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        parts = [(p[:, :-1], p[:, 1:]) for p in batch.chunk(micro)]
        train_step(model, opt, parts, autocast=contextlib.nullcontext(), scaler=None, clip=0.0)
    return [m.expert_bias.clone() for m in moe_layers(model)]


def test_train_step_balances_on_the_whole_step_and_grad_accumulation_changes_nothing():
    batches = torch.randint(0, 53, (4, 4, 9), generator=torch.Generator().manual_seed(3))
    kw = dict(moe_top_k=2, moe_bias_update_rate=0.05, moe_capacity_factor=1.0)
    whole, accumulated = _steps(build(**kw), batches, 1), _steps(build(**kw), batches, 4)
    assert any(b.abs().sum() > 0 for b in whole)
    for a, b in zip(whole, accumulated):  # the counts of 4 micro-batches sum to those of the batch
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    one_sequence = _steps(build(**kw), batches[:, :1], 1)  # a control: other data, other biases
    assert any(not torch.equal(a, b) for a, b in zip(whole, one_sequence))


def test_evaluation_and_generation_forwards_count_no_load():
    model = build()
    tokens = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.eval_loss(tokens[:, :-1], tokens[:, 1:], rows=2)
        model(tokens)
    assert model.moe_loads is None
    model(tokens[:, :-1], tokens[:, 1:])
    assert model.moe_loads.sum(-1).tolist() == [16.0, 16.0]  # per layer: top-1 over 2 x 8 tokens


def test_bias_is_saved_only_when_balancing():
    assert not any("expert_bias" in k for k in build().state_dict())  # older MoE checkpoints still load
    keys = [k for k in build(moe_bias_update_rate=0.01).state_dict() if "expert_bias" in k]
    assert keys == ["layers.0.feed_forward.expert_bias", "layers.1.feed_forward.expert_bias"]


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_add_a_dense_mlp_to_every_token(gate):
    model = build(moe_top_k=2, moe_hidden=8, moe_shared_experts=2, moe_shared_gate=gate)
    block = model.layers[0]
    shared = block.shared_experts
    assert shared.ffn.w1.weight.shape == (16, 16) and shared.ffn.w1.bias is None  # 2 experts x 8 wide
    assert (shared.gate is not None) == gate
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(6))
    h = torch.nn.functional.silu(x @ shared.ffn.w1.weight.t()) * (x @ shared.ffn.w3.weight.t())
    expected = h @ shared.ffn.w2.weight.t()
    if gate:
        expected = expected * torch.sigmoid(x @ shared.gate.weight.t())
    torch.testing.assert_close(block._ffn(x), reference(block.feed_forward, x) + expected, rtol=1e-5, atol=1e-6)
    assert shared.ffn.w1.weight.std() > 0 and (not gate or shared.gate.weight.abs().sum() > 0)  # initialized
    tokens = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(7))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert shared.ffn.w2.weight.grad.abs().sum() > 0 and (not gate or shared.gate.weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("raw, key", [({"moe_bias_update_rate": 0.01}, "model.moe_bias_update_rate"),
                                      ({"moe_shared_experts": 1}, "model.moe_shared_experts"),
                                      ({"moe_experts": 4, "moe_shared_gate": True}, "model.moe_shared_gate"),
                                      ({"moe_hidden": 64}, "model.moe_hidden"),
                                      ({"moe_experts": 6, "moe_groups": 4}, "model.moe_groups"),
                                      ({"moe_experts": 8, "moe_groups": 4, "moe_topk_groups": 5}, "model.moe_topk_groups"),
                                      ({"moe_experts": 8, "moe_groups": 4, "moe_top_k": 3}, "model.moe_top_k"),
                                      ({"moe_experts": 4, "moe_router": "relu"}, "model.moe_router"),
                                      ({"moe_experts": 4, "moe_bias_update_rate": -1.0}, "model.moe_bias_update_rate")])
def test_bad_routing_settings_are_one_line_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        from_dict({"model": raw}).validate()
    assert "\n" not in str(err.value)
