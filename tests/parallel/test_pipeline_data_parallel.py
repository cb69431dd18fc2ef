"""DDP and ZeRO-1 across pipeline replicas (dp 2 x pp 2 on 4 gloo ranks): every stage chunk is a
DistributedDataParallel over the replicas of that stage (kiln/parallel/data_parallel.py
`replicate_stage`), whose gradients torch's schedules all-reduce once per step, not per micro-batch.

Step level (one 4-rank launch, `pipeline_train_step` as the trainer calls it): GPipe, 1F1B and
interleaved 1F1B under ddp, GPipe and 1F1B under zero1, give the per-step losses (averaged over the
dp replicas, as the trainer's metrics do) and grad norms (after clipping's norm: over all stages and
replicas) of one process on the same global batch. Tolerance: fp32, relative 1e-5 per step
(observed below 1e-6: the sums run in another order). SGD with momentum, clipping at 0.5 (active:
the norms are above it), so a gradient that is not averaged over the replicas changes the next
losses (`test_tolerance_catches_gradients_not_averaged_over_replicas`, a comm hook that skips the
all-reduce). DDP comm hooks count the all-reduces: one per bucket per step.

Trainer level (kiln's trainer, tests/parallel/test_cross_layout.py's helpers): ddp x pp,
zero1 x pp and ddp x pp with interleaved zero-bubble (no DDP wrapper: the zero-bubble step level is
in test_pipeline_data_parallel_zero_bubble.py) match one process for steps 1..3; the ddp x pp step-3 checkpoint continues in one
process and in fsdp x pp, the zero1 x pp one in one process, with the same losses (weights, AdamW
moments and the loader's global position carried over).
"""

import dataclasses
import json
import shutil
from unittest import mock

import pytest
import torch

import test_cross_layout as cross
from conftest import tiny_overrides  # noqa: F401  (cross.overrides builds on it)
from kiln.train.pipeline_step import pipeline_train_step
from ranks import run_ranks

STEPS, REL, CLIP = 5, 1e-5, 0.5
GLOBAL_BATCH, MICRO = 8, 4  # 4 sequences per dp rank, split into 4 micro-batches
# name -> (dp_mode, schedule, virtual stages per rank)
CASES = {"ddp_gpipe": ("ddp", "gpipe", 1), "ddp_1f1b": ("ddp", "1f1b", 1),
         "ddp_interleaved": ("ddp", "interleaved_1f1b", 2), "zero1_gpipe": ("zero1", "gpipe", 1),
         "zero1_1f1b": ("zero1", "1f1b", 1)}


def job(pp=1, virtual=1, schedule="1f1b", dp_mode="auto"):
    from kiln.config import JobConfig, ModelConfig

    cfg = JobConfig()
    cfg.model = ModelConfig(dim=32, n_layers=4, n_heads=2, vocab_size=61, max_seq_len=16, tie_embeddings=False)
    cfg.train.batch_size, cfg.train.dtype, cfg.train.device = GLOBAL_BATCH, "fp32", "cpu"
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                       pp_microbatches=MICRO, dp_mode=dp_mode)
    return cfg


def _batches():
    gen = torch.Generator().manual_seed(0)
    out = [torch.randint(0, 61, (GLOBAL_BATCH, 17), generator=gen) for _ in range(STEPS)]
    return [(b[:, :-1], b[:, 1:]) for b in out]


def _train(step_fn, target, params, optimizer_fn, batches):
    opt = optimizer_fn(torch.optim.SGD(params, lr=0.5, momentum=0.9))
    out = []
    for x, y in batches:
        loss, norm, skipped = step_fn(target, opt, [(x, y)], autocast=torch.autocast("cpu", enabled=False),
                                      scaler=None, clip=CLIP)
        out.append((float(loss), float(norm), bool(skipped)))
    return out


