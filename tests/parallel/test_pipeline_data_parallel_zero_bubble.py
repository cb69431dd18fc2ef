"""DDP and ZeRO-1 across pipeline replicas under the zero-bubble schedules (dp 2 x pp 2 on 4 gloo
ranks, 2 stages per rank). torch's weight pass bypasses DDP's hooks, so no stage is wrapped in DDP:
the replicas start from the first replica's parameters (DDP's own broadcast) and average their
gradients after each step (kiln/parallel/data_parallel.py `SplitBackwardReplicas`).

Same model, batches, optimizer (SGD with momentum, clipping at 0.5, active) and tolerance as
test_pipeline_data_parallel.py (fp32, relative 1e-5 per step over 5 steps): ddp with ZBV and
interleaved zero-bubble (in 10 KB buckets), zero1 with ZBV, and ddp with DualPipeV (torch 2.9+) give one process's per-step losses
(mean over the replicas) and grad norms (every rank); observed 5.8e-8 loss, 8.0e-8 norm. The second replica starts from perturbed parameters, so a missing
broadcast fails the comparison too. Negative control: the same ZBV run without the average drifts
away beyond the tolerance.
"""

import pytest
import torch

import test_pipeline_data_parallel as ddp_pp
from kiln.parallel.pipeline_layout import schedule_available
from kiln.train.pipeline_step import pipeline_train_step
from ranks import run_ranks

STEPS, REL, CLIP = ddp_pp.STEPS, ddp_pp.REL, ddp_pp.CLIP
# name -> (dp_mode, schedule); 2 stages per rank, 4 micro-batches per replica
CASES = {"ddp_zbv": ("ddp", "zbv_zero_bubble"), "ddp_interleaved_zero_bubble": ("ddp", "interleaved_zero_bubble"),
         "zero1_zbv": ("zero1", "zbv_zero_bubble")}
if schedule_available("dualpipev"):  # torch 2.9+: the V with DualPipeV's order (4 micro-batches: its least)
    CASES["ddp_dualpipev"] = ("ddp", "dualpipev")
NOT_AVERAGED = "ddp_zbv_not_averaged"
SMALL_BUCKETS = {"ddp_interleaved_zero_bubble": 0.01}  # MB: 10 KB buckets (a 32 x 32 fp32 weight is 4 KB)


def step_level(rank, world):
    import torch.distributed as dist

    from kiln.parallel import pipeline as pl
    from kiln.parallel.data_parallel import SplitBackwardReplicas, Zero1Optimizer, shard_optimizer_state
    from kiln.parallel.dims import ParallelDims
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    batches = ddp_pp._batches()
    got = {}
    if rank == 0:
        cfg = ddp_pp.job()
        dims = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
        model = build_model(cfg, dims, torch.device("cpu"))
        got["reference"] = ddp_pp._train(train_step, model, model.parameters(), lambda o: o, batches)
    for name, (mode, schedule) in [*CASES.items(), (NOT_AVERAGED, ("ddp", "zbv_zero_bubble"))]:
        cfg = ddp_pp.job(pp=2, virtual=2, schedule=schedule, dp_mode=mode)
        cfg.train.batch_size = ddp_pp.GLOBAL_BATCH // 2
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
        dims.build_mesh("cpu")
        assert (dims.dp_replicate, dims.dp_mode) == (2, mode)
        model = build_model(cfg, dims, torch.device("cpu"))
        if dims.dp_rank == 1:  # replicas that start apart: the Pipeline's broadcast must undo it
            gen = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen), alpha=0.05)
        pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
        if name in SMALL_BUCKETS:  # many buckets, several parameters each (the default cap holds all)
            pipe.replicas = SplitBackwardReplicas(model.chunks, dims, bucket_cap_mb=SMALL_BUCKETS[name])
        assert not any(isinstance(s.submod, torch.nn.parallel.DistributedDataParallel) for s in pipe.stages)
        calls = []
        average = pipe.replicas.average

        def counted(average=average, skip=name == NOT_AVERAGED):
            calls.append(1)
            if not skip:
                average()

        pipe.replicas.average = counted
        half = slice(dims.dp_rank * cfg.train.batch_size, (dims.dp_rank + 1) * cfg.train.batch_size)
        optimizers = []

        def optimizer(o, dims=dims):
            optimizers.append(shard_optimizer_state(o, dims))
            return optimizers[-1]

        rows = ddp_pp._train(pipeline_train_step, pipe, model.parameters(), optimizer,
                             [(x[half], y[half]) for x, y in batches])
        got[name] = {"rows": rows, "averages": len(calls), "zero1": isinstance(optimizers[0], Zero1Optimizer),
                     "buckets": len(pipe.replicas.buckets)}
        dist.barrier()
    return got


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(step_level, 4, tmp_path_factory.mktemp("ddp_pp_zero_bubble"), timeout=240)


def within_tolerance(four_ranks, name):
    ref = four_ranks[0]["reference"]
    for step, ((loss, norms), (ref_loss, ref_norm, _)) in enumerate(zip(ddp_pp.dp_mean(four_ranks, name), ref)):
        assert loss == pytest.approx(ref_loss, rel=REL), f"{name} step {step + 1} loss"
        for rank, norm in enumerate(norms):
            assert norm == pytest.approx(ref_norm, rel=REL), f"{name} rank {rank} step {step + 1} grad norm"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_replicas_match_one_process(four_ranks, name):
    assert max(norm for _, norm, _ in four_ranks[0]["reference"]) > CLIP  # clipping is active
    within_tolerance(four_ranks, name)
    # the two replicas trained on different halves of the batch: their own losses differ
    assert four_ranks[0][name]["rows"][0][0] != pytest.approx(four_ranks[1][name]["rows"][0][0], rel=1e-3)
    for got in four_ranks:  # one average per step (not per micro-batch), in DDP-sized buckets
        assert got[name]["averages"] == STEPS and got[name]["buckets"] >= (4 if name in SMALL_BUCKETS else 1)
        assert got[name]["zero1"] == (CASES[name][0] == "zero1")


def test_tolerance_catches_gradients_not_averaged_over_replicas(four_ranks):
    got = ddp_pp.dp_mean(four_ranks, NOT_AVERAGED)
    # same start (the broadcast ran), then the replicas drift apart
    assert got[0][0] == pytest.approx(four_ranks[0]["reference"][0][0], rel=REL)
    with pytest.raises(AssertionError):
        within_tolerance(four_ranks, NOT_AVERAGED)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble"])
@pytest.mark.parametrize("dp_mode", ["ddp", "zero1", "auto"])
def test_zero_bubble_schedules_are_accepted_with_replicas(schedule, dp_mode):
    from kiln.parallel.dims import ParallelDims

    cfg = ddp_pp.job(pp=2, virtual=2, schedule=schedule, dp_mode=dp_mode)
    if dp_mode == "auto":  # auto with replicas alone is ddp
        cfg.parallel.dp_replicate = 2
    dims = ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0)
    assert (dims.dp_replicate, dims.pp, dims.dp_mode) == (2, 2, "ddp" if dp_mode == "auto" else dp_mode)
