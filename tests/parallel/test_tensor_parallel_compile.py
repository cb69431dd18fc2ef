"""`train.compile=true` under tensor parallel: compiled blocks over TP DTensors train like one
compiled process, with and without FSDP around them (`kiln train`'s trainer in-process on gloo
ranks: loader, metrics, evaluation). Negative control: the same runs without the block's
input-waiting hook (`wait_collective_inputs`) do not match. The torch bug the hook works around is
pinned by a plain-torch repro marked xfail(strict): a torch that fixes it turns this file red, and
the hook (kiln/parallel/parallelize.py) can go.

Backend: the compiled runs here use `aot_eager` (AOTAutograd, where the bug is, without inductor's
codegen), because inductor takes ~2 minutes per rank to compile on a shared 2-core machine; the
same runs with inductor were checked by hand (docs/parallel.md, "Compile under tensor parallel").

Tolerance: fp32, relative 1e-5 per step (TP reorders the row-wise reductions and the sharded
softmax). SGD with clipping active, tied embeddings: an embedding that misses its gradient shows
in the first step's gradient norm.
"""

import functools
import json
import os

import pytest

from kiln.config import load_config
from conftest import tiny_overrides
from ranks import run_ranks

REL = 1e-5
STEPS = 5

# Llama-style (RoPE, RMSNorm, SwiGLU, GQA 4/2 heads, tied embeddings): its first block's input is
# the embedding's reduce-scattered output as it comes (GPT-2 adds positions first, which waits).
DENSE = {"model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "data.seq_len": 16,
         "train.grad_accum": 1, "train.steps": STEPS, "train.eval_every": STEPS, "train.eval_batches": 1,
         "checkpoint.every": 0, "optim.name": "sgd", "optim.lr": 0.1, "train.clip_grad_norm": 1.0,
         "train.device": "cpu", "schedule.warmup_steps": 0,
         "metrics.peak_flops": 1e12}  # a given peak: no matmul probe per run (seconds on a loaded core)
GLOBAL_BATCH = 4


def job(text_file, **extra):
    return load_config(None, tiny_overrides(text_file, **{**DENSE, **extra}))


def _train(rank, world, runs, without_wait=()):
    """Each (name, cfg, run_dir) in `runs` through kiln's trainer on this rank, blocks compiled
    with aot_eager; the runs named in `without_wait` with the input-waiting hook disabled."""
    import torch

    from kiln.parallel import parallelize
    from kiln.train.trainer import train

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    hook = parallelize.wait_collective_inputs
    errors = {}
    for name, cfg, run_dir in runs:
        parallelize.wait_collective_inputs = (lambda module, args: args) if name in without_wait else hook
        try:
            train(cfg, run_dir)
        except AttributeError as e:  # torch 2.13 without the hook: the embedding's backward fails
            errors[name] = str(e)
        finally:
            parallelize.wait_collective_inputs = hook
            torch._dynamo.reset()
    return errors


