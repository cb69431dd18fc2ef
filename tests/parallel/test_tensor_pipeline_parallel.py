"""Tensor x pipeline and context x pipeline parallelism: 4 gloo ranks (tp=2 x pp=2, cp=2 x pp=2)
give the per-step losses and grad norms of one process on the same batch, for GPipe, 1F1B and
interleaved 1F1B and the zero-bubble schedules, the Llama-style and the GPT-2 architecture, and
evaluation through the pipeline gives the single-process loss of the trained model. In the same
launch: train.loss = "chunked" (the last stage's vocab-parallel chunked head + loss; the one-process
reference runs the full loss) for GPT-2 under tp2 x pp2, and with `compile_scope = "model"` (each
stage chunk one graph, the loss inside it; aot_eager, see COMPILE_BACKEND) for the Llama model under
tp2 x pp2 and under FSDP dp_shard 2 x pp2; and without pp, ddp x tp2 x cp2 (dp 1: kiln's replicas
average over the cp ranks). Negative controls: sequence shards sent between stages to the wrong tp rank (pipelines built across the tp
dimension), cp stages that ignore their zig-zag slice's positions, and a zero-bubble schedule over
FSDP units resharded after forward (their split weight pass computes nothing), do not match. (`kiln train` with tp=2 x pp=2 and its
checkpoint continuing in one process: tests/parallel/test_pipeline_parallel.py, which has the
single-process run.)

Tolerance: fp32, relative 1e-5 per step (TP reorders the row-wise reductions and the sharded
softmax, PP the micro-batch sums). SGD with momentum and clipping active, so a gradient that is
wrong on any rank shows in the next step's loss.
"""

import functools
import os
from types import SimpleNamespace

import pytest
import torch

from kiln.config import load_config
from ranks import run_ranks

STEPS = 5
REL = 1e-5
BATCH, SEQ = 4, 16
CLIP = 1.0

BASE = ["model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=32", "model.dropout=0.0",
        "model.tie_embeddings=false", f"data.seq_len={SEQ}", f"train.batch_size={BATCH}", "train.dtype=fp32",
        "train.device=cpu"]
LLAMA = BASE + ["model.n_kv_heads=2", "model.vocab_size=64"]
# GPT-2: learned positions, LayerNorm with bias, biases in every linear, GeLU MLP; a vocabulary
# that 2 ranks split unevenly (33 + 32 rows).
GPT2 = BASE + ["model.vocab_size=65", "model.positions=learned", "model.norm=layernorm", "model.bias=true",
               "model.activation=gelu"]
CHUNKED = ["train.loss=chunked"]
COMPILE_MODEL = ["train.compile=true", "train.compile_scope='model'"]
COMPILE_BACKEND = os.environ.get("KILN_TEST_COMPILE_BACKEND", "aot_eager")  # inductor: minutes per rank here
# name -> (model, schedule (None: no pp), virtual stages per rank, micro-batches (0: one per stage),
# cp[, dp_shard]); tp takes the rest of the 4 ranks. One 4-rank launch runs them all (a process
# start costs seconds on 2 cores).
CASES = {"llama_gpipe": (LLAMA, "gpipe", 1, 0, 1), "llama_interleaved_1f1b": (LLAMA, "interleaved_1f1b", 2, 0, 1),
         "gpt2_1f1b": (GPT2, "1f1b", 1, 2, 1),
         # a V: the first and the last stage (embedding and vocab-sharded head) on one rank
         "llama_zbv_zero_bubble": (LLAMA, "zbv_zero_bubble", 2, 0, 1),
         # context x pipeline: ring attention inside the stages, FSDP over cp averages the gradients
         "llama_cp_1f1b": (LLAMA, "1f1b", 1, 4, 2), "gpt2_cp_gpipe": (GPT2, "gpipe", 1, 0, 2),
         # zero-bubble (split input/weight backward) over FSDP-over-cp units
         "llama_cp_interleaved_zero_bubble": (LLAMA, "interleaved_zero_bubble", 2, 0, 2),
         "gpt2_cp_zbv_zero_bubble": (GPT2, "zbv_zero_bubble", 2, 0, 2),
         # train.loss = "chunked": the last stage's vocab-parallel chunked head + loss (its 33 + 32 rows)
         "gpt2_chunked_1f1b": (GPT2 + CHUNKED, "1f1b", 1, 2, 1),
         # compile_scope = "model": each stage chunk one graph (aot_eager, COMPILE_BACKEND), the
         # chunked loss inside it; under tp, and under FSDP over dp_shard 2 (the 6th entry: dp)
         "llama_chunked_compiled_1f1b": (LLAMA + CHUNKED + COMPILE_MODEL, "1f1b", 1, 2, 1),
         "llama_fsdp_chunked_compiled_1f1b": (LLAMA + CHUNKED + COMPILE_MODEL + ["train.batch_size=2"], "1f1b", 1,
                                              2, 1, 2),
         # no pp (schedule None): ddp x tp x cp on 4 ranks has dp 1, kiln's replicas average over cp
         "llama_ddp_cp_tp": (LLAMA + ["parallel.dp_mode='ddp'"], None, 1, 0, 2)}