def _counting_hook(calls, average=True):
    """A DDP comm hook: records (step, bucket index) and all-reduces the bucket as DDP's default
    does (average=False: hands the local gradients back, the negative control)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(group, bucket):
        calls.append(bucket.index())
        if average:
            return allreduce_hook(group, bucket)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    return hook


def step_level(rank, world):
    import torch.distributed as dist

    from kiln.parallel import pipeline as pl
    from kiln.parallel.data_parallel import shard_optimizer_state
    from kiln.parallel.dims import ParallelDims
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    batches = _batches()
    got = {}
    if rank == 0:
        cfg = job()
        dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
        model = build_model(cfg, dims, torch.device("cpu"))
        got["reference"] = _train(train_step, model, model.parameters(), lambda o: o, batches)
    for name, (mode, schedule, virtual) in [*CASES.items(), ("ddp_1f1b_not_averaged", ("ddp", "1f1b", 1))]:
        cfg = job(pp=2, virtual=virtual, schedule=schedule, dp_mode=mode)
        cfg.train.batch_size = GLOBAL_BATCH // 2
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
        dims.build_mesh("cpu")
        assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode) == (2, 1, mode)
        model = build_model(cfg, dims, torch.device("cpu"))
        pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
        calls = {}
        for stage in pipe.stages:
            assert isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel)
            calls[stage.stage_index] = []
            stage.submod.register_comm_hook(stage.submod.process_group, _counting_hook(calls[stage.stage_index],
                                                                 average=not name.endswith("not_averaged")))
        # this replica's half of every global batch (the Loader's per-rank slice)
        half = slice(dims.dp_rank * cfg.train.batch_size, (dims.dp_rank + 1) * cfg.train.batch_size)
        mine = [(x[half], y[half]) for x, y in batches]
        rows = _train(pipeline_train_step, pipe, model.parameters(),
                      lambda o: shard_optimizer_state(o, dims), mine)
        got[name] = {"rows": rows, "calls": calls, "dp_rank": dims.dp_rank}
        dist.barrier()
    return got


@pytest.fixture(scope="module")
def four_ranks(launch):
    """What step_level returned on each rank (in the module's one 4-rank launch: `launch`)."""
    return launch[0]


def dp_mean(four_ranks, name):
    """Per step: (loss averaged over the dp replicas, grad norm of every rank)."""
    per_rank = [r[name]["rows"] for r in four_ranks]
    return [(sum(rows[s][0] for rows in per_rank) / len(per_rank), [rows[s][1] for rows in per_rank])
            for s in range(STEPS)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_replicated_pipeline_matches_one_process(four_ranks, name):
    ref = four_ranks[0]["reference"]
    assert max(norm for _, norm, _ in ref) > CLIP  # clipping is active
    for step, ((loss, norms), (ref_loss, ref_norm, _)) in enumerate(zip(dp_mean(four_ranks, name), ref)):
        assert loss == pytest.approx(ref_loss, rel=REL), f"{name} step {step + 1} loss"
        for rank, norm in enumerate(norms):
            assert norm == pytest.approx(ref_norm, rel=REL), f"{name} rank {rank} step {step + 1} grad norm"
    # the two replicas trained on different halves of the batch: their own losses differ
    assert four_ranks[0][name]["rows"][0][0] != pytest.approx(four_ranks[1][name]["rows"][0][0], rel=1e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_are_all_reduced_once_per_step_not_per_micro_batch(four_ranks, name):
    for rank in range(4):
        for stage, buckets in four_ranks[rank][name]["calls"].items():
            # every bucket exactly once per step (MICRO = 4 micro-batches would be 4x as many)
            assert buckets and len(buckets) == STEPS * len(set(buckets)), (rank, stage, buckets)


def test_tolerance_catches_gradients_not_averaged_over_replicas(four_ranks):
    ref = four_ranks[0]["reference"]
    got = dp_mean(four_ranks, "ddp_1f1b_not_averaged")
    assert got[0][0] == pytest.approx(ref[0][0], rel=REL)  # same start, then the replicas drift apart
    with pytest.raises(AssertionError):
        for (loss, norms), (ref_loss, ref_norm, _) in zip(got, ref):
            assert loss == pytest.approx(ref_loss, rel=REL)
            assert norms == pytest.approx([ref_norm] * 4, rel=REL)


def test_refusals_name_the_key():
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    # (the zero-bubble schedules run: test_pipeline_data_parallel_zero_bubble.py; with ep too)
    for mode, schedule, virtual in [("ddp", "1f1b", 1), ("ddp", "zbv_zero_bubble", 2), ("zero1", "zbv_zero_bubble", 2),
                                    ("zero1", "interleaved_zero_bubble", 2)]:
        cfg = job(pp=2, virtual=virtual, schedule=schedule, dp_mode=mode)  # tests/parallel/test_expert_replicated.py
        cfg.parallel.ep = 2
        dims = ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0)
        assert (dims.ep, dims.dp_replicate, dims.dp_mode) == (2, 2, mode)
    cfg = job(pp=2, virtual=2, schedule="zbv_zero_bubble", dp_mode="ddp")  # ep must still divide the replicas
    cfg.parallel.ep = 4
    with pytest.raises(ConfigError, match=r"parallel\.ep=4 must divide dp_replicate=2"):
        ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0)
    cfg = job(pp=2, dp_mode="zero1")  # accepted now: 2 replicas of a 2-stage pipeline
    dims = ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0)
    assert (dims.dp_replicate, dims.pp, dims.dp_mode) == (2, 2, "zero1")


