"""Pipeline parallelism with activation checkpointing, per-block compile and float8.

- AC under pp wraps the blocks the single process wraps, by global layer index (a rule on the
  stage-local index would checkpoint other layers: `test_ac_rule_is_on_the_global_layer_index`
  spells out the sets), and the stage chunks run the wrappers (fewer tensors saved for backward).
- 2 gloo ranks, pp=2: AC (every_k:3) on every schedule, per-block compile on 1F1B and
  interleaved 1F1B, `compile_scope='model'` (each stage chunk one graph) on 1F1B and interleaved
  1F1B, AC (full) + compile on GPipe and interleaved 1F1B: per-step losses and grad norms match one
  process with the same AC / compile over 5 steps. Compile with the zero-bubble schedules is
  refused in one line: torch's weight pass re-runs a compiled block's whole backward (pinned with
  torch's own split-backward functions in one process).
- float8 (torchao, `emulate=True` on CPU): a split model converts exactly the whole model's
  block linears under the same names, and the stage chunks run them.
- `kiln train` pp=2 + AC: the step-3 checkpoint continues in one process with the same losses.

Tolerance: fp32, relative 1e-5 per step (as test_pipeline_parallel.py: the micro-batch losses are
summed in another order). With compile, inductor's kernels are the same in both runs (one process
runs the same 4 micro-batches of 1 sequence as grad accumulation, so the block graphs have the
shapes of the pipeline's micro-batches); observed max 1.4e-7 over all cases and both ranks.
SGD with momentum, no clipping: a wrong gradient moves the next losses (the negative control of
this bound is test_pipeline_parallel.py's `test_tolerance_catches_unscaled_microbatch_gradients`);
AC and compile do not change the math, so the controls here are structural: which layers are
wrapped and compiled on each stage, and the saved activations.
"""

import dataclasses
import functools
import json

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from conftest import float8_import_error, tiny_overrides
from kiln.config import JobConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.model.transformer import Transformer
from kiln.parallel import pipeline as pl
from kiln.parallel import pipeline_layout as layout
from kiln.parallel.parallelize import apply_activation_checkpointing, apply_compile, convert_float8
from kiln.train.pipeline_step import pipeline_train_step
from ranks import run_ranks
from test_data_parallel import assert_same_losses, losses

STEPS, REL, MICRO = 5, 1e-5, 4
# (schedule, virtual stages per rank): every schedule kiln offers
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("interleaved_zero_bubble", 2),
             ("zbv_zero_bubble", 2)] + ([("dualpipev", 2)] if layout.schedule_available("dualpipev") else [])
# variant -> (train settings, schedules run). Compile is refused with the zero-bubble schedules
# (test_compile_with_zero_bubble_is_refused_naming_the_key); compiling costs seconds per variant
# whatever the schedule count, running a schedule well under one.
ALL = [s for s, _ in SCHEDULES]
VARIANTS = {"ac": ({"activation_checkpointing": "every_k:3"}, ALL),
            "compile": ({"compile": True}, ["1f1b", "interleaved_1f1b"]),
            # compile_scope='model': each stage chunk one graph (reference: the whole model one graph)
            "compile_model": ({"compile": True, "compile_scope": "model"}, ["1f1b", "interleaved_1f1b"]),
            "ac+compile": ({"activation_checkpointing": "full", "compile": True}, ["gpipe", "interleaved_1f1b"]),
            "op": ({"activation_checkpointing": "op"}, ["gpipe", "1f1b", "interleaved_1f1b"]),
            "op+compile": ({"activation_checkpointing": "op", "compile": True}, ["interleaved_1f1b"])}
CASES = [(v, s) for v, (_, schedules) in VARIANTS.items() for s in schedules]


def job(pp=2, virtual=1, schedule="1f1b", n_layers=4, **train) -> JobConfig:
    cfg = JobConfig()
    cfg.model = ModelConfig(dim=32, n_layers=n_layers, n_heads=2, vocab_size=61, max_seq_len=16,
                            tie_embeddings=False)
    cfg.train = dataclasses.replace(cfg.train, **{"batch_size": 4, "dtype": "fp32", "device": "cpu",
                                                  "compile_scope": "blocks", **train})
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                       pp_microbatches=MICRO if pp > 1 else 0)
    return cfg


