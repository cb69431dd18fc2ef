"""Muon's Newton-Schulz in the planner's step time (kiln/plan/muon_cost.py): its FLOPs are what
torch counts in kiln's `orthogonalize`, its matrices are kiln's Muon groups, and each layout
divides them as kiln/train/optimizers/muon_split.py deals them out."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.config import load_config
from kiln.model.transformer import Transformer
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape
from kiln.plan.muon_cost import _matrices, muon_seconds, muon_seconds_by_part, newton_schulz_flops
from kiln.plan.timing import step_time
from kiln.train.optim import build_optimizer

SEQ = 64
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2", "model.moe_hidden=48",
       "model.moe_shared_experts=1", "model.moe_shared_gate=true"]


def _config(*overrides):
    return load_config(None, ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
                              "model.vocab_size=300", f"data.seq_len={SEQ}", f"model.max_seq_len={SEQ}",
                              "optim.name='muon'", *overrides])


@pytest.mark.parametrize("rows, cols", [(64, 64), (192, 64), (64, 192), (7, 13), (1, 64)])
def test_newton_schulz_flops_are_the_matmuls_torch_counts(rows, cols):
    from kiln.train.optimizers.newton_schulz import orthogonalize

    with FlopCounterMode(display=False) as counter:
        orthogonalize(torch.randn(rows, cols))
    assert newton_schulz_flops(rows, cols) == counter.get_total_flops()


@pytest.mark.parametrize("overrides", [(), ("model.activation=gelu", "model.norm=layernorm", "model.bias=true"), MOE],
                         ids=["llama", "gpt2-like", "moe"])
def test_the_planners_matrices_are_kilns_muon_groups(overrides):
    """Every matrix in Muon's groups (an expert stack as its experts), with its shape, and nothing
    else: the FLOPs summed over kiln's own groups equal the planner's."""
    cfg = _config(*overrides)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    groups = {g["name"]: g for g in build_optimizer(model, cfg.optim).param_groups}
    kiln_flops = {"muon": 0.0, "muon_experts": 0.0}
    for name, flops in kiln_flops.items():
        for p in groups.get(name, {"params": []})["params"]:
            rows, cols = (p.shape[-1], p.shape[-2]) if name == "muon_experts" else (p.shape[0], p[0].numel())
            kiln_flops[name] += (p.shape[0] if name == "muon_experts" else 1) * newton_schulz_flops(rows, cols)
    dense, experts = _matrices(ModelShape.from_config(cfg.model, 300))
    assert sum(c * newton_schulz_flops(r, k) for r, k, c, _ in dense) == kiln_flops["muon"]
    assert sum(c * newton_schulz_flops(r, k) for r, k, c in experts) == kiln_flops["muon_experts"]
    assert (kiln_flops["muon_experts"] > 0) == bool(overrides == MOE)


def test_each_layout_divides_the_iterations_as_the_optimizer_deals_them_out():
    cfg = _config(*MOE)
    shape = ModelShape.from_config(cfg.model, 300)
    cluster = load_cluster("h100")
    one = muon_seconds(shape, Layout(), cluster)
    dense_only = muon_seconds(dataclasses.replace(shape, moe_layers=0, moe_experts=0, shared_ffn=0,
                                                  shared_gate=False), Layout(), cluster)
    assert 0 < dense_only < one

    def ratio(**layout):
        return muon_seconds(shape, Layout(**layout), cluster) / one

    assert ratio(dp_shard=4, dp_mode="fsdp") == pytest.approx(1 / 4)  # every matrix dealt over 4
    assert ratio(dp_replicate=2, dp_shard=4, dp_mode="fsdp") == pytest.approx(1 / 4)  # replicas alike
    assert ratio(dp_replicate=4, dp_mode="ddp") == pytest.approx(1 / 4)  # whole matrices dealt over the replicas
    assert ratio(dp_replicate=4, dp_mode="zero1") == pytest.approx(1 / 4)  # each matrix on its owner
    # ddp x tp: tp's cut, dealt over tp; the router and the shared gate (replicated over tp) on
    # every rank: a little more than half
    assert 0.5 < ratio(dp_replicate=2, tp=2, dp_mode="ddp") < 0.51
    assert ratio(pp=2, dp_replicate=1, dp_mode="ddp") == pytest.approx(1 / 2)  # a stage's layers
    # zero1 x tp: each matrix on its owner replica's tp ranks, tp's cut dealt over them: half of
    # ddp x tp's dense part; the experts (hidden units over tp, stepped on every rank) as there
    ddp_tp = muon_seconds_by_part(shape, Layout(dp_replicate=2, tp=2, dp_mode="ddp"), cluster)
    zero1_tp = muon_seconds_by_part(shape, Layout(dp_replicate=2, tp=2, dp_mode="zero1"), cluster)
    assert zero1_tp[0] == pytest.approx(ddp_tp[0] / 2) and zero1_tp[1] == pytest.approx(ddp_tp[1])
    expert_part = muon_seconds_by_part(shape, Layout(), cluster)[1] / one
    assert 0 < expert_part < 1
    # FSDP over tp: dense matrices gathered over one dim, dealt over the other (2 ranks either
    # way here); the expert stacks FSDP cuts into whole experts (2 shards), their hidden units
    # dealt over tp (2)
    assert ratio(dp_shard=2, tp=2, dp_mode="fsdp") == pytest.approx((1 - expert_part) / 2 + expert_part / 4)
    # ep: each rank its experts (whole ones over FSDP's expert shards), the dense part dealt over 4
    fsdp_ep = ratio(dp_shard=4, ep=2, dp_mode="fsdp")
    assert fsdp_ep == pytest.approx((1 - expert_part) / 4 + expert_part / 4)
    ddp_ep = ratio(dp_replicate=4, ep=2, dp_mode="ddp")
    assert ddp_ep == pytest.approx((1 - expert_part) / 4 + expert_part / 2)


def test_step_time_counts_muon_only_for_muon():
    shape = ModelShape.from_config(_config().model, 300)
    cluster, layout = load_cluster("h100"), Layout(dp_shard=8, dp_mode="fsdp")
    adamw = step_time(shape, layout, SEQ, cluster, "adamw").optimizer
    muon = step_time(shape, layout, SEQ, cluster, "muon").optimizer
    sgd = step_time(shape, layout, SEQ, cluster, "sgd").optimizer
    assert muon - sgd > muon_seconds(shape, layout, cluster) * 0.999  # state bytes differ a little
    assert adamw < muon


@pytest.mark.parametrize("overrides", [(), ("model.activation=gelu", "model.norm=layernorm", "model.bias=true",
                                            "model.tie_embeddings=false", "model.positions=learned"), MOE],
                         ids=["llama", "gpt2-like", "moe"])
def test_muon_state_in_the_memory_model_is_what_kilns_muon_holds(overrides):
    """One momentum (4 bytes) per orthogonalized parameter, AdamW's two (8) for the rest: the
    memory model's optimizer bytes equal the state tensors of kiln's Muon after a step (its
    per-parameter step counters aside)."""
    from kiln.plan.memory import rank_memory

    cfg = _config(*overrides)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.numel() > 1)
    planned = rank_memory(ModelShape.from_config(cfg.model, 300), Layout(), SEQ, "muon").optimizer
    assert planned == pytest.approx(held, rel=1e-9)
    adamw = rank_memory(ModelShape.from_config(cfg.model, 300), Layout(), SEQ, "adamw").optimizer
    assert planned < adamw


def test_ddp_pays_a_broadcast_per_replica_for_dealing_the_iterations_out():
    shape = ModelShape.from_config(_config(*MOE).model, 300)
    cluster, ddp = load_cluster("h100"), Layout(dp_replicate=4, dp_mode="ddp")
    muon, adamw = step_time(shape, ddp, SEQ, cluster, "muon"), step_time(shape, ddp, SEQ, cluster, "adamw")
    assert muon.calls.get("broadcast") == 4 and "broadcast" not in adamw.calls
    assert muon.comm_total > adamw.comm_total


def test_muon_exchanges_follow_where_the_split_runs():
    """muon_cost.muon_exchanges against the split's rules (muon_split.py; the counts on 2 gloo
    ranks are tests/plan/test_collective_counts.py's fsdp_muon and tp_muon): none where every rank
    holds its matrices whole (one process, DDP's replicas, ZeRO-1 without tp), two all-to-alls
    under FSDP or tp, a gather per matrix first under FSDP over tp, and ZeRO-1 x tp's replicas each
    exchange their own share."""
    from kiln.plan.muon_cost import muon_exchanges

    shape = ModelShape.from_config(_config().model, 300)
    cluster = load_cluster("h100")
    for layout in (Layout(), Layout(dp_replicate=4, dp_mode="ddp"), Layout(dp_replicate=4, dp_mode="zero1")):
        assert muon_exchanges(shape, layout, cluster) == (0.0, {})
    t_fsdp, calls = muon_exchanges(shape, Layout(dp_shard=4, dp_mode="fsdp"), cluster)
    assert t_fsdp > 0 and calls == {"all_to_all": 2}
    t_ddp_tp, calls = muon_exchanges(shape, Layout(dp_replicate=2, tp=2, dp_mode="ddp"), cluster)
    assert t_ddp_tp > 0 and calls == {"all_to_all": 2}
    t_zero1_tp, _ = muon_exchanges(shape, Layout(dp_replicate=2, tp=2, dp_mode="zero1"), cluster)
    assert t_zero1_tp < t_ddp_tp
    _, calls = muon_exchanges(shape, Layout(dp_shard=2, tp=2, dp_mode="fsdp"), cluster)
    matrices = sum(count for _, _, count, cut in _matrices(shape)[0] if cut != "none")
    assert calls == {"all_to_all": 2, "all_gather": matrices}