# ---------------------------------------------------------------- kiln's trainer: checkpoints across layouts

PP = {"parallel.pp": 2, "parallel.pp_schedule": "'1f1b'"}
LAYOUTS = {"single": (1, {}), "ddp_pp": (4, {**PP, "parallel.dp_mode": "'ddp'"}),
           "zero1_pp": (4, {**PP, "parallel.pp_schedule": "'gpipe'", "parallel.dp_mode": "'zero1'"}),
           "fsdp_pp": (4, {**PP, "parallel.dp_mode": "'fsdp'"}),
           # DDP over the cp ranks of each stage (no replicas): cp's gradient average is DDP's
           "ddp_cp_pp": (4, {**PP, "parallel.cp": 2, "parallel.dp_mode": "'ddp'"}),
           # a zero-bubble schedule (no DDP wrapper: data_parallel.py SplitBackwardReplicas); one
           # stage per rank, as the 2-layer test model has 2 layers
           "ddp_zero_bubble_pp": (4, {**PP, "parallel.pp_schedule": "'interleaved_zero_bubble'",
                                      "parallel.dp_mode": "'ddp'"}),
           "ddp_cp_zero_bubble_pp": (4, {**PP, "parallel.pp_schedule": "'interleaved_zero_bubble'", "parallel.cp": 2,
                                         "parallel.dp_mode": "'ddp'"})}
PAIRS = {"ddp_pp": ["single", "fsdp_pp"], "zero1_pp": ["single"]}  # saved at step 3 -> continued in
SAVED_ONLY = ["ddp_cp_pp", "ddp_zero_bubble_pp", "ddp_cp_zero_bubble_pp"]  # steps 1..3 checked, not continued


def step_level_then_train_jobs(rank, world, jobs):
    """The module's one 4-rank launch: step_level, then test_cross_layout's train_jobs on `jobs`."""
    got = step_level(rank, world)
    cross.train_jobs(rank, world, jobs)
    return got