def split(cfg, rank):
    with torch.device("meta"):
        full = Transformer(cfg.model)
    return pl.split_model(full, cfg, rank)


def wrapped(part) -> set[int]:
    """Global indices of the checkpointed layers of a split model, checking the chunks hold them too."""
    out = {int(k) for k, layer in part.layers.items() if isinstance(layer, CheckpointWrapper)}
    in_chunks = {id(layer) for chunk in part.chunks for layer in chunk.layers}
    assert in_chunks == {id(layer) for layer in part.layers.values()}  # the chunks run the wrappers
    return out


# ---------------------------------------------------------------- one process: structure


@pytest.mark.parametrize("mode,expected", [("full", set(range(6))), ("selective", {0, 2, 4}),
                                           ("every_k:4", {0, 4})])
def test_ac_rule_is_on_the_global_layer_index(mode, expected):
    # 6 layers over pp=2 (layers 0-2 | 3-5) and over interleaved 2x2 (0-1, 4 | 2, 5 ...): the union
    # of the ranks' checkpointed layers is the single process's set, whatever the split.
    one = Transformer(job(pp=1, n_layers=6).model)
    apply_activation_checkpointing(one, mode)
    assert {i for i, layer in enumerate(one.layers) if isinstance(layer, CheckpointWrapper)} == expected
    for schedule, virtual in (("1f1b", 1), ("interleaved_1f1b", 2)):
        cfg = job(schedule=schedule, virtual=virtual, n_layers=6)
        got = set()
        for rank in range(2):
            part = split(cfg, rank)
            apply_activation_checkpointing(part, mode)
            got |= wrapped(part)
        assert got == expected, (schedule, mode)
    # what a stage-local index would have given for selective on 1f1b: {0, 2} | {3, 5}
    assert expected != {0, 2, 3, 5}


def test_checkpointed_stage_saves_fewer_tensors_for_backward():
    cfg = job(n_layers=4)
    saved = {}
    for mode in ("none", "full"):
        part = split(cfg, 0)
        if mode != "none":
            apply_activation_checkpointing(part, mode)
        part.to_empty(device="cpu")
        part.init_weights(torch.Generator().manual_seed(0))
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            part.chunks[0](torch.randint(0, 61, (2, 16))).sum().backward()
        saved[mode] = sum(count)
    assert saved["full"] < saved["none"] / 2, saved  # the negative control: no AC saves every activation


def test_names_stay_those_of_the_single_process_model(tmp_path):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    # torch 2.6's get_model_state_dict needs a process group (later releases take none)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _names_stay_those_of_the_single_process_model(get_model_state_dict)
    finally:
        dist.destroy_process_group()


def _names_stay_those_of_the_single_process_model(get_model_state_dict):
    cfg = job()
    # materialized: torch 2.6's get_model_state_dict takes a meta model's state dict for empty
    plain = {k for rank in range(2) for k in get_model_state_dict(split(cfg, rank).to_empty(device="cpu")).keys()}
    both = set()
    for rank in range(2):
        part = split(cfg, rank).to_empty(device="cpu")
        apply_activation_checkpointing(part, "full")
        apply_compile(part, "blocks")
        assert all(type(layer).__name__ == "OptimizedModule" for chunk in part.chunks for layer in chunk.layers)
        both |= set(get_model_state_dict(part).keys())
    assert both == plain == set(Transformer(cfg.model).state_dict())


def test_cuda_graphs_with_pp_are_refused_naming_the_key():
    layout.check_pipeline_config(job(compile=True, compile_scope="model"))  # one graph per stage chunk: runs
    cfg = job(compile=True, cuda_graphs=True)
    cfg.train.compile_scope = "auto"
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=true with parallel\.pp > 1"):
        layout.check_pipeline_config(cfg)
    for train in ({"compile": True}, {"activation_checkpointing": "selective"}, {"float8": True}):
        layout.check_pipeline_config(job(**train))  # accepted now (float8 still needs a GPU: apply_float8)


@pytest.mark.parametrize("schedule", [s for s in pl.ZERO_BUBBLE if layout.schedule_available(s)])
def test_compile_with_zero_bubble_is_refused_naming_the_key(schedule):
    with pytest.raises(ConfigError, match=rf"train\.compile=true with parallel\.pp_schedule='{schedule}'"):
        layout.check_pipeline_config(job(schedule=schedule, virtual=2, compile=True))
    layout.check_pipeline_config(job(schedule=schedule, virtual=2, activation_checkpointing="full"))


