"""Pipeline x tensor x context parallelism together (pp=2 x tp=2 x cp=2, 8 gloo ranks): `kiln
train` (the trainer in-process on every rank: loader, metrics, evaluation through the pipeline and
checkpoints) gives the per-step losses, grad norms and the evaluation loss of one process on the
same batch, for the GPT-2 architecture and a Llama-style mixture-of-experts model (MoE under all
three: routing over the cp ranks, expert hidden units over tp, stage MoE losses in the pipeline's
backward), and its checkpoint continues in one process with the same losses. Each tp rank runs
its own pipeline over its pp group; a stage receives the sequence-parallel shard (1/tp) of its cp
rank's zig-zag slice (1/cp) of every sequence and attends with ring attention over its cp group.
Negative control: stages that take 0..len-1 for the zig-zag slice's positions do not match.

Tolerance: fp32, relative 1e-5 per step (TP reorders the row-wise reductions and the sharded
softmax, CP the attention sums, PP the micro-batch sums). SGD with momentum and clipping active,
so a gradient that is wrong on any rank shows in the next step's loss. Kept to 3 steps and a tiny
model: 8 processes share the suite's 2 cores.
"""

import json
import shutil

import pytest

from kiln.config import load_config
from conftest import tiny_overrides
from ranks import run_ranks
from test_moe_tensor_parallel_layouts import rows, train_on_rank

REL = 1e-5
STEPS = 3
PP_TP_CP = {"parallel.pp": 2, "parallel.tp": 2, "parallel.cp": 2, "parallel.pp_schedule": "'1f1b'",
            "parallel.pp_microbatches": 2}
BASE = {"model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.tie_embeddings": "false",
        "data.seq_len": 16, "train.batch_size": 2, "train.grad_accum": 1, "train.steps": STEPS,
        "train.eval_every": STEPS, "train.eval_batches": 1, "checkpoint.every": 2, "checkpoint.keep_last": 2,
        "optim.name": "sgd", "optim.lr": 0.1, "optim.momentum": 0.9, "train.clip_grad_norm": 1.0,
        "train.device": "cpu", "schedule.warmup_steps": 0,
        "metrics.peak_flops": 1e12}  # a given peak: no matmul probe per run (seconds on a loaded core)
# GPT-2: learned positions (a wrong position shows at once), LayerNorm with bias, biases, GeLU.
GPT2 = {**BASE, "model.positions": "'learned'", "model.norm": "'layernorm'", "model.bias": "true",
        "model.activation": "'gelu'"}
# Llama-style, every block MoE (one per stage), top-2 with capacity 1.25 (assignments dropped).
MOE = {**BASE, "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_every": 1,
       "model.moe_aux_loss_weight": 0.1, "model.moe_z_loss_weight": 0.01}
MODELS = {"gpt2": GPT2, "moe": MOE}


def job(text_file, model, **extra):
    return load_config(None, tiny_overrides(text_file, **{**MODELS[model], **extra}))


def _worker(rank, world, text_file, tmp):
    from kiln.parallel import context_parallel

    for model in MODELS:
        train_on_rank(rank, world, job(text_file, model, **PP_TP_CP), tmp / model)
    # Stages that number the zig-zag slice's tokens 0..len-1 (RoPE tables, learned positions).
    enter = context_parallel.ContextParallel.__enter__

    def without_positions(self):
        enter(self)
        self.model.seq_positions = None
        return self

    context_parallel.ContextParallel.__enter__ = without_positions
    try:
        train_on_rank(rank, world, job(text_file, "gpt2", **PP_TP_CP), tmp / "gpt2_positions_ignored")
    finally:
        context_parallel.ContextParallel.__enter__ = enter


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory, text_file):
    tmp = tmp_path_factory.mktemp("pptpcp")
    run_ranks(_worker, 8, tmp, text_file, tmp, timeout=400)
    return tmp


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, text_file):
    from kiln.train.trainer import train

    tmp = tmp_path_factory.mktemp("pptpcp1")
    for model in MODELS:
        train(job(text_file, model), tmp / model)
    return {model: rows(tmp / model) for model in MODELS}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("model", list(MODELS))
def test_pp2_tp2_cp2_matches_one_process(eight_ranks, one_process, model):
    # [loss, grad norm(, moe aux, moe z)] per step, then the eval loss
    got, expected = rows(eight_ranks / model), one_process[model]
    per_step = 4 if model == "moe" else 2
    assert len(got) == per_step * STEPS + 1
    assert got == pytest.approx(expected, rel=REL), (got, expected)
    assert expected[per_step * (STEPS - 1)] < expected[0] and expected[1] > 1.0  # it trains, clipping is exercised


def test_stages_ignoring_the_slice_positions_change_the_losses(eight_ranks, one_process):
    got, expected = rows(eight_ranks / "gpt2_positions_ignored"), one_process["gpt2"]
    assert got[0] != pytest.approx(expected[0], rel=REL)
    assert got[2::2][:STEPS - 1] != pytest.approx(expected[2::2][:STEPS - 1], rel=REL)


@pytest.mark.timeout(300)
def test_pp2_tp2_cp2_checkpoint_continues_in_one_process(eight_ranks, one_process, tmp_path):
    from kiln.train.trainer import train

    run = tmp_path / "resumed"
    shutil.copytree(eight_ranks / "gpt2", run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    cfg = load_config(run / "config.toml", ["parallel.pp=1", "parallel.tp=1", "parallel.cp=1"])
    train(cfg, run, resume=True)  # weights, momentum, the loader's position from step 2
    got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in got if r["kind"] == "train"][-1]
    assert step["step"] == STEPS and any(r["kind"] == "event" and r["message"].startswith("resumed step 2 ")
                                         for r in got)
    evaluated = [r for r in got if r["kind"] == "eval"][-1]
    # the resumed step's loss and grad norm, and the evaluation after it, are the single run's
    assert [step["loss"], step["grad_norm"], evaluated["val_loss"]] == pytest.approx(one_process["gpt2"][-3:], rel=REL)