def rows(run_dir):
    """[loss, grad norm] per training step, flat, and the evaluation losses."""
    got = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for r in got if r["kind"] == "train" for x in (r["loss"], r["grad_norm"])]
    return train, [r["val_loss"] for r in got if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    """name -> rows(run) for: one compiled process, tp=2 compiled / eager / compiled without the
    hook (2 ranks), and FSDP 2 x tp 2 compiled / without the hook (4 ranks); one launch per size."""
    tmp = tmp_path_factory.mktemp("tp_compile")
    one = {"train.batch_size": GLOBAL_BATCH, "train.compile": "true"}
    tp2 = {**one, "parallel.tp": 2}
    fsdp_tp = {**tp2, "train.batch_size": GLOBAL_BATCH // 2}  # per data-parallel rank
    launches = {1: {"single_compiled": one},
                2: {"tp2_compiled": tp2, "tp2_eager": {**tp2, "train.compile": "false"}, "tp2_without_wait": tp2},
                4: {"fsdp2_tp2_compiled": fsdp_tp, "fsdp2_tp2_without_wait": fsdp_tp}}
    out, errors = {}, {}
    for world, cases in launches.items():
        specs = [(name, job(text_file, **extra), tmp / name / "run") for name, extra in cases.items()]
        for name, _, _ in specs:
            (tmp / name).mkdir()
        without = tuple(n for n in cases if n.endswith("without_wait"))
        (tmp / f"world{world}").mkdir()
        errors.update(run_ranks(_train, world, tmp / f"world{world}", specs, without, timeout=300)[0])
        out.update({name: rows(tmp / name / "run") for name in cases if name not in errors})
    out["errors"] = errors
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp2_compiled", "tp2_eager"])
def test_tp2_compiled_blocks_match_one_compiled_process(runs, name):
    expected, got = runs["single_compiled"], runs[name]
    assert len(got[0]) == 2 * STEPS
    assert got[0] == pytest.approx(expected[0], rel=REL)  # losses and grad norms, step by step
    assert got[1] == pytest.approx(expected[1], rel=REL)  # val_loss (the same eval batch)


@pytest.mark.timeout(600)
def test_fsdp2_x_tp2_compiled_blocks_match_one_compiled_process(runs):
    expected, got = runs["single_compiled"], runs["fsdp2_tp2_compiled"]
    assert len(got[0]) == 2 * STEPS
    # Training only: evaluation reads train.batch_size sequences per data-parallel rank.
    assert got[0] == pytest.approx(expected[0], rel=REL)


@pytest.mark.timeout(600)
def test_without_the_input_wait_compiled_tp_fails_or_trains_wrongly(runs):
    # torch 2.13: tp alone fails in the embedding's backward; under FSDP it runs, but the
    # embedding gets no gradient (the first step's grad norm is already smaller).
    errors, expected = runs["errors"], runs["single_compiled"]
    assert "tp2_without_wait" in errors and "_local_tensor" in errors["tp2_without_wait"]
    got = runs["fsdp2_tp2_without_wait"][0]
    assert got[0] == pytest.approx(expected[0][0], rel=REL)  # the forward is right...
    assert got[1] < expected[0][1] * (1 - 1e-3)  # ...the gradient is not


def _act_into_compiled_region(rank, world):
    """Plain torch: the tensor-parallel embedding's output (`to_local()` of its reduce-scatter, an
    AsyncCollectiveTensor) fed to a compiled function; the embedding's gradient, eager vs aot_eager."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    grads = []
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        emb = parallelize_module(nn.Embedding(8, 4), mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Shard(1)))
        h = emb(torch.arange(8).view(2, 4))
        out = torch.compile(lambda x: x * 2 + x.sin(), backend=backend, fullgraph=True)(h)
        try:
            out.sum().backward()
        except RuntimeError as e:  # "element 0 of tensors does not require grad": the edge is gone
            return type(h).__name__, str(e)
        grads.append(emb.weight.grad.to_local().clone())
    return type(h).__name__, bool(torch.allclose(grads[0], grads[1], rtol=1e-6, atol=0))


@pytest.mark.xfail(strict=True, reason="torch 2.13.0 (CPU): AOTAutograd unwraps an AsyncCollectiveTensor input "
                   "with trigger_wait() and drops its requires_grad (pytorch/pytorch#179849; fix proposed in "
                   "#191113); when this passes, wait_collective_inputs in kiln/parallel/parallelize.py can go")
@pytest.mark.timeout(300)
def test_torch_keeps_the_gradient_of_an_in_flight_collective_entering_a_compiled_region(tmp_path):
    kind, result = run_ranks(_act_into_compiled_region, 2, tmp_path)[0]
    # Passes (so fails strict) once torch keeps the gradient, or once to_local() no longer hands
    # on an in-flight collective: either way the hook is no longer needed.
    assert kind != "AsyncCollectiveTensor" or result is True, result