def job(overrides, pp=1, tp=1, schedule="1f1b", virtual=1, microbatches=0, cp=1, dp=1):
    return load_config(None, overrides + [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.cp={cp}",
                                          f"parallel.dp_shard={dp}",
                                          f"parallel.pp_schedule={schedule!r}",
                                          f"parallel.pp_virtual_stages={virtual}",
                                          f"parallel.pp_microbatches={microbatches}"])


def batch():
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(tokens[:, :-1], tokens[:, 1:])]


def sgd_steps(step_fn, target, params, evaluate):
    """STEPS of kiln's step (clipping on) on one fixed batch: [loss, grad norm] per step, then the
    loss of `evaluate(tokens)` (the model's full logits, no gradient) after training."""
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    out = []
    for _ in range(STEPS):
        loss, norm, skipped = step_fn(target, opt, batch(), autocast=torch.autocast("cpu", enabled=False),
                                      scaler=None, clip=CLIP)
        assert not bool(skipped)
        out += [float(loss), float(norm)]
    x, y = batch()[0]
    with torch.no_grad():
        out.append(float(torch.nn.functional.cross_entropy(evaluate(x).flatten(0, 1), y.flatten())))
    return out


def single_process(overrides):
    from kiln.parallel.dims import ParallelDims
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    cfg = job(overrides)
    model = build_model(cfg, ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0),
                        torch.device("cpu"))
    return sgd_steps(train_step, model, model.parameters(), model)


