"""Pieces of the step-time model (kiln/plan/timing.py) for the layouts the planner learned last:
tied embeddings under pp, ddp / zero1 over tensor-parallel shards, expert parallelism with and
without borrowing the tp ranks (parallel.etp). Each compares two layouts that differ in one
mechanism and checks the difference is exactly that mechanism's collectives."""

import dataclasses

import pytest

from kiln.config import load_config
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape, rank_params, zero1_fullest_share
from kiln.plan.timing import all_gather, all_reduce, all_to_all, broadcast, ddp_buckets, ranks_per_token, step_time

SEQ = 256


def _shape(*overrides):
    cfg = load_config(None, ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.vocab_size=8000",
                             f"data.seq_len={SEQ}", f"model.max_seq_len={SEQ}", *overrides])
    return ModelShape.from_config(cfg.model, 8000)


def test_tied_embeddings_under_pp_add_one_gradient_all_reduce_between_the_end_stages():
    cluster = load_cluster("h100", nodes=2)
    tied, untied = _shape("model.tie_embeddings=true"), _shape("model.tie_embeddings=false")
    for lay, shard in ((Layout(pp=4, grad_accum=8, micro_batch=2, dp_replicate=4), 1),
                       (Layout(pp=4, grad_accum=8, micro_batch=2, dp_shard=4, dp_mode="fsdp", tp=2), 4 * 2)):
        t, u = step_time(tied, lay, SEQ, cluster), step_time(untied, lay, SEQ, cluster)
        # pp ranks are outermost: the first and the last stage are 3 stages x (world / pp) ranks apart
        pair = all_reduce(cluster, 2, 4 * 8000 * 256 / shard, stride=3 * lay.world_size // 4)
        assert pair > 0
        assert t.comm_total - u.comm_total == pytest.approx(pair)
        assert t.calls["all_reduce"] - u.calls.get("all_reduce", 0) == 1
    zbv = Layout(pp=2, grad_accum=4, schedule="zbv_zero_bubble", virtual_stages=2)
    assert step_time(tied, zbv, SEQ, cluster).total == step_time(untied, zbv, SEQ, cluster).total  # a local sum


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_data_parallel_over_tensor_parallel_reduces_the_local_shards(mode):
    """ddp / zero1 x tp: the gradient all-reduce over the dp ranks (tp apart) carries each rank's
    tp shard, in DDP's buckets of those bytes; zero1 broadcasts the updated shards and steps its partition."""
    cluster, shape = load_cluster("h100"), _shape()
    tp = Layout(tp=2, micro_batch=2)
    both = dataclasses.replace(tp, dp_replicate=4, dp_mode=mode)
    local = 4 * rank_params(shape, tp)[0]
    norms = (2 * shape.n_layers + 1) * shape.dim  # two per block and the final one
    assert local == 4 * ((shape.params - norms) / 2 + norms)
    t_tp, t = step_time(shape, tp, SEQ, cluster), step_time(shape, both, SEQ, cluster)
    expected = all_reduce(cluster, 4, local, stride=2, calls=ddp_buckets(local))
    if mode == "zero1":
        # every tensor and the 3 runs the 4 even shares cut off (memory.py zero1_fullest_share)
        expected += broadcast(cluster, 4, local, stride=2, calls=shape.param_tensors() + 3)
        share = zero1_fullest_share(shape, both)
        assert t.optimizer == pytest.approx(t_tp.optimizer * share) and share == pytest.approx(1 / 4)
    else:
        assert t.optimizer == pytest.approx(t_tp.optimizer)
    assert t.comm_total - t_tp.comm_total == pytest.approx(expected)


def test_expert_parallel_borrowing_tp_moves_each_token_once_over_the_wider_group():
    """etp = tp: every tp rank routes the whole gathered sequence over an ep group tp apart, and the
    MoE MLP keeps tp's all-gather / reduce-scatter; etp = 1: each rank routes its 1/tp of the tokens
    over ep consecutive ranks, and the MoE blocks lose that pair forward and backward."""
    cluster = load_cluster("h100")
    shape = _shape("model.moe_experts=8", "model.moe_top_k=2")
    base = dict(dp_shard=4, tp=2, dp_mode="fsdp", micro_batch=2, grad_accum=2)
    etp_tp, borrow = Layout(ep=2, **base), Layout(ep=2, etp=1, **base)
    a, b = step_time(shape, etp_tp, SEQ, cluster), step_time(shape, borrow, SEQ, cluster)
    calls = 4 * 4 * 2  # 4 all-to-alls per MoE block per micro-batch
    # + one count exchange per dispatch, and the assignments' index and gate forward and backward
    assert a.calls["all_to_all"] == b.calls["all_to_all"] == 1.75 * calls
    # per block and micro-batch the MoE MLP's pair is gone; borrowing tp gathers the whole sequence's
    # routing statistics instead (queue counts, balance shares, z-loss: 3 small all-gathers)
    assert a.calls["all_gather"] - b.calls["all_gather"] == (2 - 3) * 4 * 2
    # both sum the router weight's gradient once a step; the experts' norm over (ep, edp) vs (ep, tp, edp)
    assert b.calls["all_reduce"] - a.calls["all_reduce"] == 2 - 3
    # the trade: whole experts gather more weight bytes over edp (overlapped with compute), while
    # the exposed token exchange and tp's pairs shrink
    assert b.comm_exposed < a.comm_exposed and b.comm_total > a.comm_total
    # the routed rows: one per token and expert rank (bf16 x dim) per token a rank routes: the
    # whole sequence tp apart, or its 1/tp consecutively. A second expert on the other rank (of 2,
    # 4 experts each) adds a row to each exchange for 16/28 of the tokens (1 - C(4,2)/C(8,2)), and
    # 16 bytes (its row index and gate) to the two assignment exchanges
    top1 = _shape("model.moe_experts=8", "model.moe_top_k=1")
    assert ranks_per_token(8, 1, 2) == 1 and ranks_per_token(8, 2, 2) == pytest.approx(1 + 16 / 28)
    assert ranks_per_token(8, 2, 1) == 1 and ranks_per_token(256, 8, 8) == pytest.approx(5.29, abs=0.01)
    for lay, tokens, stride in ((etp_tp, 2 * SEQ, 2), (borrow, 2 * SEQ / 2, 1)):
        extra = step_time(shape, lay, SEQ, cluster).comm_total - step_time(top1, lay, SEQ, cluster).comm_total
        row_bytes = 2 * 256 * tokens * calls
        expected = (all_to_all(cluster, 2, (1 + 16 / 28) * row_bytes, stride, calls)
                    - all_to_all(cluster, 2, row_bytes, stride, calls)
                    + all_to_all(cluster, 2, 16 * 2 * tokens * calls / 2, stride, calls / 2)
                    - all_to_all(cluster, 2, 16 * tokens * calls / 2, stride, calls / 2))
        if lay is borrow:  # the queue counts borrowing tp gathers: a choice more of int64 per sequence and expert
            expected += all_gather(cluster, 2, 8 * 2 * 8 * 2 * 4 * 2, calls=0)  # (x 2 ranks, 4 blocks, 2 micro-batches)
        assert extra == pytest.approx(expected)
    # compute: a token passes its top-k experts only (a dense model's FLOPs plus the routers' at top_k = 1)
    one = _shape("model.moe_experts=8", "model.moe_top_k=1")
    dense = _shape()
    flops = step_time(one, Layout(micro_batch=2), SEQ, cluster).flops
    routers = 6 * 4 * 8 * 256 * 2 * SEQ  # 6 FLOPs per parameter and token, 4 blocks of E x dim
    assert flops == step_time(dense, Layout(micro_batch=2), SEQ, cluster).flops + routers


def test_two_level_expert_exchange_crosses_nodes_once_per_token_and_node():
    """parallel.ep_node_ranks: an ep group of 16 over 2 nodes of 8 exchanges one row per token and
    node among the nodes (2 ranks 8 apart, the network) and one per token and rank inside each (8
    ranks, NVLink) instead of one per token and rank over all 16 at the network's speed; the
    search sets it where the ep group spans nodes, and kiln accepts the plan's config."""
    from kiln.plan.search import config_for_plan, ep_node_ranks

    cluster = load_cluster("h100", nodes=2)
    shape = _shape("model.moe_experts=64", "model.moe_top_k=8")
    one = Layout(dp_shard=16, dp_mode="fsdp", ep=16, micro_batch=2)
    two = Layout(dp_shard=16, dp_mode="fsdp", ep=16, micro_batch=2, ep_node_ranks=8)
    a, b = step_time(shape, one, SEQ, cluster), step_time(shape, two, SEQ, cluster)
    assert b.calls["all_to_all"] == 2 * a.calls["all_to_all"] == 2 * 1.75 * 4 * 4  # two levels' exchanges
    tokens, a2a, act = 2 * SEQ, 4 * 4, 2  # routed per micro-batch; 4 exchanges x 4 MoE blocks; bf16
    expected_one = (all_to_all(cluster, 16, act * tokens * ranks_per_token(64, 8, 16) * 256 * a2a, 1, a2a)
                    + all_to_all(cluster, 16, 16 * tokens * 8 * a2a / 2, 1, a2a / 2)
                    + all_to_all(cluster, 16, 8 * (64 + 16) * a2a / 4, 1, a2a / 4))
    expected_two = (all_to_all(cluster, 2, act * tokens * ranks_per_token(64, 8, 2) * 256 * a2a, 8, a2a)
                    + all_to_all(cluster, 2, 16 * tokens * 8 * a2a / 2, 8, a2a / 2)
                    + all_to_all(cluster, 2, 8 * (64 + 2) * a2a / 4, 8, a2a / 4)
                    + all_to_all(cluster, 8, act * tokens * ranks_per_token(64, 8, 16) * 256 * a2a, 1, a2a)
                    + all_to_all(cluster, 8, 16 * tokens * 8 * a2a / 2, 1, a2a / 2)
                    + all_to_all(cluster, 8, 8 * (64 + 8) * a2a / 4, 1, a2a / 4))
    assert b.comm_total - a.comm_total == pytest.approx(expected_two - expected_one)
    assert b.comm_exposed < a.comm_exposed  # the network carries 1.97 rows per token, not 7.5
    assert ep_node_ranks(cluster, 16, 1) == 8 and ep_node_ranks(cluster, 16, 2) == 4
    assert ep_node_ranks(cluster, 8, 1) == 0 and ep_node_ranks(cluster, 4, 2) == 0  # inside one node
    assert ep_node_ranks(cluster, 4, 4) == 2  # 4 ranks 4 apart: 2 nodes of 2
    cfg = config_for_plan(load_config(None, ["model.moe_experts=64", "model.moe_top_k=8"]), two)
    assert cfg.parallel.ep_node_ranks == 8 and "ep_node_ranks=8" in two.describe()


@pytest.mark.parametrize("experts,top_k,ep,groups,topk_groups", [
    (8, 2, 2, 1, 1), (16, 4, 4, 1, 1), (8, 2, 2, 2, 1), (16, 4, 4, 8, 2), (16, 3, 8, 4, 2), (24, 4, 2, 6, 3)])
def test_ranks_per_token_is_the_expected_count_of_distinct_expert_ranks(experts, top_k, ep, groups, topk_groups):
    """Exact by enumeration: every choice of topk_groups groups, then of top_k experts among them,
    equally likely; the ranks (E / ep consecutive experts each) a choice touches, averaged."""
    import itertools

    per_group, per_rank, touched, choices = experts // groups, experts // ep, 0, 0
    for chosen in itertools.combinations(range(groups), topk_groups):
        pool = [e for g in chosen for e in range(g * per_group, (g + 1) * per_group)]
        for picked in itertools.combinations(pool, top_k):
            touched += len({e // per_rank for e in picked})
            choices += 1
    assert ranks_per_token(experts, top_k, ep, groups, topk_groups) == pytest.approx(touched / choices)
    if groups == ep:  # node-limited routing: at most topk_groups ranks
        assert ranks_per_token(experts, top_k, ep, groups, topk_groups) <= topk_groups


def test_sliding_window_layers_count_the_windows_keys_as_the_model_does():
    """A window lowers the planner's FLOPs per token (model FLOPs of a step over its tokens) exactly
    as it lowers the model's own flops_per_token: 12 x q_dim per key no longer attended. (The two
    differ by the norm gains, which the planner counts in 6N and the model does not: 9 x 256 here.)"""
    import torch

    from kiln.model.transformer import Transformer, flops_per_token

    cluster, layout = load_cluster("h100"), Layout(micro_batch=2, grad_accum=1)
    planner, model_count = {}, {}
    for name, window in (("full", ()), ("local", ("model.sliding_window=64", "model.full_attention_every=2")),
                         ("wide", ("model.sliding_window=1024",))):
        cfg = load_config(None, ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.vocab_size=8000",
                                 f"data.seq_len={SEQ}", f"model.max_seq_len={SEQ}", *window])
        shape = ModelShape.from_config(cfg.model, 8000)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        planner[name] = step_time(shape, layout, SEQ, cluster).flops / (2 * SEQ)
        model_count[name] = flops_per_token(model, SEQ)
        assert planner[name] - model_count[name] == 6 * 9 * 256, name
    assert shape.local_layers == 4 and shape.attention_keys(SEQ) == 4 * SEQ  # a window past the sequence: all of it
    assert planner["full"] - planner["local"] == 12 * 256 * 2 * (SEQ - 64)  # two local layers of four
    assert planner["wide"] == planner["full"]


def test_sliding_window_layers_add_their_blocked_attention_copies_to_the_activations():
    """rank_memory's activations grow by window_bytes_per_token for the local layers' blocked
    attention, not under cp (the ring), and not with a window at least the sequence."""
    from kiln.plan.memory import rank_memory

    def activations(*window, cp=1):
        shape = _shape(*window)
        return shape, rank_memory(shape, Layout(micro_batch=2, cp=cp, dp_shard=cp), SEQ).activations

    _, plain = activations()
    shape, local = activations("model.sliding_window=64", "model.full_attention_every=2")
    per_token = (2 * (256 + 4 * 256) + 4 * 4) * (1 - 64 / SEQ) * 2 / 4  # bf16 (Layout's default), half local
    assert shape.window_bytes_per_token(2, SEQ) == per_token
    assert local - plain == per_token * 2 * SEQ * 4  # x tokens x layers
    assert activations("model.sliding_window=64", cp=2)[1] == activations(cp=2)[1]
    assert activations(f"model.sliding_window={SEQ}")[1] == plain


def test_context_parallel_sends_what_the_ring_sends_and_less_for_short_windows():
    """Per layer and micro-batch, cp ranks send 3 cp - 2 K/V or dK/dV blocks round the ring (the
    count tests/parallel/cp_ring_worker.py check_ring_window holds the ring to), and a local layer
    whose window reaches one neighbour each way 6; each block costs the same time. (The time model
    counts a receive with each send: StepTime.calls["p2p"] is twice the blocks sent.)"""
    cluster, cp = load_cluster("h100"), 8
    layout = Layout(micro_batch=2, cp=cp, dp_shard=cp)

    def p2p(*window):
        step = step_time(_shape(*window), layout, SEQ, cluster)
        return step.calls["p2p"] / 2, step.comm_total

    ring, ring_s = p2p()
    assert ring == 4 * (3 * cp - 2)
    # chunks of SEQ / 2 cp = 16 tokens: a window of 17 reaches one chunk back, 18 two, 1 none
    local, local_s = p2p("model.sliding_window=17", "model.full_attention_every=2")  # 2 local layers of 4
    assert local == 2 * (3 * cp - 2) + 2 * 6 and local_s < ring_s
    assert p2p("model.sliding_window=18")[0] == 4 * 12 and p2p("model.sliding_window=1")[0] == 0
    assert p2p("model.sliding_window=64")[0] == ring  # 4 hops each way reach all 8 ranks: the ring


def test_ulysses_sends_its_all_to_alls_and_the_hybrid_keeps_them_in_a_node():
    """cp_mode ulysses: per layer and micro-batch 2 all-to-alls forward and 2 backward (q, k, v
    together; the output), no ring sends; their bytes: q, k, v and the output per token, (U - 1) / U
    leaving. With ulysses_degree U < cp the ring runs over cp / U, and a ring whose cp x tp outgrows
    a node is timed on the link between nodes."""
    from kiln.plan.comm_cost import p2p

    shape, cluster = _shape(), load_cluster("h100", 2)
    ulysses = step_time(shape, Layout(micro_batch=2, cp=8, dp_shard=2, cp_mode="ulysses"), SEQ, cluster)
    assert ulysses.calls["all_to_all"] == 4 * 4 and not ulysses.calls.get("p2p")
    # everything else alike, the all-to-alls' bytes: q and the output, K/V repeated from 4 heads to 8
    ring = step_time(shape, Layout(micro_batch=2, cp=8, dp_shard=2), SEQ, cluster)
    tokens = 2 * SEQ / 8
    sent = 2 * 2 * tokens * (2 * shape.q_dim + 2 * shape.kv_dim * 2) * 4  # bf16, forward + backward, 4 layers
    ring_sends = 4 * (3 * 8 - 2) * p2p(cluster, 2 * 2 * tokens * shape.kv_dim, False)
    assert ulysses.comm_total - ring.comm_total == pytest.approx(all_to_all(cluster, 8, sent, calls=16) - ring_sends)
    hybrid = step_time(shape, Layout(micro_batch=2, cp=16, cp_mode="ulysses", ulysses_degree=8), SEQ, cluster)
    assert hybrid.calls["all_to_all"] == 16 and hybrid.calls["p2p"] == 2 * 4 * (3 * 2 - 2)
    # the same ring (cp 2 of heads / 8) inside one node instead: cheaper
    inside = dataclasses.replace(cluster, gpus_per_node=16)
    assert step_time(shape, Layout(micro_batch=2, cp=16, cp_mode="ulysses", ulysses_degree=8), SEQ,
                     inside).comm_total < hybrid.comm_total
    assert p2p(cluster, 1e6, True) > p2p(cluster, 1e6, False)


def test_ulysses_in_rounds_hides_forward_exchanges_behind_the_other_rounds_attention():
    """parallel.ulysses_rounds R: R times the all-to-alls, the same bytes; forward, all but the first
    round's inputs (every K/V head where they do not split in R) and the last round's output can
    hide behind the other rounds' attention, up to (R - 1) / R of attention's forward; backward
    stays exposed. Where the exchange is latency-bound, the extra calls cost more than they hide.
    Under the hybrid (the ring's sends behind the same attention) nothing is credited, and the
    ring runs once a round."""
    from kiln.plan.memory import ulysses_first_round_share, ulysses_round_kv_share

    cluster = load_cluster("h100", 2)
    big = _shape("model.dim=2048", "model.n_heads=32", "model.n_kv_heads=32", "data.seq_len=65536",
                 "model.max_seq_len=65536")
    layouts = {r: Layout(micro_batch=1, cp=16, cp_mode="ulysses", ulysses_rounds=r) for r in (1, 2)}
    times = {r: step_time(big, layout, 65536, cluster) for r, layout in layouts.items()}  # across 2 nodes
    assert times[1].calls["all_to_all"] == 4 * 4 and times[2].calls["all_to_all"] == 2 * 4 * 4
    # the same bytes in more calls: only the calls' launch cost adds to the total
    assert times[1].comm_total < times[2].comm_total < times[1].comm_total * 1.05
    assert times[2].comm_exposed < times[1].comm_exposed
    hidden = times[1].comm_exposed - times[2].comm_exposed + times[2].comm_total - times[1].comm_total
    assert hidden <= times[1].comm_total / 2 / 2  # at most half of what goes forward
    small = {r: step_time(_shape("model.n_heads=32", "model.n_kv_heads=32"), layout, SEQ, cluster)
             for r, layout in layouts.items()}
    assert small[2].comm_exposed > small[1].comm_exposed
    # the first round's share of the inputs: 1 / R where the K/V heads split, else every K/V head
    shape = _shape("model.n_heads=8", "model.n_kv_heads=8")
    assert ulysses_first_round_share(shape, Layout(cp=2, cp_mode="ulysses", ulysses_rounds=4)) == 1 / 4
    gqa = _shape("model.n_heads=8", "model.n_kv_heads=2")
    q, kv = gqa.q_dim, 2 * gqa.kv_dim
    assert ulysses_first_round_share(gqa, Layout(cp=2, cp_mode="ulysses", ulysses_rounds=2)) == pytest.approx(
        (q / 2 + kv) / (q + kv))
    # the hybrid: a ring a round (twice its messages, each with half the K/V), no credit
    hybrid = {r: step_time(big, Layout(micro_batch=1, cp=16, cp_mode="ulysses", ulysses_degree=8,
                                       ulysses_rounds=r), 65536, cluster) for r in (1, 2)}
    assert hybrid[2].calls["p2p"] == 2 * hybrid[1].calls["p2p"]
    assert hybrid[2].comm_exposed > hybrid[1].comm_exposed
    # where the K/V heads do not split in the rounds each round's ring carries its queries' K/V head
    assert ulysses_round_kv_share(big, Layout(cp=16, cp_mode="ulysses", ulysses_degree=8, ulysses_rounds=2)) == 1 / 2
    assert ulysses_round_kv_share(gqa, Layout(cp=4, cp_mode="ulysses", ulysses_degree=2, ulysses_rounds=2)) == 1
    assert ulysses_round_kv_share(_shape("model.dim=384", "model.n_heads=12", "model.n_kv_heads=6"),
                                  Layout(cp=4, cp_mode="ulysses", ulysses_degree=2, ulysses_rounds=2)) == 1


def test_resharding_to_a_node_after_forward_moves_backward_gathers_into_it():
    """parallel.fsdp_reshard_to = 8 on 4 H100 nodes (fsdp over 32): the same gathers, backward's
    over 8 ranks of one node instead of 32 across nodes, for 1/8 of the parameters held from
    forward to backward; the search weighs it where the shard ranks span nodes, and kiln takes it."""
    from kiln.plan.memory import fsdp_end_units, rank_memory
    from kiln.plan.search import enumerate_layouts, kiln_refusal

    cluster = load_cluster("h100", nodes=4)
    shape = ModelShape.from_config(load_config(None, ["model.dim=2048", "model.n_layers=16", "model.n_heads=16"]).model,
                                   32000)
    plain, hpz = Layout(dp_shard=32, dp_mode="fsdp"), Layout(dp_shard=32, dp_mode="fsdp", fsdp_reshard_to=8)
    t_plain, t_hpz = step_time(shape, plain, 2048, cluster), step_time(shape, hpz, 2048, cluster)
    assert t_hpz.calls == t_plain.calls
    assert t_hpz.comm_total < t_plain.comm_total * 0.85  # one of three parameter-sized passes moves inside nodes
    # the blocks but the last (kept whole), not the root (kept gathered) nor the embedding (its own unit)
    blocks = (rank_params(shape, plain)[0] - sum(fsdp_end_units(shape, plain))) * 15 / 16
    extra = rank_memory(shape, hpz, 2048).temporary - rank_memory(shape, plain, 2048).temporary
    assert extra == pytest.approx(2 * blocks / 8)  # bf16 parameters
    layouts = list(enumerate_layouts(shape, cluster, 2048, 64, "bf16", ac_choices=("none",), max_pp=1, max_cp=1))
    resharded = [x for x in layouts if x.fsdp_reshard_to]
    assert resharded and all(x.dp_mode == "fsdp" and x.fsdp_reshard_to == 8 and x.tp == 1 for x in resharded)
    assert all(x.dp_shard * x.cp > x.fsdp_reshard_to for x in resharded)
    cfg = load_config(None, ["model.dim=2048", "model.n_layers=16", "model.n_heads=16", "model.max_seq_len=2048",
                             "data.seq_len=2048"])
    for x in resharded[:5]:
        assert kiln_refusal(cfg, x, x.world_size) is None, x.describe()
    one_node = load_cluster("h100", nodes=1)
    assert not any(x.fsdp_reshard_to for x in enumerate_layouts(shape, one_node, 2048, 64, "bf16",
                                                                   ac_choices=("none",), max_pp=1, max_cp=1))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_bf16_gradient_reductions_send_half_the_bytes(mode):
    """parallel.reduce_dtype bf16 (Layout.grad_wire_bytes 2): the data-parallel gradient
    reduction (ddp's all-reduce; fsdp's reduce-scatter) carries 2 bytes an element, nothing else
    changes (the gathers and the calls)."""
    from kiln.plan.timing import reduce_scatter

    cluster, shape = load_cluster("h100", nodes=2), _shape()
    fp32 = Layout(dp_replicate=16, dp_mode="ddp", micro_batch=2) if mode == "ddp" else \
        Layout(dp_shard=16, dp_mode="fsdp", micro_batch=2)
    bf16 = dataclasses.replace(fp32, grad_wire_bytes=2)
    t32, t16 = step_time(shape, fp32, SEQ, cluster), step_time(shape, bf16, SEQ, cluster)
    grads = 4 * rank_params(shape, fp32)[0]
    if mode == "ddp":
        saved = (all_reduce(cluster, 16, grads, calls=ddp_buckets(grads))
                 - all_reduce(cluster, 16, grads / 2, calls=ddp_buckets(grads)))
    else:
        units = shape.n_layers + 1  # the blocks and the root (tied: the embedding is the root's)
        saved = (reduce_scatter(cluster, 16, grads, calls=units) - reduce_scatter(cluster, 16, grads / 2, calls=units))
    assert saved > 0
    assert t32.comm_total - t16.comm_total == pytest.approx(saved)
    assert t16.calls == t32.calls and "grad_wire_bytes=2" in bf16.describe()
