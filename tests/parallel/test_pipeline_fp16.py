"""fp16 with a grad scaler under pipeline parallelism (kiln/parallel/pipeline.py `ScaledLoss`,
`agree_found_inf`, `pipeline_train_step`): on 2 gloo ranks, fp16 autocast and torch's
GradScaler('cpu') through the pipeline give the per-step losses, grad norms, skip flags and loss
scales of one process running kiln's `train_step` with the same scaler settings on the same global
batch, and the same weights at the end.

The scaler starts at 2**30 (the fp16 logit gradients overflow on the last stage: steps skipped on
every stage until the scale has come down, x 1/16 per overflow), grows every 2 good steps, and
overflows naturally once more at step 6; at step POISON the first stage's layers.0 wq gradient
alone is made inf (a hook, in the reference too), an overflow only stage 0 sees: both stages must
skip it. Cases: 1F1B, interleaved 1F1B (two stages per rank), and MoE under 1F1B for 5 steps (the
aux losses join the backward inside the stages and must be scaled like the loss; after step 5,
fp16 rounding flips routing decisions and the runs drift apart, 6e-3 in the grad norm at step 7).

Negative controls: with the found-inf flag left per rank (`agree_found_inf` a no-op), stage 0
skips the POISON step and the last stage steps: the ranks' scales part and the last stage's
weights leave the reference's; with the MoE aux losses' backward left unscaled, the MoE rows
leave the reference's (3.6e-3 in the grad norm at step 4, 9% at step 5).

On 4 ranks, pp2 x tp2 and pp2 x fsdp2 (gradients are DTensors there; the scaler's found-inf is
agreed over all ranks) give the same skips and scales as one process for 6 steps (losses and grad
norms relative 5e-3: tp's sharded fp16 matmuls and FSDP's reduce-scatter round differently).

Tolerance on 2 ranks (fp16 autocast; the gradient sum over micro-batches and the grad-norm sum over
stages run in another order than one process's): losses and grad norms relative 2e-3 (measured at
most 8e-4), final weights absolute 2e-3 (lr 1e-2, measured 3.5e-4); skips and scales exact.
"""

import dataclasses
import math
from unittest import mock

import torch

from ranks import run_ranks

STEPS, POISON, CLIP = 12, 9, 1.0
GLOBAL_BATCH, MICRO = 8, 4
SCALER = dict(init_scale=2.0 ** 30, growth_factor=2.0, backoff_factor=2.0 ** -4, growth_interval=2)
REL, WEIGHT_ATOL = 2e-3, 2e-3
# MoE: the first MOE_STEPS only (3 skipped, 2 stepped); after those, fp16 rounding flips routing
# decisions and the runs drift apart (grad norm 6e-3 off at step 7, measured)
STEPS_MOE = 5
CASES = {"1f1b": ("1f1b", 1, False, STEPS), "interleaved": ("interleaved_1f1b", 2, False, STEPS),
         "moe": ("1f1b", 1, True, STEPS_MOE)}
MOE = dict(moe_experts=4, moe_top_k=2, moe_aux_loss_weight=0.1, moe_z_loss_weight=0.01, init_std=0.1)


def job(pp=1, schedule="1f1b", virtual=1, moe=False):
    from kiln.config import JobConfig, ModelConfig, OptimConfig

    cfg = JobConfig()
    cfg.model = ModelConfig(dim=32, n_layers=4, n_heads=2, vocab_size=61, max_seq_len=16, **(MOE if moe else {}))
    cfg.optim = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    cfg.train.batch_size, cfg.train.dtype, cfg.train.device = GLOBAL_BATCH, "fp16", "cpu"
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                       pp_microbatches=MICRO if pp > 1 else 0)
    return cfg


def micro_batches(step):
    """The global batch of `step` as MICRO grad-accumulation micro-batches (the pipeline joins them
    and its schedule splits them into the same MICRO pieces)."""
    gen = torch.Generator().manual_seed(step)
    b = torch.randint(0, 61, (GLOBAL_BATCH, 17), generator=gen)
    return [(x[:, :-1], x[:, 1:]) for x in b.chunk(MICRO)]


def train(step_fn, target, model, opt, steps=STEPS):
    """Rows (loss, grad norm, skipped, scale after the step) and the final weights."""
    from kiln.train.evaluate import autocast_context

    scaler = torch.amp.GradScaler("cpu", **SCALER)
    rows, step = [], 0
    def poison(param):
        if step == POISON:
            param.grad.fill_(float("inf"))

    first_layer = dict(model.named_modules()).get("layers.0")  # on the first stage only
    if first_layer is not None:  # an overflow only that stage sees (not in the tied embedding,
        # whose gradient the last stage's head copy sums in)
        first_layer.attention.wq.weight.register_post_accumulate_grad_hook(poison)
    for step in range(1, steps + 1):
        loss, norm, skipped = step_fn(target, opt, micro_batches(step), scaler=scaler, clip=CLIP,
                                      autocast=autocast_context(torch.device("cpu"), "fp16"))
        rows.append((float(loss), float(norm), bool(skipped), scaler.get_scale()))
    return rows, {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process(moe=False):
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    cfg = job(moe=moe)
    model = build_model(cfg, ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0),
                        torch.device("cpu"))
    return train(train_step, model, model, build_optimizer(model, cfg.optim, "cpu"), STEPS_MOE if moe else STEPS)


