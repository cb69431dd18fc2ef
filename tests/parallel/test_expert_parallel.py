"""Expert parallelism on 2 gloo ranks gives the per-step losses and gradients of one process on
the same global batch: each rank holds half the experts and its own half of the batch (the ep
ranks are also the data-parallel ranks), dense gradients are averaged over the 2 ranks, expert
gradients go through `reduce_expert_grads`.

Tolerance: fp32, relative 1e-5 per step over 6 steps for losses; step-1 expert gradients to
1e-5 relative (observed differences are reduction order, ~1e-7). Plain SGD without clipping. The
"wrong" run treats expert gradients like replicated ones (averaged over the ep group): its
gradients must not match, which shows the check can fail for exactly that mistake.
All runs share one 2-process spawn (process start dominates on a 2-core machine).

ep dividing the data-parallel ranks (4 ranks, ep=2; over the 2 ranks holding the same experts,
FSDP-sharded or replicated), module level and through `kiln train`, with clipping active: fp32,
relative 1e-5 per step over 6 steps for losses and pre-clipping grad norms, and for the step-1
expert gradients (atol 1e-8). Negative controls: no gradient reduction over those replicas, and
a norm over the local experts only.
"""

import json
import re

import pytest
import torch

from ranks import run_ranks, train_runs

STEPS = 6
REL = 1e-5
CASES = {  # name -> model fields
    "switch_top1_capacity": dict(moe_top_k=1, moe_capacity_factor=1.0),
    "gshard_top2_dropless": dict(moe_top_k=2, moe_capacity_factor=0.0, activation="gelu"),
}
RUNS = [("switch_top1_capacity", "right"), ("gshard_top2_dropless", "right"), ("switch_top1_capacity", "wrong")]


def model_and_data(case, **fields):
    from kiln.config import ModelConfig
    from kiln.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=61, dim=16, n_layers=2, n_heads=2, max_seq_len=16, moe_experts=4,
                      moe_aux_loss_weight=0.1, moe_z_loss_weight=0.01, **CASES[case], **fields)
    with torch.device("meta"):
        model = Transformer(cfg)
    data = torch.randint(0, 61, (STEPS, 4, 17), generator=torch.Generator().manual_seed(0))
    return model, data


def materialize(model):
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def expert_grads(model):
    return [m.feed_forward.experts.w1.grad.clone() for m in model.layers]