def test_zero_bubble_weight_pass_reruns_a_compiled_block_backward():
    """Why compile is refused with the zero-bubble schedules, on torch's own split backward
    (pipelining/_backward.py): an eager block's weights hang off their own matmul nodes, so the
    weight pass computes only dW; a compiled block's only node is AOTAutograd's backward, which the
    input pass runs whole and the weight pass runs again (values right, no split, backward twice).
    If torch ever splits it (one run per pass), this fails and the refusal can be revisited."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from kiln.torch_compat import weight_pass_takes_python_functions

    if not weight_pass_takes_python_functions():  # 2.10, 2.11: AOTAutograd's node is one; before 2.10 not probed
        pytest.skip(f"torch {torch.__version__}: kiln/torch_compat.py finds (from 2.10) or takes (before 2.10) that the "
                    f"weight pass cannot differentiate a custom autograd node at all, so the refusal holds all the more")

    runs = []

    def counting(gm, example_inputs):  # AOTAutograd without codegen, counting compiled backward runs
        def backward(graph, _):
            return lambda *args: runs.append(1) or graph(*args)
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda graph, _: graph, bw_compiler=backward)

    torch._dynamo.reset()
    grads, nodes = {}, {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        run = torch.compile(block, backend=counting, fullgraph=True) if mode == "compiled" else block
        x = torch.randn(4, 8, requires_grad=True)
        out = run(x)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
        nodes[mode] = sorted(type(n).__name__ for g in groups for n in g["intermediates"])
        after_input = len(runs)
        stage_backward_weight(block.parameters(), groups)
        grads[mode] = [x.grad, *(p.grad for p in block.parameters())]
        if mode == "compiled":
            assert (after_input, len(runs)) == (1, 2), runs  # the weight pass ran the whole backward again
    assert nodes == {"eager": ["AddmmBackward0", "AddmmBackward0"], "compiled": ["CompiledFunctionBackward"]}
    assert all(torch.equal(a, b) for a, b in zip(grads["eager"], grads["compiled"]))


@pytest.mark.parametrize("schedule", [s for s in pl.ZERO_BUBBLE if layout.schedule_available(s)])
def test_op_checkpointing_with_zero_bubble_is_refused_naming_the_key(schedule):
    with pytest.raises(ConfigError, match=rf"train\.activation_checkpointing='op' with parallel\.pp_schedule="
                                          rf"'{schedule}'"):
        layout.check_pipeline_config(job(schedule=schedule, virtual=2, activation_checkpointing="op"))


def test_zero_bubble_weight_pass_cannot_reuse_a_selective_checkpoint():
    """Why "op" checkpointing is refused with the zero-bubble schedules, on torch's own split
    backward: the weight pass differentiates the checkpointed block a second time, and torch's
    selective checkpoint hands out its kept outputs once. If torch ever allows it, this fails and
    the refusal can be revisited."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from kiln.parallel.parallelize import keep_compute_op_outputs

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    wrapped = checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                     keep_compute_op_outputs))
    x = torch.randn(4, 8, requires_grad=True)
    out = wrapped(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
    assert x.grad is not None  # the input pass works
    # 2.13: "Trying to backward an extra time"; before: the second recompute gets other tensors
    with pytest.raises(RuntimeError, match="backward an extra time|different metadata"):
        stage_backward_weight(block.parameters(), groups)


def test_kiln_train_refuses_compile_with_zero_bubble_in_one_line(tmp_path, text_file, monkeypatch, capsys):
    from kiln.cli import main

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "zbv"
    args = ["train", "--run-dir", str(run), *[x for o in tiny_overrides(text_file, **{
        "parallel.pp": 2, "parallel.pp_schedule": "'zbv_zero_bubble'", "parallel.pp_virtual_stages": 2,
        "model.n_layers": 4, "model.tie_embeddings": "false", "train.compile": "true"}) for x in ("--set", o)]]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "train.compile=true with parallel.pp_schedule='zbv_zero_bubble'" in lines[0], lines
    assert not run.exists()  # before any work


def test_float8_converts_the_same_linears_on_the_stages():
    if (why := float8_import_error()) is not None:
        pytest.skip(why)
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    cfg = job(pp=1)
    cfg.model.dim = 64  # multiples of 16 (the float8 GEMM limit): every block linear is eligible
    one = Transformer(cfg.model)
    convert_float8(one, Float8LinearConfig(emulate=True))
    expected = {n for n, m in one.named_modules() if isinstance(m, Float8Linear)}
    assert expected and all(n.startswith("layers.") for n in expected)
    for schedule, virtual in (("1f1b", 1), ("zbv_zero_bubble", 2)):
        got = set()
        for rank in range(2):
            pcfg = job(schedule=schedule, virtual=virtual)
            pcfg.model.dim = 64
            part = split(pcfg, rank)
            convert_float8(part, Float8LinearConfig(emulate=True))
            got |= {n for n, m in part.named_modules() if isinstance(m, Float8Linear)}
            in_chunks = sum(isinstance(m, Float8Linear) for c in part.chunks for m in c.modules())
            assert in_chunks == sum(isinstance(m, Float8Linear) for m in part.modules())  # the chunks run them
            assert not isinstance(getattr(part, "output", None), Float8Linear)  # the head stays as it was
        assert got == expected, schedule


# ---------------------------------------------------------------- 2 gloo ranks: steps vs one process


def _steps(rank, world):
    import torch.distributed as dist

    from kiln.parallel.dims import ParallelDims
    from kiln.train.step import train_step
    from kiln.train.trainer import build_model

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 61, (4, 17), generator=gen) for _ in range(STEPS)]
    # one process: the 4 sequences as 4 micro-batches of 1 (grad accumulation), the pipeline's shapes
    singles = [[(b[i:i + 1, :-1], b[i:i + 1, 1:]) for i in range(4)] for b in batches]
    whole = [[(b[:, :-1], b[:, 1:])] for b in batches]
    off = torch.autocast("cpu", enabled=False)

    def run(step_fn, target, params, data):
        opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        return [tuple(float(t.detach()) for t in step_fn(target, opt, micro, autocast=off, scaler=None, clip=0.0)[:2])
                for micro in data]

    got = {}
    for variant, (train, schedules) in VARIANTS.items():
        torch._dynamo.reset()
        cfg = job(pp=1, **train)
        dims1 = ParallelDims.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0)
        model = build_model(cfg, dims1, torch.device("cpu"))
        got[(variant, "reference")] = run(train_step, model, model.parameters(), singles)
        for schedule, virtual in SCHEDULES:
            if schedule not in schedules:
                continue
            cfg = job(schedule=schedule, virtual=virtual, **train)
            dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank)
            dims.build_mesh("cpu")
            model = build_model(cfg, dims, torch.device("cpu"))
            pipe = pl.Pipeline(model, cfg, dims, torch.device("cpu"))
            got[(variant, schedule, "wrappers")] = [
                sum(isinstance(m, CheckpointWrapper) for m in c.modules()) for c in model.chunks]
            got[(variant, schedule, "compiled")] = [
                sum(type(m).__name__ == "OptimizedModule" for m in c.layers) for c in model.chunks]
            got[(variant, schedule, "chunk compiled")] = [c._compiled_call_impl is not None for c in model.chunks]
            got[(variant, schedule)] = run(pipeline_train_step, pipe, model.parameters(), whole)
            dist.barrier()
    return got