@pytest.fixture(scope="module")
def launch(tmp_path_factory, text_file, cross_layout_reference):
    """(step_level's results per rank, trainer_runs' directories, the jobs left for one process)."""
    root = tmp_path_factory.mktemp("ddp_pp_trainer")
    shards = cross_layout_reference.parent / "shards"  # tokenized by the reference run
    with mock.patch.dict(cross.LAYOUTS, LAYOUTS):
        sets = {name: cross.overrides(text_file, shards, name) for name in LAYOUTS}
    assert json.loads((cross_layout_reference / "sets.json").read_text()) == sets["single"]
    out = {"reference": cross_layout_reference}
    four = [(None, root / saved, sets[saved], cross.SAVE_AT) for saved in [*PAIRS, *SAVED_ONLY]]
    out.update({saved: root / saved for saved in [*PAIRS, *SAVED_ONLY]})
    single = []
    for saved, targets in PAIRS.items():
        for target in targets:
            out[f"{saved}->{target}"] = run = root / f"{saved}-to-{target}"
            (four if LAYOUTS[target][0] == 4 else single).append((root / saved, run, sets[target], None))
    work = root / "ranks4"
    work.mkdir()
    return run_ranks(step_level_then_train_jobs, 4, work, four, timeout=400), out, single


@pytest.fixture(scope="module")
def trainer_runs(launch):
    """test_cross_layout's runs for these layouts: the reference (one process, 6 steps: conftest's,
    the one test_cross_layout reads), every saved layout (steps 1..3) and every continued pair
    (steps 4..6); the 4-rank runs in `launch`, the one-process continuations here."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    _, out, single = launch
    for source, run, job_sets, _ in single:
        shutil.copytree(source, run)
        train(load_config(None, job_sets), run, resume=True)
    return out


def _rows(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pair", [f"{s}->{t}" for s, ts in PAIRS.items() for t in ts])
def test_trainer_checkpoint_continues_in_another_layout_with_the_same_losses(trainer_runs, pair):
    reference = cross.losses(trainer_runs["reference"])
    saved, target = pair.split("->")
    run_row = _rows(trainer_runs[saved], "run")[0]
    assert (run_row["dp_mode"], run_row["pp"], run_row["dp_replicate"], run_row["world_size"]) == \
        (saved.split("_")[0], 2, 2, 4)
    # the loss is the mean over the replicas, the tokens those of the whole global batch
    cross.assert_same_losses(reference, cross.losses(trainer_runs[saved]), range(1, cross.SAVE_AT + 1), saved)
    ref_tokens = {r["step"]: r["tokens"] for r in _rows(trainer_runs["reference"], "train")}
    for row in _rows(trainer_runs[saved], "train"):
        assert row["tokens"] == ref_tokens[row["step"]] and row["tokens_per_s"] > 0
    got = cross.losses(trainer_runs[pair])
    assert sorted(got) == list(range(1, cross.STEPS + 1))
    assert _rows(trainer_runs[pair], "run")[-1]["resumed_from"] == cross.SAVE_AT
    cross.assert_same_losses(reference, got, range(cross.SAVE_AT + 1, cross.STEPS + 1), pair)


def test_trainer_ddp_over_cp_in_each_stage_matches_one_process(trainer_runs):
    run = trainer_runs["ddp_cp_pp"]
    run_row = _rows(run, "run")[0]
    # (the run row's dp_mode says "none": no data-parallel replicas, cp alone)
    assert (run_row["pp"], run_row["cp"], run_row["world_size"]) == (2, 2, 4)
    cross.assert_same_losses(cross.losses(trainer_runs["reference"]), cross.losses(run),
                             range(1, cross.SAVE_AT + 1), "ddp_cp_pp")


@pytest.mark.parametrize("name,cp", [("ddp_zero_bubble_pp", 1), ("ddp_cp_zero_bubble_pp", 2)])
def test_trainer_ddp_with_a_zero_bubble_schedule_matches_one_process(trainer_runs, name, cp):
    run = trainer_runs[name]
    run_row = _rows(run, "run")[0]
    assert (run_row["pp_schedule"], run_row["dp_replicate"] * run_row["cp"], run_row["cp"]) == \
        ("interleaved_zero_bubble", 2, cp)  # averaged over 2 replicas, or over the 2 cp ranks of a stage
    cross.assert_same_losses(cross.losses(trainer_runs["reference"]), cross.losses(run),
                             range(1, cross.SAVE_AT + 1), name)
