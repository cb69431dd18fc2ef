"""A mixture-of-experts model under tensor parallel together with context parallel and with
pipeline parallel: `kiln train` (the trainer in-process on 4 gloo ranks: loader,
metrics, evaluation and checkpoints included) gives the per-step losses, grad norms and the logged
load-balancing and z-losses of one process on the same global batch. Negative controls: MoE
routing that counts capacity slots and load-balancing shares on the cp slice only, and pipeline
stages whose MoE losses are reported but not backpropagated, do not match. MoE x TP alone:
test_tensor_parallel.py (float8: test_tensor_parallel_float8.py). Compile under tp (per block
and `train.compile_scope='model'`, with an MoE block): test_tensor_parallel_compile.py.

Tolerance: fp32, relative 1e-5 per step (TP reorders the row-wise reductions, CP the attention
sums, PP the micro-batch sums). SGD with clipping active, top-2 routing with capacity 1.25
(assignments are dropped), aux/z weights large enough that a wrong routing statistic or a missing
aux gradient shows in the losses.
"""

import json
import os

import pytest

from kiln.config import load_config
from conftest import tiny_overrides
from ranks import run_ranks

REL = 1e-5
STEPS = 5

# All blocks MoE (so both pipeline stages have one), top-2, capacity 1.25; seq 16 splits into
# 2*cp = 4 zig-zag chunks and over tp=2.
MOE = {"model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.tie_embeddings": "false",
       "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_every": 1, "model.moe_aux_loss_weight": 0.1,
       "model.moe_z_loss_weight": 0.01, "data.seq_len": 16, "train.batch_size": 2, "train.grad_accum": 1,
       "train.steps": STEPS, "train.eval_every": STEPS, "train.eval_batches": 1, "checkpoint.every": 0,
       "optim.name": "sgd", "optim.lr": 0.1, "train.clip_grad_norm": 1.0, "train.device": "cpu",
       "schedule.warmup_steps": 0,
       "metrics.peak_flops": 1e12}  # a given peak: no matmul probe per run (seconds on a loaded core)

# name -> parallel/train overrides on 4 ranks (the global batch stays 2 sequences)
CASES = {"tp2_cp2": {"parallel.tp": 2, "parallel.cp": 2},
         "tp2_pp2": {"parallel.tp": 2, "parallel.pp": 2, "parallel.pp_schedule": "'1f1b'",
                     "parallel.pp_microbatches": 2}}
BROKEN = {"tp2_cp2_slice_routing": CASES["tp2_cp2"], "tp2_pp2_moe_loss_not_backpropagated": CASES["tp2_pp2"]}


def job(text_file, **extra):
    return load_config(None, tiny_overrides(text_file, **{**MOE, **extra}))


def train_on_rank(rank, world, cfg, run_dir):
    """`kiln train`'s trainer on this rank of an already started gloo group (tests/parallel/ranks.py):
    torchrun's environment, which ParallelDims reads, then kiln.train.trainer.train."""
    from kiln.train.trainer import train

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    train(cfg, run_dir)


def rows(run_dir):
    """[loss, grad norm(, moe aux, moe z)] per training step (the MoE losses where the model has
    MoE layers), then the evaluation losses, flat."""
    got = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [[r["loss"], r["grad_norm"], *[r[k] for k in ("moe_aux_loss", "moe_z_loss") if k in r]]
             for r in got if r["kind"] == "train"]
    return [x for r in train for x in r] + [r["val_loss"] for r in got if r["kind"] == "eval"]


def _worker(rank, world, text_file, tmp):
    from kiln.parallel import context_parallel, pipeline_stages

    for name, extra in CASES.items():
        train_on_rank(rank, world, job(text_file, **extra), tmp / name)
    # Routing on the cp slice alone: capacity slots and load-balancing shares of half a sequence.
    moe_modules = context_parallel._moe_modules
    context_parallel._moe_modules = lambda model: []
    try:
        train_on_rank(rank, world, job(text_file, **BROKEN["tp2_cp2_slice_routing"]), tmp / "tp2_cp2_slice_routing")
    finally:
        context_parallel._moe_modules = moe_modules
    # Stages whose MoE losses are in the reported loss but never reach their routers' gradients.
    add_to_backward = pipeline_stages._AddToBackward
    pipeline_stages._AddToBackward = type("NotBackpropagated", (), {"apply": staticmethod(lambda h, extra: h)})
    try:
        train_on_rank(rank, world, job(text_file, **BROKEN["tp2_pp2_moe_loss_not_backpropagated"]),
                      tmp / "tp2_pp2_moe_loss_not_backpropagated")
    finally:
        pipeline_stages._AddToBackward = add_to_backward


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, text_file):
    tmp = tmp_path_factory.mktemp("moetp")
    run_ranks(_worker, 4, tmp, text_file, tmp, timeout=300)
    return {name: rows(tmp / name) for name in [*CASES, *BROKEN]}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, text_file):
    from kiln.train.trainer import train

    run = tmp_path_factory.mktemp("moetp1") / "single"
    train(job(text_file), run)
    return rows(run)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_moe_under_tp_with_cp_or_pp_matches_one_process(four_ranks, one_process, name):
    expected = one_process
    assert four_ranks[name] == pytest.approx(expected, rel=REL), (four_ranks[name], expected)
    assert expected[4 * STEPS - 4] < expected[0] and expected[1] > 1.0  # it trains, clipping is exercised
    assert expected[2] > 0 and expected[3] > 0  # the aux and z-losses are logged (and join the loss)


def test_moe_routing_on_the_cp_slice_alone_differs(four_ranks, one_process):
    got, expected = four_ranks["tp2_cp2_slice_routing"], one_process
    assert got[2] != pytest.approx(expected[2], rel=REL)  # half a sequence's load-balancing shares
    assert got[0::4][:STEPS] != pytest.approx(expected[0::4][:STEPS], rel=REL)


def test_pipeline_moe_losses_without_their_gradient_differ(four_ranks, one_process):
    got, expected = four_ranks["tp2_pp2_moe_loss_not_backpropagated"], one_process
    # the same first forward (loss, aux and z-loss reported); the routers miss the aux gradient
    assert [got[0], *got[2:4]] == pytest.approx([expected[0], *expected[2:4]], rel=REL)
    assert got[1] != pytest.approx(expected[1], rel=REL)
    assert got[4::4][:STEPS - 1] != pytest.approx(expected[4::4][:STEPS - 1], rel=REL)