def _tp_pp_worker(rank, world):
    import torch.distributed as dist

    from kiln import torch_compat
    from kiln.parallel import pipeline as pl
    from kiln.train.pipeline_step import pipeline_train_step
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.pipeline_layout import check_pipeline_config
    from kiln.train.step import train_step
    from kiln.train.system import resolve_loss
    from kiln.train.trainer import build_model

    torch.compile = functools.partial(torch.compile, backend=COMPILE_BACKEND)
    got = {}
    wrong = {"llama_swapped_shards": (LLAMA, "1f1b", 1, 4, 1), "gpt2_cp_positions_ignored": (GPT2, "1f1b", 1, 2, 2),
             "llama_cp_zero_bubble_resharded": (LLAMA, "interleaved_zero_bubble", 2, 0, 2)}
    for name, (overrides, schedule, virtual, micro, cp, *dp) in [*CASES.items(), *wrong.items()]:
        dp, pp = (dp or [1])[0], 2 if schedule else 1
        tp = 4 // (pp * cp * dp)
        cfg = job(overrides, pp=pp, tp=tp, schedule=schedule or "1f1b", virtual=virtual, microbatches=micro,
                  cp=cp, dp=dp)
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank, seq_len=SEQ)
        dims.check_model(cfg)
        check_pipeline_config(cfg)
        dims.build_mesh("cpu")
        assert dims.mesh.mesh_dim_names == tuple(n for n, size in [("pp", pp), ("dp_shard", dp), ("cp", cp), ("tp", tp)]
                                                 if size > 1)
        model = build_model(cfg, dims, torch.device("cpu"))
        model.loss_impl = resolve_loss(cfg.train.loss, torch.device("cpu"), tp=dims.tp)  # as the trainer resolves it
        if pp == 1:  # ddp x tp x cp: kiln's replicas (data_parallel.OverlappedReplicas) over the cp ranks
            assert (dims.dp_mode, dims.dp_size, dims.cp, dims.tp) == ("ddp", 1, 2, 2)
            step_fn = _context_parallel_step(ContextParallel(model, dims, SEQ, torch.device("cpu")), train_step)
            got[name] = sgd_steps(step_fn, model, model.parameters(), model)
            continue
        step_fn = pipeline_train_step
        if cp > 1:
            step_fn = _context_parallel_step(ContextParallel(model, dims, SEQ, torch.device("cpu")))
        if dp > 1:
            step_fn = _data_parallel_step(step_fn, dims.mesh["dp_shard"].get_group(), dp)
        if name == "gpt2_cp_positions_ignored":  # stages that take 0..len-1 for the zig-zag slice's positions
            for chunk in model.chunks:
                chunk.__dict__["_owner"] = SimpleNamespace(rope_cos=model.rope_cos, rope_sin=model.rope_sin,
                                                           seq_positions=None)
        if name == "llama_swapped_shards":
            # A wrong pp group (across the tp dimension): stage 1 of tp rank 0 receives tp rank 1's
            # half of the sequence and vice versa, as if pipelines were built on the wrong mesh dim.
            groups = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            wrong_pp = SimpleNamespace(get_group=lambda: groups[rank in (1, 2)])
            dims = SimpleNamespace(tp=dims.tp, dp_mode=dims.dp_mode, dp_size=dims.dp_size, cp=dims.cp, mesh={"pp": wrong_pp})
        pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
        if name == "llama_cp_zero_bubble_resharded":  # undo keep_gathered_until_backward
            for chunk in model.chunks:
                torch_compat.fsdp_set_reshard_after_forward(chunk, True, recurse=False)  # the roots resharded after forward
        # evaluation through the pipeline (the trainer's evaluator): full logits on every rank
        got[name] = sgd_steps(step_fn, pipe, model.parameters(), pl.PipelineEvalModel(pipe))
        got[f"{name} chunked"] = pipe.chunked_loss
        got[f"{name} compiled"] = all(chunk._compiled_call_impl is not None for chunk in model.chunks)
        torch._dynamo.reset()  # the next case compiles its own graphs (or none)
    return got


def _context_parallel_step(context_parallel, step_fn=None):
    """The trainer's cp step around the pipeline's (or, with `step_fn`, that one): this rank's
    zig-zag slice of every sequence, ring attention inside the stages; the loss averaged over the
    cp ranks (as the trainer's metrics fetch does), the grad norm is already global."""
    import torch.distributed as dist

    from kiln.train.pipeline_step import pipeline_train_step

    step_fn = step_fn or pipeline_train_step

    def step(pipe, opt, micro, **kwargs):
        micro = [context_parallel.shard(x, y) for x, y in micro]
        with context_parallel:
            loss, norm, skipped = step_fn(pipe, opt, micro, **kwargs)
        loss = loss.clone()
        dist.all_reduce(loss, group=context_parallel.ring.group)
        return loss / context_parallel.cp, norm, skipped

    return step


