"""Tied embeddings under pipeline parallelism (kiln/parallel/pipeline_tied.py): a GPT-2-style model
(learned positions, LayerNorm, tanh GELU, biases, tied head) trained through the pipeline gives the
per-step losses and grad norms of one process on the same global batch.

Step level, as the trainer calls it (`pipeline_train_step`, kiln's AdamW param groups, clipping at
0.5, active: the norms are above it, so a tied weight counted twice in the norm changes every
step): on 2 gloo ranks pp2 with 1F1B (first and last stage on different ranks: the pair's
all-reduce), interleaved 1F1B, and ZBV (stage 0 and the last stage both on rank 0: the local sum);
on 4 ranks pp2 x dp2 under fsdp, ddp and zero1 (each pair sums matching FSDP shards / DDP-averaged
gradients) and pp2 x tp2 (each tp coordinate's pair sums its vocab shard). Negative control: 1F1B with the gradient sum skipped drifts off at step 2.

Checkpoints (kiln/checkpoint/manager.py ModelOptimizerState through DCP, AdamW moments included):
pp2 (1F1B and ZBV), pp2 x fsdp2 and pp2 x zero1 over 2 (each stage's ZeRO-1 saving its share of
the embedding's moments, cut alike on both stages so DCP writes each box once) step-3
checkpoints continue in one process (the zero1 and fsdp ones also in pp2 x zero1 2), and a one-process
one in pp2 (1F1B and ZBV), with the same losses for steps 4-5.

Tolerance: fp32, relative 1e-5 per step (the gradient sum and the micro-batch losses run in
another order than one process's).
"""

import dataclasses
from unittest import mock

import pytest
import torch

from kiln.train.pipeline_step import pipeline_train_step
from ranks import run_ranks

STEPS, SAVE_AT, REL, CLIP = 5, 3, 1e-5, 0.5
GLOBAL_BATCH, MICRO = 8, 4
CASES = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", 2), "zbv": ("zbv_zero_bubble", 2)}
DP_MODES = ("fsdp", "ddp", "zero1", "zero2")


# a GPT-2 with MoE feed-forwards (4 experts, top-2, capacity-dropping, aux and z-losses weighted)
MOE = dict(moe_experts=4, moe_top_k=2, moe_aux_loss_weight=0.1, moe_z_loss_weight=0.01)


def job(pp=1, schedule="1f1b", virtual=1, dp_mode="auto", batch=GLOBAL_BATCH, moe=False):
    from kiln.config import JobConfig, ModelConfig, OptimConfig

    cfg = JobConfig()
    cfg.model = ModelConfig(dim=32, n_layers=4, n_heads=2, vocab_size=61, max_seq_len=16, tie_embeddings=True,
                            positions="learned", norm="layernorm", activation="gelu_tanh", bias=True, init="gpt2",
                            **(MOE if moe else {}))
    # weight decay on matrices only: the head copy must be grouped as the embedding it copies
    cfg.optim = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    cfg.train.batch_size, cfg.train.dtype, cfg.train.device = batch, "fp32", "cpu"
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                       pp_microbatches=MICRO if pp > 1 else 0, dp_mode=dp_mode)
    return cfg


def batches():
    gen = torch.Generator().manual_seed(0)
    out = [torch.randint(0, 61, (GLOBAL_BATCH, 17), generator=gen) for _ in range(STEPS)]
    return [(b[:, :-1], b[:, 1:]) for b in out]


def train(step_fn, target, model, opt, data, steps, ckpt=None, micro=1):
    """Rows (loss, grad norm) for `steps`; saves ModelOptimizerState at SAVE_AT into `ckpt`.
    micro: the batch as that many grad-accumulation micro-batches."""
    from kiln.checkpoint.manager import ModelOptimizerState

    rows = {}
    for step in steps:
        x, y = data[step - 1]
        loss, norm, skipped = step_fn(target, opt, list(zip(x.chunk(micro), y.chunk(micro))),
                                      autocast=torch.autocast("cpu", enabled=False),
                                      scaler=None, clip=CLIP)
        assert not bool(skipped)
        rows[step] = (float(loss), float(norm))
        if ckpt is not None and step == SAVE_AT:
            ckpt.save(step, {"app": ModelOptimizerState(model, opt)})
    return rows


def one_process(ckpt_dir=None, resume_from=None, moe=False):
    """The reference: one process on the global batch (saving, or resuming from, step 3). MoE: the
    batch as the pp2 x ep2 stages' forwards see it (each dp rank's micro-batch of one row per
    forward: routing capacity and the load-balancing loss are per forward)."""
    from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    cfg = job(moe=moe)
    model = build_model(cfg, ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0),
                        torch.device("cpu"))
    opt = build_optimizer(model, cfg.optim, "cpu")
    first = 1
    if resume_from is not None:
        CheckpointManager(resume_from).load({"app": ModelOptimizerState(model, opt)}, SAVE_AT)
        first = SAVE_AT + 1
    ckpt = CheckpointManager(ckpt_dir, keep_last=5) if ckpt_dir is not None else None
    # MoE: one row per forward, as each of pp2 x ep2's dp ranks splits its 4 rows into MICRO=4
    return train(train_step, model, model, opt, batches(), range(first, STEPS + 1), ckpt,
                 micro=GLOBAL_BATCH if moe else 1)