def _session(rank, world, jobs):
    """Both 2-rank parts in one pair of processes (torch is imported once): kiln's trainer
    (test_cross_layout.py's train_jobs), then the step comparisons."""
    from test_cross_layout import train_jobs

    train_jobs(rank, world, jobs)
    return _steps(rank, world)


def trainer_overrides(text_file, shards, **extra):
    return tiny_overrides(text_file, **{
        "train.steps": 6, "train.eval_every": 0, "checkpoint.every": 3, "checkpoint.keep_last": 5,
        "optim.name": "'adamw'", "optim.lr": 0.01, "train.clip_grad_norm": 0, "train.device": "cpu",
        "model.n_layers": 4, "model.tie_embeddings": "false", "train.batch_size": 2, "train.grad_accum": 2,
        "train.activation_checkpointing": "'selective'", "metrics.peak_flops": 1e11,
        "data.shards_dir": repr(str(shards)), **extra})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, text_file):
    """The step comparisons per rank, and kiln's trainer: a one-process reference of 6 steps with
    selective AC (here), pp=2 1F1B with selective AC saving at step 3 (2 gloo ranks)."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("ppac")
    train(load_config(None, trainer_overrides(text_file, root / "shards")), root / "single")  # writes the shards
    pp2 = trainer_overrides(text_file, root / "shards", **{"parallel.pp": 2, "parallel.pp_schedule": "'1f1b'"})
    results = run_ranks(_session, 2, root, [(None, root / "pp2", pp2, 3)], timeout=400)
    return {"ranks": results, "root": root}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("variant,schedule", CASES)
def test_pipeline_with_ac_or_compile_matches_one_process(two_ranks, variant, schedule):
    ref = two_ranks["ranks"][0][(variant, "reference")]
    for rank in range(2):
        got = two_ranks["ranks"][rank][(variant, schedule)]
        for step, ((loss, norm), (rl, rn)) in enumerate(zip(got, ref)):
            assert loss == pytest.approx(rl, rel=REL), f"rank {rank} step {step + 1}"
            assert norm == pytest.approx(rn, rel=REL), f"rank {rank} step {step + 1} grad norm"


def test_ac_and_compile_are_applied_on_every_stage(two_ranks):
    # every_k:3 on 4 layers: layers 0 and 3; 1f1b stages 0-1 | 2-3, interleaved 0 | 1 | 2 | 3 (v=2)
    assert [two_ranks["ranks"][r][("ac", "1f1b", "wrappers")] for r in range(2)] == [[1], [1]]
    assert [two_ranks["ranks"][r][("ac", "interleaved_1f1b", "wrappers")] for r in range(2)] == [[1, 0], [0, 1]]
    assert [two_ranks["ranks"][r][("ac", "zbv_zero_bubble", "wrappers")] for r in range(2)] == [[1, 1], [0, 0]]
    assert [two_ranks["ranks"][r][("ac+compile", "gpipe", "wrappers")] for r in range(2)] == [[2], [2]]
    assert [two_ranks["ranks"][r][("compile", "1f1b", "wrappers")] for r in range(2)] == [[0], [0]]  # control
    # per-block compile: every block of every stage chunk (the blocks of the AC variant: none)
    assert [two_ranks["ranks"][r][("compile", "interleaved_1f1b", "compiled")] for r in range(2)] == [[1, 1], [1, 1]]
    assert [two_ranks["ranks"][r][("ac+compile", "gpipe", "compiled")] for r in range(2)] == [[2], [2]]
    assert [two_ranks["ranks"][r][("ac", "gpipe", "compiled")] for r in range(2)] == [[0], [0]]
    # compile_scope='model': every stage chunk is one graph, its blocks are not compiled apart
    for schedule, chunks in (("1f1b", 1), ("interleaved_1f1b", 2)):
        assert [two_ranks["ranks"][r][("compile_model", schedule, "chunk compiled")] for r in range(2)] == [
            [True] * chunks] * 2
        assert [two_ranks["ranks"][r][("compile_model", schedule, "compiled")] for r in range(2)] == [[0] * chunks] * 2
        assert [two_ranks["ranks"][r][("compile", schedule, "chunk compiled")] for r in range(2)] == [
            [False] * chunks] * 2  # control: per-block compile leaves the chunk eager


# ---------------------------------------------------------------- kiln's trainer: pp=2 + AC -> one process


def test_trainer_pp2_with_ac_checkpoint_continues_in_one_process(two_ranks, text_file):
    # The cross-layout harness's jobs (test_cross_layout.py): pp=2 + selective AC matches the
    # one-process run for steps 1-3, and its step-3 checkpoint continues in one process (AC on,
    # so the checkpoint names must be those of the plain model) with the same losses for 4-6.
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = two_ranks["root"]
    single, piped = root / "single", root / "pp2"
    run_row = next(json.loads(x) for x in (piped / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert run_row["pp"] == 2 and run_row["world_size"] == 2
    expected = losses(single)
    assert_same_losses(expected, losses(piped), range(1, 4))
    train(load_config(None, trainer_overrides(text_file, root / "shards")), piped, resume=True)
    assert_same_losses(expected, losses(piped), range(4, 7))