def _data_parallel_step(step_fn, group, dp):
    """The step on this dp rank's rows of the batch (FSDP over dp_shard); the loss averaged over
    the dp ranks as the trainer's metrics fetch does, the grad norm is already global."""
    import torch.distributed as dist

    def step(pipe, opt, micro, **kwargs):
        rank = dist.get_rank(group)
        micro = [(x.chunk(dp)[rank], y.chunk(dp)[rank]) for x, y in micro]
        loss, norm, skipped = step_fn(pipe, opt, micro, **kwargs)
        loss = loss.clone()
        dist.all_reduce(loss, group=group)
        return loss / dp, norm, skipped

    return step


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    # ~55 s on an idle 2-core machine (the compiled tp case ~20 s of it), ~110 s seen at load 25
    results = run_ranks(_tp_pp_worker, 4, tmp_path_factory.mktemp("tppp"), timeout=400)
    for r in results[1:]:  # the loss comes from the last stage to every rank; the norm is global
        assert r == results[0]
    return results[0]


@pytest.fixture(scope="module")
def reference():
    return {"llama": single_process(LLAMA), "gpt2": single_process(GPT2)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_pp2_x_tp2_or_cp2_matches_one_process(four_ranks, reference, name):
    # (loss, grad norm) per step, then the evaluation loss of the trained model
    expected = reference[name.split("_")[0]]
    assert four_ranks[name] == pytest.approx(expected, rel=REL), (four_ranks[name], expected)
    assert expected[-3] < expected[0] and expected[1] > CLIP  # it trains, and clipping is exercised
    if CASES[name][1]:  # the loss the pipeline ran is train.loss's, never the full one in its place
        assert four_ranks[f"{name} chunked"] == ("train.loss=chunked" in CASES[name][0])
        assert four_ranks[f"{name} compiled"] == ("train.compile=true" in CASES[name][0])  # each stage chunk whole


def test_sequence_shards_sent_to_the_wrong_tp_rank_change_the_losses(four_ranks, reference):
    expected, got = reference["llama"], four_ranks["llama_swapped_shards"]
    assert got[0] != pytest.approx(expected[0], rel=REL)
    assert got[2::2] != pytest.approx(expected[2::2], rel=REL)


def test_cp_stages_ignoring_the_slice_positions_change_the_losses(four_ranks, reference):
    # learned position embeddings of the wrong positions (the Llama-style model's RoPE would only
    # see it through relative distances, which barely matter at init)
    expected, got = reference["gpt2"], four_ranks["gpt2_cp_positions_ignored"]
    assert got[0] != pytest.approx(expected[0], rel=REL)
    assert got[2::2] != pytest.approx(expected[2::2], rel=REL)


def test_zero_bubble_over_fsdp_units_resharded_after_forward_changes_the_gradients(four_ranks, reference):
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_reshard_after_forward"):  # 2.7: the control cannot be built
        pytest.skip(f"torch {torch.__version__}: FSDP2's lazy init keeps every root gathered after forward "
                    f"whatever was set before, so a root resharded after forward cannot be made")
    expected, got = reference["llama"], four_ranks["llama_cp_zero_bubble_resharded"]
    assert got[0] == pytest.approx(expected[0], rel=REL)  # same forward,
    assert got[1] != pytest.approx(expected[1], rel=REL)  # the last stage's norm and head lose their grads


def test_pp_layouts_with_cp_and_tp_pass_the_layout_checks():
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.pipeline_layout import check_pipeline_config

    for schedule in ("looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"):  # cp x pp: all schedules
        check_pipeline_config(job(LLAMA, pp=2, cp=2, schedule=schedule, virtual=2))

    # tp x pp, and all three (test_pipeline_tensor_context_parallel.py), pass the layout check
    for world, job_ok in ((4, job(LLAMA, pp=2, tp=2)), (8, job(LLAMA, pp=2, tp=2, cp=2))):
        ParallelDims.from_config(job_ok.parallel, world_size=world, rank=0, local_rank=0,
                                 seq_len=SEQ).check_model(job_ok)