def pipelined(rank, world, cfg, ckpt_dir=None, resume_from=None):
    """pp (x dp, cp, ep) rows of this rank on its dp slice of the global batches (cp: its zig-zag
    slice of every sequence, as the trainer's ContextParallel.shard takes it)."""
    from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
    from kiln.parallel import pipeline as pl
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.trainer import build_model

    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
    dims.build_mesh("cpu")
    model = build_model(cfg, dims, torch.device("cpu"))
    pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
    opt = shard_optimizer_state(build_optimizer(model, cfg.optim, "cpu"), dims, model)
    first = 1
    if resume_from is not None:
        CheckpointManager(resume_from, is_main=rank == 0).load({"app": ModelOptimizerState(model, opt)}, SAVE_AT)
        first = SAVE_AT + 1
    mine = slice(dims.dp_rank * cfg.train.batch_size, (dims.dp_rank + 1) * cfg.train.batch_size)
    cp = ContextParallel(model, dims, 16, torch.device("cpu"))
    data = [cp.shard(x[mine], y[mine]) for x, y in batches()]
    ckpt = CheckpointManager(ckpt_dir, keep_last=5, is_main=rank == 0) if ckpt_dir is not None else None

    def step_fn(*args, **kwargs):
        with cp:
            return pipeline_train_step(*args, **kwargs)

    return train(step_fn, pipe, model, opt, data, range(first, STEPS + 1), ckpt)


def two_rank_jobs(rank, world, root):
    from kiln.parallel.pipeline_tied import TiedEmbeddings

    got = {name: pipelined(rank, world, job(pp=2, schedule=s, virtual=v), root / name if name != "interleaved" else None)
           for name, (s, v) in CASES.items()}
    got["single->pp2"] = pipelined(rank, world, job(pp=2), resume_from=root / "single")
    # ZBV: the embedding and the head copy on one rank, both in the optimizer state there
    got["single->zbv"] = pipelined(rank, world, job(pp=2, schedule="zbv_zero_bubble", virtual=2),
                                   resume_from=root / "single")
    with mock.patch.object(TiedEmbeddings, "sum_grads", lambda self: None):
        got["1f1b_no_sum"] = pipelined(rank, world, job(pp=2))
    return got