def single_process(case):
    model, data = model_and_data(case)
    model = materialize(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for batch in data:
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        grads = grads or expert_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def average_dense_grads(model, experts: set, world: int) -> None:
    """Data parallelism by hand for everything but the experts (their reduction is under test)."""
    import torch.distributed as dist

    for p in model.parameters():
        if id(p) not in experts:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def expert_parallel_rank(rank, world):
    import torch.distributed as dist

    from kiln.parallel.expert_parallel import apply_expert_parallel, expert_parameters, reduce_expert_grads

    out = []
    for case, reduction in RUNS:
        model, data = model_and_data(case)
        apply_expert_parallel(model, dist.group.WORLD)
        model = materialize(model)
        assert model.layers[0].feed_forward.experts.w1.shape[0] == 4 // world
        experts = {id(p) for p in expert_parameters(model)}
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        per = data.shape[1] // world
        losses, grads = [], None
        for batch in data:
            mine = batch[rank * per:(rank + 1) * per]
            loss = model(mine[:, :-1], mine[:, 1:])
            loss.backward()
            average_dense_grads(model, experts, world)
            if reduction == "right":
                reduce_expert_grads(model, world)
            else:  # the mistake: expert grads averaged over the ep group, as if they were replicas
                for p in expert_parameters(model):
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            if grads is None:  # every rank's local experts, gathered: the full (E, ...) gradient
                grads = []
                for g in expert_grads(model):
                    parts = [torch.empty_like(g) for _ in range(world)]
                    dist.all_gather(parts, g)
                    grads.append(torch.cat(parts))
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        out.append((losses, grads))
    return out, rows_sent(rank, world)


def rows_sent(rank, world):
    """{routing: per MoE layer of one top-2 forward, (rows this rank dispatched, its distinct
    (token, expert rank) pairs among the kept assignments, its kept assignments)}, from the
    router's own choice; "node-limited": 2 groups of 2 experts (a group per rank), one per token."""
    return {"top-2": _rows_sent(rank, world), "node-limited": _rows_sent(rank, world, moe_groups=2, moe_topk_groups=1)}


def _rows_sent(rank, world, **fields):
    import torch.distributed as dist

    from kiln.parallel import functional
    from kiln.parallel.expert_parallel import apply_expert_parallel

    model, data = model_and_data("gshard_top2_dropless", **fields)
    apply_expert_parallel(model, dist.group.WORLD)
    model = materialize(model)
    inputs, sent, real = [], [], functional.funcol.all_to_all_single_autograd

    def recording(t, *args, **kwargs):
        if t.dim() == 2 and len(sent) < 2 * len(inputs):  # per layer: the rows out, then back
            sent.append(t.shape[0])
        return real(t, *args, **kwargs)

    for layer in model.layers:
        layer.feed_forward.register_forward_pre_hook(lambda m, args: inputs.append((m, args[0].detach())))
    functional.funcol.all_to_all_single_autograd = recording
    try:
        per = data.shape[1] // world
        model(data[0, rank * per:(rank + 1) * per, :-1], data[0, rank * per:(rank + 1) * per, 1:]).backward()
    finally:
        functional.funcol.all_to_all_single_autograd = real
    out = []
    for (moe, x), rows in zip(inputs, sent[::2]):
        token, expert, _, keep = moe.route(x)
        pairs = {(t, e // moe.experts.n_local) for t, e, k in zip(token.tolist(), expert.tolist(), keep.tolist()) if k}
        out.append((rows, len(pairs), int(keep.sum())))
    return out


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    ranks = run_ranks(expert_parallel_rank, 2, tmp_path_factory.mktemp("ep"))
    assert ranks[0][0][0][0] == ranks[1][0][0][0]  # both ranks log the same global loss
    return {**dict(zip(RUNS, ranks[0][0])), "rows sent": [r[1] for r in ranks]}


@pytest.mark.timeout(240)
def test_each_token_goes_once_to_each_rank_holding_its_experts(ep_runs):
    """Top-2 of 4 experts on 2 ranks: a token whose two experts share a rank is dispatched there
    once (one row out, its gated sum back), not once per expert. Node-limited routing (a group of
    experts per rank, one group per token): every token goes to exactly one rank."""
    per_rank = ep_runs["rows sent"]
    assert len(per_rank) == 2
    for routing in per_rank:
        assert all(len(layers) == 2 for layers in routing.values())
        for rows, pairs, assignments in routing["top-2"]:
            assert rows == pairs < assignments
        for rows, pairs, assignments in routing["node-limited"]:
            assert rows == pairs == assignments // 2 == 2 * 16  # the rank's 2 sequences of 16 tokens


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ep_ranks_match_one_process(ep_runs, case):
    expected_losses, expected_grads = single_process(case)
    losses, grads = ep_runs[(case, "right")]
    assert losses == pytest.approx(expected_losses, rel=REL)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=REL, atol=1e-8)
    assert expected_losses[-1] < expected_losses[0]  # it trains


@pytest.mark.timeout(240)
def test_averaging_experts_over_the_ep_group_is_caught(ep_runs):
    expected_losses, expected_grads = single_process("switch_top1_capacity")
    losses, grads = ep_runs[("switch_top1_capacity", "wrong")]
    assert losses[0] == pytest.approx(expected_losses[0], rel=REL)  # same forward at step 1
    with pytest.raises(AssertionError):
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=REL, atol=1e-8)


# ep dividing the data-parallel ranks, at the module level: 4 ranks, ep=2, the experts sharded
# over ep=2 and, over the 2 "edp" ranks that hold the same experts, FSDP-sharded or replicated;
# kiln's expert mesh layout, hooks and clipping, against one process with clipping active on every
# step. init_std=0.3 makes the experts ~1/3 of the grad norm (at 0.02 they are 1%: a wrong
# expert norm would hide).
CLIP, CLIP_LR, EXPERT_STD = 0.05, 20.0, 0.3  # lr * CLIP: every step moves the weights by a norm of 1.0
EDP_RUNS = ("fsdp", "replicated", "no_edp_reduce", "local_norm")


def clipped_single_process():
    from kiln.train.step import clip_grad_norm

    model, data = model_and_data("switch_top1_capacity", init_std=EXPERT_STD)
    model = materialize(model)
    opt = torch.optim.SGD(model.parameters(), lr=CLIP_LR)
    losses, norms, grads = [], [], None
    for batch in data:
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        grads = grads or expert_grads(model)
        norms.append(clip_grad_norm([p for p in model.parameters() if p.grad is not None], CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads


def ep_within_dp_rank(rank, world):
    """ep=2 of 4 data-parallel ranks, the experts FSDP-sharded over edp (fsdp/zero2) or replicated
    there (ddp); dense gradients averaged over the 4 ranks (what FSDP/DDP do). The mistakes (on
    the replicated layout): expert gradients not summed over their edp replicas (each replica
    keeps only its part of the batch), and a grad norm over this rank's experts only."""

    import torch.distributed as dist
    from kiln.parallel import expert_parallel as xp
    from kiln.train.step import clip_grad_norm

    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    def expert_mesh(**degrees):  # kiln's mesh builder (what `kiln train` uses)
        dims = ParallelDims.from_config(ParallelConfig(ep=2, **degrees), world_size=world, rank=rank,
                                        local_rank=rank, local_world_size=world)
        dims.build_mesh("cpu")
        return dims.expert_mesh

    mesh = expert_mesh()  # dp_shard=4, ep=2
    out = {"layouts": [mesh.mesh.tolist(), expert_mesh(dp_replicate=2).mesh.tolist()]}
    for how in EDP_RUNS:
        model, data = model_and_data("switch_top1_capacity", init_std=EXPERT_STD)
        xp.apply_expert_parallel_training(model, mesh, world, fsdp=how == "fsdp")
        if how == "fsdp":
            xp.fully_shard_experts(model, mesh)
        if how == "no_edp_reduce":
            for m in model.modules():
                if isinstance(m, xp.MoE):
                    m.experts.grad_hook = xp.ReplicatedExpertGrads(world, None)
        model = materialize(model)
        if how == "fsdp":  # each rank stores E / D experts' worth of every expert weight
            assert all(p.to_local().shape[0] == 4 // world for p in xp.expert_parameters(model))
        experts = {id(p) for p in xp.expert_parameters(model)}
        opt = torch.optim.SGD(model.parameters(), lr=CLIP_LR)
        per = data.shape[1] // world
        losses, norms, grads = [], [], None
        for batch in data:
            mine = batch[rank * per:(rank + 1) * per]
            loss = model(mine[:, :-1], mine[:, 1:])
            loss.backward()
            average_dense_grads(model, experts, world)
            grads = grads or [m.feed_forward.experts.w1.grad.full_tensor() for m in model.layers]
            params = [p for p in model.parameters() if p.grad is not None]
            if how == "local_norm":
                grads = [xp.local_weight(p.grad) for p in params]
                norm = torch.nn.utils.get_total_norm(grads)
                torch._foreach_mul_(grads, (CLIP / (norm + 1e-6)).clamp(max=1.0))
            else:
                norm = clip_grad_norm(params, CLIP)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            norms.append(norm.item())
        out[how] = (losses, norms, grads)
    return out


def assert_same_grads(got, expected):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=REL, atol=1e-8)


def two_level_dispatch(rank, world):
    """parallel.ep_node_ranks=2 on 4 ranks (2 "nodes" of 2; kiln's group builder): one MoE layer
    (top-4 of 8 experts) through the one-level and the two-level exchange on the same input.
    Returns the largest relative difference of their outputs and input / router / expert gradients, and per
    exchange the token rows this rank sent to the other node (dispatch and combine, counted at the
    all-to-all calls) with twice this rank's own tokens' share by the router's choice (summed over
    the ranks the two agree): one row per (token, rank) on the other node in one level, one per
    (token, node) in two."""
    import torch.distributed as dist

    from kiln.config import ModelConfig, ParallelConfig
    from kiln.model.moe import MoE
    from kiln.parallel import functional
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.expert_parallel import apply_expert_parallel

    dims = ParallelDims.from_config(ParallelConfig(ep=4, ep_node_ranks=2), world_size=world, rank=rank,
                                    local_rank=rank, local_world_size=world)
    dims.build_mesh("cpu")
    inter, intra = dims.expert_node_groups
    groups = [dist.get_process_group_ranks(inter), dist.get_process_group_ranks(intra)]
    layer = MoE(ModelConfig(dim=16, n_heads=2, vocab_size=61, max_seq_len=32, moe_experts=8, moe_top_k=4,
                            moe_capacity_factor=0.0), 24)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    apply_expert_parallel(layer, dims.expert_mesh["ep"].get_group())
    x = torch.randn(world, 2, 16, 16, generator=gen)[rank]
    crossed, real = [0], functional.funcol.all_to_all_single_autograd

    def counting(t, out_splits, in_splits, group, *a, **k):
        if t.dim() == 2 and t.shape[1] == 16:  # token rows (not the index / gate pairs)
            members = dist.get_process_group_ranks(group)
            crossed[0] += sum(n for n, g in zip(in_splits, members) if g // 2 != rank // 2)
        return real(t, out_splits, in_splits, group, *a, **k)

    results, counts = [], []
    functional.funcol.all_to_all_single_autograd = counting
    try:
        for node_groups in (None, (inter, intra)):
            layer.ep_node_groups, crossed[0] = node_groups, 0
            inputs = x.clone().requires_grad_()
            out = layer(inputs)
            out.square().sum().backward()
            results.append([out.detach(), inputs.grad, layer.router.weight.grad.clone(), layer.experts.w1.grad.clone()])
            layer.zero_grad()
            counts.append(crossed[0])
    finally:
        functional.funcol.all_to_all_single_autograd = real
    token, expert, _, keep = layer.route(x)
    ranks = {(t, e // 2) for t, e, k in zip(token.tolist(), expert.tolist(), keep.tolist()) if k}
    nodes = {(t, r // 2) for t, r in ranks}
    expected = [2 * sum(r // 2 != rank // 2 for _, r in ranks), 2 * sum(n != rank // 2 for _, n in nodes)]
    difference = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))  # relative
    return {"groups": groups, "difference": difference, "crossed": counts, "expected": expected}


def four_ranks(rank, world, jobs):
    """The module's one 4-rank launch: ep_within_dp_rank and two_level_dispatch, then kiln's
    trainer on `jobs`."""
    out = ep_within_dp_rank(rank, world)
    out["two-level"] = two_level_dispatch(rank, world)
    train_runs(rank, world, jobs)
    return out


@pytest.fixture(scope="module")
def four_rank_launch(tmp_path_factory, text_file):
    """(what ep_within_dp_rank returned on each rank, {name: run directory}): kiln's trainer in
    this process ("single") and, in the launch, with ep=2 of dp_shard=4 ("ep2") and its step-3
    checkpoint continued with dp_mode=ddp ("ep2 -> ddp")."""
    from kiln.config import load_config
    from kiln.train.trainer import train
    from test_data_parallel import GLOBAL_BATCH, common

    root = tmp_path_factory.mktemp("ep4")
    runs = {name: root / name for name in ["single", "ep2", "ep2-ddp"]}
    runs["ep2 -> ddp"] = runs.pop("ep2-ddp")
    train(load_config(None, common(text_file, **TRAIN_MOE, **{"train.batch_size": GLOBAL_BATCH})), runs["single"])
    runs["single muon"], runs["ep2 muon"] = root / "single-muon", root / "ep2-muon"
    runs["fsdp2 x tp2 muon"], runs["ddp muon"] = root / "fsdp2-tp2-muon", root / "ddp-muon"
    train(load_config(None, common(text_file, **TRAIN_MOE, **MUON, **{"train.batch_size": GLOBAL_BATCH})),
          runs["single muon"])
    runs["single adafactor"], runs["ep2 adafactor"] = root / "single-adafactor", root / "ep2-adafactor"
    runs["fsdp2 x tp2 adafactor"] = root / "fsdp2-tp2-adafactor"
    runs["fsdp2 x tp2 -> ep2 adafactor"] = root / "fsdp2-tp2-to-ep2-adafactor"
    runs["zero1 x tp2 muon"], runs["zero1 x tp2 adafactor"] = root / "zero1-tp2-muon", root / "zero1-tp2-adafactor"
    runs["zero1 x tp2 -> fsdp4 adafactor"] = root / "zero1-tp2-to-fsdp4-adafactor"
    train(load_config(None, common(text_file, **TRAIN_MOE, **ADAFACTOR, **{"train.batch_size": GLOBAL_BATCH})),
          runs["single adafactor"])
    runs["ep4 two-level"] = root / "ep4-two-level"
    jobs = [(runs["ep2"], common(text_file, **TRAIN_MOE, **{"train.batch_size": GLOBAL_BATCH // 4, "parallel.ep": 2,
                                                            "parallel.dp_mode": "'fsdp'"})),
            (runs["ep4 two-level"], common(text_file, **TRAIN_MOE, **{
                "train.batch_size": GLOBAL_BATCH // 4, "parallel.ep": 4, "parallel.ep_node_ranks": 2,
                "parallel.dp_mode": "'fsdp'"})),
            (runs["ep2 -> ddp"], ["parallel.dp_mode='ddp'"], runs["ep2"], 3),
            (runs["ep2 muon"], common(text_file, **TRAIN_MOE, **MUON, **{
                "train.batch_size": GLOBAL_BATCH // 4, "parallel.ep": 2, "parallel.dp_mode": "'fsdp'"})),
            (runs["fsdp2 x tp2 muon"], common(text_file, **TRAIN_MOE, **MUON, **{
                "train.batch_size": GLOBAL_BATCH // 2, "parallel.tp": 2, "parallel.dp_mode": "'fsdp'"})),
            (runs["ddp muon"], common(text_file, **TRAIN_MOE, **MUON, **{
                "train.batch_size": GLOBAL_BATCH // 4, "parallel.dp_mode": "'ddp'"})),
            (runs["ep2 adafactor"], common(text_file, **TRAIN_MOE, **ADAFACTOR, **{
                "train.batch_size": GLOBAL_BATCH // 4, "parallel.ep": 2, "parallel.dp_mode": "'fsdp'"})),
            (runs["fsdp2 x tp2 adafactor"], common(text_file, **TRAIN_MOE, **ADAFACTOR, **{
                "train.batch_size": GLOBAL_BATCH // 2, "parallel.tp": 2, "parallel.dp_mode": "'fsdp'"})),
            (runs["fsdp2 x tp2 -> ep2 adafactor"], [f"train.batch_size={GLOBAL_BATCH // 4}", "parallel.tp=1",
                                                   "parallel.ep=2"], runs["fsdp2 x tp2 adafactor"], 3),
            (runs["zero1 x tp2 muon"], common(text_file, **TRAIN_MOE, **MUON, **ZERO1_TP2)),
            (runs["zero1 x tp2 adafactor"], common(text_file, **TRAIN_MOE, **ADAFACTOR, **ZERO1_TP2)),
            (runs["zero1 x tp2 -> fsdp4 adafactor"], [f"train.batch_size={GLOBAL_BATCH // 4}", "parallel.tp=1",
                                                     "parallel.dp_mode='fsdp'", "parallel.dp_replicate=1",
                                                     "parallel.dp_shard=-1"], runs["zero1 x tp2 adafactor"], 3)]
    (root / "ranks").mkdir()
    return run_ranks(four_ranks, 4, root / "ranks", jobs, timeout=400), runs


@pytest.mark.timeout(400)
def test_ep2_within_four_data_parallel_ranks_matches_one_process_with_clipping(four_rank_launch):
    expected_losses, expected_norms, expected_grads = clipped_single_process()
    assert min(expected_norms) > CLIP and expected_losses[-1] < expected_losses[0]  # clipped, and it trains
    ranks = four_rank_launch[0]
    # (edp, ep): ep groups are consecutive ranks, inside one dp_shard group also under HSDP
    # (2 replicas x dp_shard 2: dp_shard groups {0, 1}, {2, 3}).
    assert ranks[0]["layouts"] == [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]
    for how in ("fsdp", "replicated"):
        losses, norms, grads = ranks[0][how]
        assert all(r[how][:2] == (losses, norms) for r in ranks)  # every rank logs the same loss and norm
        assert losses == pytest.approx(expected_losses, rel=REL)
        assert norms == pytest.approx(expected_norms, rel=REL)
        assert_same_grads(grads, expected_grads)
    # Negative controls: each mistake is caught (the same first forward, then a wrong norm).
    for how in ("no_edp_reduce", "local_norm"):
        losses, norms, _ = ranks[0][how]
        assert losses[0] == pytest.approx(expected_losses[0], rel=REL)
        assert norms[0] != pytest.approx(expected_norms[0], rel=1e-2)
        assert losses[1:] != pytest.approx(expected_losses[1:], rel=1e-3)
    with pytest.raises(AssertionError):  # the experts' gradients lack the other replica's batch
        assert_same_grads(ranks[0]["no_edp_reduce"][2], expected_grads)


# `kiln train` with parallel.ep=2 of 4 data-parallel ranks (FSDP over all 4 on the dense part;
# experts as DTensors sharded over ep, replicated over edp) against one process, with active
# clipping: the losses and the pre-clipping grad norms of every step.
TRAIN_MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_capacity_factor": 0.0,
             "train.clip_grad_norm": 0.05, "model.init_std": 0.3}  # experts ~1/3 of the grad norm (see CLIP)


# Muon: the dense matrices FSDP-sharded (each orthogonalized on one of the 4 ranks), the experts'
# stacks per expert where they live (whole experts on each ep rank)
MUON = {"optim.name": "'muon'", "optim.lr": 0.02, "optim.muon_adam_lr": 0.01}
# Adafactor: its row and column statistics summed over the ranks that cut each matrix (FSDP's
# rows, tp's rows or columns, FSDP over tp's twice-cut rows; the experts' over ep and edp)
ADAFACTOR = {"optim.name": "'adafactor'", "optim.lr": 0.02, "optim.weight_decay": 0.1}
# ZeRO-1 over 2 replicas x tp 2: each tp-cut matrix stepped as its DTensor by its owner replica's tp
# ranks (kiln/parallel/zero1.py), the experts by every rank (their hidden units over tp)
ZERO1_TP2 = {"train.batch_size": 2,  # the global batch of 4 over 2 replicas
             "parallel.tp": 2, "parallel.dp_replicate": 2, "parallel.dp_mode": "'zero1'"}


def assert_layout(run_dir, layout):
    """The run's first run row names the layout's data-parallel mode and tp (the jobs above)."""
    first = next(json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x)["kind"] == "run")
    mode = next(m for m in ("zero1", "ddp", "fsdp") if layout.startswith(m) or m == "fsdp")
    assert (first["dp_mode"], first["tp"]) == (mode, 2 if "tp2" in layout.split("->")[0] else 1), first


def grad_norms(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in rows if r["kind"] == "train"}


@pytest.mark.parametrize("world, degrees, expected", [
    (2, {"ep": 2, "diloco_inner_steps": 3}, "parallel.ep=2 with parallel.diloco_inner_steps=3 must divide a "
                                       "replica's dp_shard x cp = 1"),
    (8, {"ep": 2, "cp": 4}, "parallel.ep=2 must be a multiple of parallel.cp=4"),
    (6, {"ep": 4, "cp": 2}, "parallel.ep=4 must divide dp_shard x cp = 3 x 2"),
    (12, {"ep": 4, "pp": 2, "dp_replicate": 2}, "parallel.ep=4 must divide dp_shard=3"),
    (6, {"ep": 4}, "parallel.ep=4 must divide dp_shard=6"),
    (6, {"ep": 4, "dp_mode": "ddp"}, "parallel.ep=4 must divide dp_replicate=6"),
    # the ranks hold a layout where ep fits: the line names it
    (4, {"ep": 2, "dp_replicate": 2, "tp": 2, "dp_mode": "fsdp"}, "parallel.ep=2 must divide dp_shard=1 (ep is carved "
     "out of dp_shard under dp_mode='fsdp'); change parallel.ep or the number of processes, or set "
     "parallel.dp_mode='ddp' (ep from the replicas), or set parallel.etp=1 (ep borrows tp)"),
    (4, {"ep": 4, "ep_node_ranks": 3}, "parallel.ep_node_ranks=3 must divide parallel.ep=4"),
])
def test_unsupported_ep_layouts_are_refused_in_one_line(world, degrees, expected):
    from kiln.config import ParallelConfig
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    with pytest.raises(ConfigError, match=re.escape(expected)):
        ParallelDims.from_config(ParallelConfig(**degrees), world_size=world, rank=0, local_rank=0)


@pytest.mark.parametrize("world, degrees, layout", [
    (4, {"ep": 2, "dp_replicate": 2}, ("fsdp", 2, 2)),
    (4, {"ep": 2}, ("fsdp", 1, 4)),
    (8, {"ep": 2, "dp_replicate": 2}, ("fsdp", 2, 4)),
    (4, {"ep": 2, "dp_mode": "ddp"}, ("ddp", 4, 1)),
    (2, {"ep": 2, "dp_mode": "zero1"}, ("zero1", 2, 1)),  # dense optimizer state sharded (test_expert_replicated.py)
    (4, {"ep": 2, "pp": 2}, ("fsdp", 1, 2)),  # ep within each pipeline stage's dp ranks
    (4, {"ep": 4, "cp": 2}, ("fsdp", 1, 2)),  # ep borrows dp_shard and all of cp
    (4, {"ep": 2, "cp": 2, "dp_mode": "ddp"}, ("ddp", 2, 1)),
    (4, {"ep": 2, "tp": 2}, ("fsdp", 1, 2)),  # expert tensor parallel (test_expert_tensor_parallel.py)
])
def test_ep_dividing_the_data_parallel_ranks_is_accepted(world, degrees, layout):
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    d = ParallelDims.from_config(ParallelConfig(**degrees), world_size=world, rank=0, local_rank=0)
    assert (d.dp_mode, d.dp_replicate, d.dp_shard) == layout and d.ep == degrees["ep"]


@pytest.mark.timeout(400)
def test_kiln_train_ep2_of_dp_shard4_matches_one_process_and_resumes_under_ddp(four_rank_launch):
    """4 ranks, dp_shard=4, ep=2 against one process; its step-3 checkpoint continues under
    dp_mode=ddp, ep=2 (ep carved from the 4 replicas) with the same losses and grad norms."""
    from test_data_parallel import STEPS as TRAIN_STEPS
    from test_data_parallel import assert_same_losses, losses

    runs = four_rank_launch[1]
    expected = losses(runs["single"])
    norms = grad_norms(runs["single"])
    assert min(norms.values()) > TRAIN_MOE["train.clip_grad_norm"]  # clipping is active on every step

    run = runs["ep2"]
    assert_same_losses(expected, losses(run), range(1, TRAIN_STEPS + 1))
    # The pre-clipping norm covers all experts, each counted once, reduced as in one process.
    assert_same_losses(norms, grad_norms(run), range(1, TRAIN_STEPS + 1))

    # The step-3 checkpoint holds all 4 experts: it continues with the replicas under ddp.
    rows = [json.loads(x) for x in (runs["ep2 -> ddp"] / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, r in enumerate(rows) if r["kind"] == "run")
    assert (rows[last]["resumed_from"], rows[last]["dp_mode"], rows[last]["world_size"]) == (3, "ddp", 4)
    resumed = [r for r in rows[last:] if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == list(range(4, TRAIN_STEPS + 1))
    assert_same_losses(expected, {r["step"]: r["loss"] for r in resumed}, range(4, TRAIN_STEPS + 1))
    assert_same_losses(norms, {r["step"]: r["grad_norm"] for r in resumed}, range(4, TRAIN_STEPS + 1))


@pytest.mark.parametrize("layout", ["ep2 muon", "fsdp2 x tp2 muon", "ddp muon", "zero1 x tp2 muon"])
def test_kiln_train_muon_matches_one_process(four_rank_launch, layout):
    """Muon with ep 2 of dp_shard 4 (the dense matrices dealt over 4 FSDP ranks, each rank's whole
    experts where they live), FSDP over tp (the dense matrices gathered over dp and dealt over
    tp, the experts' hidden units dealt over tp), and DDP over 4 (whole matrices and expert
    stacks dealt over the replicas, broadcast from their owners)."""
    from test_data_parallel import STEPS as TRAIN_STEPS
    from test_data_parallel import assert_same_losses, losses

    runs = four_rank_launch[1]
    assert_layout(runs[layout], layout)
    expected = losses(runs["single muon"])
    assert expected != pytest.approx(losses(runs["single"]), rel=1e-3)  # another optimizer
    assert_same_losses(expected, losses(runs[layout]), range(1, TRAIN_STEPS + 1))
    assert_same_losses(grad_norms(runs["single muon"]), grad_norms(runs[layout]), range(1, TRAIN_STEPS + 1))


@pytest.mark.parametrize("layout", ["ep2 adafactor", "fsdp2 x tp2 adafactor", "fsdp2 x tp2 -> ep2 adafactor",
                                    "zero1 x tp2 adafactor", "zero1 x tp2 -> fsdp4 adafactor"])
def test_kiln_train_adafactor_matches_one_process(four_rank_launch, layout):
    """Adafactor with ep 2 of dp_shard 4 and FSDP 2 over tp 2: the losses and grad norms of one
    process (kiln/train/optimizers/adafactor.py); the FSDP x tp run's step-3 checkpoint (row and
    column statistics cut as its matrices) continues with ep 2 of dp_shard 4."""
    from test_data_parallel import STEPS as TRAIN_STEPS
    from test_data_parallel import assert_same_losses, losses

    runs = four_rank_launch[1]
    assert_layout(runs[layout], layout)
    expected = losses(runs["single adafactor"])
    assert expected != pytest.approx(losses(runs["single"]), rel=1e-3)  # another optimizer
    steps = range(4 if "->" in layout else 1, TRAIN_STEPS + 1)
    if "->" in layout:
        rows = [json.loads(x) for x in (runs[layout] / "metrics.jsonl").read_text().splitlines()]
        start = next(r for r in rows if r.get("resumed_from"))
        assert (start["resumed_from"], start["tp"], start["dp_shard"]) == (3, 1, 4)
    assert_same_losses(expected, losses(runs[layout]), steps)
    assert_same_losses(grad_norms(runs["single adafactor"]), grad_norms(runs[layout]), steps)


def fsdp_manages_experts_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.expert_parallel import expert_parameters
    from kiln.parallel.parallelize import apply_fsdp

    model, _ = model_and_data("switch_top1_capacity")
    dims = ParallelDims(1, world, 1, 1, 1, 1, world, rank)
    dims.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, dims, None, cpu_offload=False)
    return all(isinstance(p, DTensor) for p in expert_parameters(model))


@pytest.mark.timeout(120)
def test_fsdp_without_ep_still_shards_and_reduces_the_experts(tmp_path):
    # Only under parallel.ep > 1 does FSDP leave the experts to expert_parallel.py.
    assert run_ranks(fsdp_manages_experts_rank, 1, tmp_path) == [True]


@pytest.mark.timeout(400)
def test_two_level_dispatch_crosses_nodes_once_per_token_and_node(four_rank_launch):
    """parallel.ep_node_ranks=2 (DeepEP's internode layout on 2 "nodes" of 2 ranks): a token
    crosses to the other node once whatever number of its experts sit there (the one-level
    exchange sends it once per rank there), with the one-level exchange's outputs and gradients;
    `kiln train` with it (ep=4, 1 of 4 experts per rank) equals one process."""
    from test_data_parallel import STEPS as TRAIN_STEPS
    from test_data_parallel import assert_same_losses, losses

    results = [r["two-level"] for r in four_rank_launch[0]]
    for rank, out in enumerate(results):
        assert out["groups"] == [[rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]]  # inter, intra
        assert out["difference"] < 1e-5
    # summed over the ranks (a rank's combine returns the rows other ranks dispatched to it)
    crossed, expected = ([sum(r[key][i] for r in results) for i in (0, 1)] for key in ("crossed", "expected"))
    assert crossed == expected and crossed[1] < crossed[0]
    runs = four_rank_launch[1]
    assert_same_losses(losses(runs["single"]), losses(runs["ep4 two-level"]), range(1, TRAIN_STEPS + 1))
    assert_same_losses(grad_norms(runs["single"]), grad_norms(runs["ep4 two-level"]), range(1, TRAIN_STEPS + 1))