def pipelined(rank, world, cfg, steps=STEPS, scale_moe_losses=True):
    from kiln.parallel import pipeline as pl
    from kiln.parallel.dims import ParallelDims
    from kiln.train.optim import build_optimizer
    from kiln.train.trainer import build_model

    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
    dims.build_mesh("cpu")
    model = build_model(cfg, dims, torch.device("cpu"))
    pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
    if not scale_moe_losses:  # negative control: the aux losses' backward left unscaled
        for chunk in model.chunks:
            del chunk.__dict__["loss_scale"]
    return train(pl.pipeline_train_step, pipe, model, build_optimizer(model, cfg.optim, "cpu"), steps)


def two_rank_jobs(rank, world):
    from kiln.parallel import pipeline as pl

    got = {name: pipelined(rank, world, job(pp=2, schedule=s, virtual=v, moe=moe), steps)
           for name, (s, v, moe, steps) in CASES.items()}
    got["moe unscaled"] = pipelined(rank, world, job(pp=2, moe=True), STEPS_MOE, scale_moe_losses=False)
    with mock.patch.object(pl, "agree_found_inf", lambda *args: None):  # the negative control
        got["unagreed"] = pipelined(rank, world, job(pp=2))
    return got


def close(got, want):
    """Within REL, or both not finite (a skipped step's grad norm is inf or nan)."""
    return abs(got - want) <= REL * abs(want) or not (math.isfinite(got) or math.isfinite(want))


def rows_match(got, want):
    return all(g[2:] == w[2:] and close(g[0], w[0]) and close(g[1], w[1]) for g, w in zip(got, want, strict=True))


def weights_match(got, want):
    return all(torch.allclose(v, want[k], rtol=0, atol=WEIGHT_ATOL) for k, v in got.items())


def test_fp16_pipeline_matches_one_process_and_skips_together(tmp_path):
    refs = {moe: one_process(moe) for moe in (False, True)}
    ref_rows, ref_weights = refs[False]
    skips = [r[2] for r in ref_rows]
    # the scale came down from 2**40 (overflow on every stage), then grew; the poisoned step skipped
    assert skips[0] and not all(skips[:POISON - 1]) and skips[POISON - 1] and not skips[-1], ref_rows
    assert any(b[3] > a[3] for a, b in zip(ref_rows, ref_rows[1:])), ref_rows  # and grew
    ranks = run_ranks(two_rank_jobs, 2, tmp_path, timeout=180)
    for name, (_, _, moe, steps) in CASES.items():
        want_rows, want_weights = refs[moe]
        for rank, got in enumerate(ranks):
            rows, weights = got[name]
            assert rows_match(rows, want_rows[:steps]), (name, rank, rows, want_rows)
            if steps == STEPS:
                assert weights.keys() <= want_weights.keys() and weights_match(weights, want_weights), (name, rank)
    # MoE aux losses join the backward inside the stages: unscaled there, the check fails
    assert not rows_match(ranks[0]["moe unscaled"][0], refs[True][0][:STEPS_MOE])
    # Negative control: stage 0 skipped the poisoned step, the last stage stepped.
    (rows0, _), (rows1, weights1) = ranks[0]["unagreed"], ranks[1]["unagreed"]
    assert rows_match(rows0[:POISON - 1], ref_rows[:POISON - 1])  # agreed until then (the overflow hit both)
    assert rows0[POISON - 1][3] != rows1[POISON - 1][3]  # the scales part
    assert not weights_match(weights1, ref_weights)
    assert not rows_match(rows1, ref_rows)


STEPS_4 = 6  # skipped 1-3 (the scale comes down), stepped 4-5, a natural overflow at 6
LAYOUTS = {"pp2 x tp2": dict(tp=2), "pp2 x fsdp2": dict(dp_shard=2, dp_mode="fsdp")}
REL_4 = 5e-3  # tp's sharded fp16 matmuls and FSDP's reduce-scatter add rounding: grad norm 1.3e-3 off, measured


def four_rank_jobs(rank, world):
    """Each layout's rows on this rank; under fsdp each dp rank takes its half of every micro-batch
    (its loss is that of its half: the trainer averages the rows over ranks, as the test does)."""
    from kiln.parallel.dims import ParallelDims

    got = {}
    for name, layout in LAYOUTS.items():
        cfg = job(pp=2)
        cfg.parallel = dataclasses.replace(cfg.parallel, **layout)
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
        dims.build_mesh("cpu")
        dp, dp_rank = dims.dp_size, dims.dp_rank
        cfg.train.batch_size = GLOBAL_BATCH // dp
        with mock.patch(f"{__name__}.micro_batches",
                        lambda step, whole=micro_batches: [(x[dp_rank::dp], y[dp_rank::dp]) for x, y in whole(step)]):
            got[name] = pipelined(rank, world, cfg, STEPS_4)[0]
    return got


def test_fp16_pipeline_under_tp_and_fsdp_matches_one_process(tmp_path):
    ref = one_process()[0][:STEPS_4]
    assert [r[2] for r in ref] == [True] * 3 + [False] * 2 + [True], ref
    ranks = run_ranks(four_rank_jobs, 4, tmp_path, timeout=240)
    for name in LAYOUTS:
        for step, want in enumerate(ref):
            rows = [got[name][step] for got in ranks]
            assert all(r[2:] == want[2:] for r in rows), (name, step + 1, rows, want)  # skips, scale
            if "fsdp" in name:  # each dp rank's loss is that of its own half of the batch
                assert rows[0][0] != rows[1][0] or rows[0][0] != rows[2][0], rows
            loss = sum(r[0] for r in rows) / len(rows)  # as the trainer's fetch: the mean over ranks
            assert abs(loss - want[0]) <= REL_4 * want[0], (name, step + 1, rows, want)
            assert all(abs(r[1] - want[1]) <= REL_4 * want[1] or want[2] for r in rows), (name, step + 1, rows, want)