def four_rank_jobs(rank, world, root):
    got = {mode: pipelined(rank, world, job(pp=2, dp_mode=mode, batch=GLOBAL_BATCH // 2),
                           root / mode if mode in ("fsdp", "zero1") else None)
           for mode in DP_MODES}
    for source in ("zero1", "fsdp"):  # into pp2 x zero1 2: each stage's ranks read their boxes of the tied weight
        got[f"{source}->zero1"] = pipelined(rank, world, job(pp=2, dp_mode="zero1", batch=GLOBAL_BATCH // 2),
                                            resume_from=root / source)
    cp = job(pp=2)  # pp2 x cp2: each cp rank's pipeline pairs its (FSDP-sharded over cp) copies
    cp.parallel.cp = 2
    got["cp"] = pipelined(rank, world, cp)
    ep = job(pp=2, moe=True, batch=GLOBAL_BATCH // 2)  # each stage's 2 dp ranks split its experts
    ep.parallel.ep = 2
    got["moe ep"] = pipelined(rank, world, ep)
    tp = job(pp=2)  # pp2 x tp2: each tp rank's pipeline pairs the vocab shards of its tp coordinate
    tp.parallel.tp = 2
    got["tp"] = pipelined(rank, world, tp)
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied_pp")
    out = {"reference": one_process(ckpt_dir=root / "single"), "moe reference": one_process(moe=True)}
    for work in ("work2", "work4"):
        (root / work).mkdir()
    out["two"] = run_ranks(two_rank_jobs, 2, root / "work2", root, timeout=240)
    out["four"] = run_ranks(four_rank_jobs, 4, root / "work4", root, timeout=240)
    out["pp2->single"] = one_process(resume_from=root / "1f1b")
    out["fsdp->single"] = one_process(resume_from=root / "fsdp")
    out["zero1->single"] = one_process(resume_from=root / "zero1")
    out["zbv->single"] = one_process(resume_from=root / "zbv")
    return out


def assert_rows_match(ref, per_rank, steps, what):
    """Loss averaged over the ranks (every pp rank reports the loss of its dp slice), grad norm of
    every rank, against one process."""
    for step in steps:
        loss = sum(rows[step][0] for rows in per_rank) / len(per_rank)
        assert loss == pytest.approx(ref[step][0], rel=REL), f"{what} step {step} loss"
        for rank, rows in enumerate(per_rank):
            assert rows[step][1] == pytest.approx(ref[step][1], rel=REL), f"{what} rank {rank} step {step} norm"


def test_reference_clips(runs):
    assert min(norm for _, norm in runs["reference"].values()) > CLIP  # clipping is active every step


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_tied_pipeline_matches_one_process(runs, name):
    assert_rows_match(runs["reference"], [r[name] for r in runs["two"]], range(1, STEPS + 1), name)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", [*DP_MODES, "tp", "cp", "moe ep"])
def test_tied_pipeline_times_data_parallel_matches_one_process(runs, mode):
    ref = runs["moe reference" if mode == "moe ep" else "reference"]
    assert_rows_match(ref, [r[mode] for r in runs["four"]], range(1, STEPS + 1), mode)


def test_skipping_the_gradient_sum_fails_the_check(runs):
    ref, got = runs["reference"], [r["1f1b_no_sum"] for r in runs["two"]]
    assert sum(rows[1][0] for rows in got) / 2 == pytest.approx(ref[1][0], rel=REL)  # the initial weights' loss ...
    with pytest.raises(AssertionError):  # ... then the two copies train apart
        assert_rows_match(ref, got, range(1, STEPS + 1), "no sum")


@pytest.mark.parametrize("pair", ["pp2->single", "fsdp->single", "zero1->single", "zbv->single", "single->pp2",
                                  "single->zbv", "zero1->zero1", "fsdp->zero1"])
def test_checkpoint_continues_in_another_layout(runs, pair):
    launch = "four" if pair.endswith("zero1") else "two"
    got = [runs[pair]] if pair.endswith("single") else [r[pair] for r in runs[launch]]
    assert all(sorted(rows) == [4, 5] for rows in got)
    assert_rows_match(runs["reference"], got, range(SAVE_AT + 1, STEPS + 1), pair)


# ---------------------------------------------------------------- one process: split, init, groups


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zbv_zero_bubble", 2)])
def test_head_copy_starts_as_the_embedding_and_counts_once(schedule, virtual):
    from kiln.model.transformer import Transformer, count_params
    from kiln.parallel import pipeline as pl
    from kiln.train.optim import build_optimizer

    cfg = job(pp=2, schedule=schedule, virtual=virtual)
    ref = Transformer(cfg.model)
    ref.init_weights(torch.Generator().manual_seed(7))
    expected = ref.state_dict()
    seen = set()
    for rank in range(2):
        with torch.device("meta"):
            full = Transformer(cfg.model)
        part = pl.split_model(full, cfg, rank)
        part.to_empty(device="cpu")
        part.init_weights(torch.Generator().manual_seed(7))
        for name, tensor in part.state_dict().items():
            assert torch.equal(tensor, expected[name]), name  # the head copy too: the embedding's draw
            seen.add(name)
        assert count_params(part._full) == count_params(ref)  # the trainer's run row: tied weight once
        copies = part.tied_embedding_copies()
        assert len(copies) == (1 if part.has_last else 0)
        if copies and part.has_first:  # ZBV's rank 0: two parameters, not one shared
            assert copies[0] is not part.tok_embeddings.weight
        groups = {g["name"]: g["params"] for g in build_optimizer(part, cfg.optim, "cpu").param_groups}
        for copy in copies:  # no weight decay on the copy, as on one process's tied embedding
            assert any(p is copy for p in groups["no_decay"])
    assert seen == set(expected)


def test_optimizer_state_aliases_round_trip():
    from kiln.parallel.pipeline_tied import optimizer_state_for_load, optimizer_state_for_save

    aliases = {"output.weight": "tok_embeddings.weight"}
    saved = optimizer_state_for_save({"state": {"output.weight": {"exp_avg": torch.ones(2)}, "norm.weight": {}},
                                      "param_groups": [{"params": ["norm.weight", "output.weight"]}]}, aliases)
    assert set(saved["state"]) == {"tok_embeddings.weight", "norm.weight"}
    assert saved["param_groups"][0]["params"] == ["norm.weight", "tok_embeddings.weight"]
    both = optimizer_state_for_save({"state": {"tok_embeddings.weight": {"exp_avg": torch.zeros(2)},
                                               "output.weight": {"exp_avg": torch.ones(2)}}}, aliases)
    assert torch.equal(both["state"]["tok_embeddings.weight"]["exp_avg"], torch.zeros(2))  # the embedding's own
    loaded = optimizer_state_for_load(both, aliases)
    own, copy = loaded["state"]["tok_embeddings.weight"]["exp_avg"], loaded["state"]["output.weight"]["exp_avg"]
    assert torch.equal(own, copy) and own.data_ptr() != copy.data_ptr()  # equal values, own storage
