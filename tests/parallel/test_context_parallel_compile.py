"""`train.compile=true` with context parallel: each compiled block calls ring attention as an
opaque op (torch.library custom ops, kiln/parallel/ring_attention.py) and trains like one process.

Training: `kiln train`'s trainer in-process on gloo ranks (tests/parallel/ranks.py), blocks
compiled (fullgraph), cp=2 under DDP (2 ranks; ring attention, and Ulysses' all-to-alls, which
dynamo traces into the block's graph), and in one 4-rank launch FSDP dp_shard=2 x cp=2,
tp=2 x cp=2 and pp=2 x cp=2 (1F1B, one block per stage), against ONE
EAGER process on the same global batch (conftest's dp_reference: test_data_parallel's settings,
SGD, no clipping, 6 steps); fp32, relative 1e-5 per step (the data-parallel tests' bound).

Ops: both ring ops pass `torch.library.opcheck` (schema, fake against real outputs, autograd
registration, AOTAutograd). Attention: ring attention compiled (fullgraph) on 2 ranks equals the
matching rows of full causal SDPA, forward and dQ/dK/dV, MHA and GQA (cp_ring_worker's check,
fp32 atol 1e-5). Negative control: the same compiled check with a ring merge that forgets the
earlier partial sums fails. The control is at the attention level because this tiny model's
loss barely feels attention at initialization (that merge moves the first loss by ~2e-6
relative in one process, below the training bound).

The wrong merge is the control for the tp and pp layouts too: under tp each rank's ring runs on its
own heads, and under pp each stage's cp pair is its ring; the same ring op as the 2-rank check.

Recompiles: a step loop over kiln's `parallelize` and `ContextParallel`, each step followed by
an evaluation outside `with cp:` (whole sequences, SDPA: kiln's scorer), compiles its graphs in
the first step; from the second on, dynamo's `error_on_recompile` stays silent and the graph count
is constant. The same loop with `error_on_recompile` from the first step fails at the evaluation's
one recompile (no_grad, eval mode, SDPA on whole sequences), so the detector is live. Ulysses'
loop (cp_mode 'ulysses') holds its graph count constant from the second step too.

Backend: `aot_eager` (dynamo + AOTAutograd, which run the ops' fake implementations and their
registered backward, without inductor's codegen: slow on the shared 2-core machine);
`KILN_TEST_COMPILE_BACKEND=inductor` runs the same file with inductor (by hand, see docs/parallel.md).
"""

import functools
import json
import math
import os

import pytest

from kiln import torch_compat
from kiln.config import load_config
from ranks import run_ranks
from cp_ring_worker import ATOL
from test_data_parallel import GLOBAL_BATCH, REL, STEPS, common, losses

if not torch_compat.dynamo_traces_ring_objects():  # kiln refuses compile with cp there (test_dims.py)
    pytest.skip("this torch's dynamo cannot compile ring attention", allow_module_level=True)

BACKEND = os.environ.get("KILN_TEST_COMPILE_BACKEND", "aot_eager")
LAUNCH_TIMEOUT = 300 if BACKEND == "aot_eager" else 1800  # seconds per launch of 2 or 4 ranks
CP2 = {"parallel.cp": 2, "parallel.dp_mode": "'ddp'", "train.batch_size": GLOBAL_BATCH, "train.compile": "true"}
FSDP2_CP2 = {"parallel.cp": 2, "parallel.dp_mode": "'fsdp'", "train.batch_size": GLOBAL_BATCH // 2,
             "train.compile": "true"}
# No data parallelism: the 4 ranks are tp 2 x cp 2 (each cp rank's zig-zag half split over tp
# between blocks) or pp 2 x cp 2 (1F1B, one block per stage, each stage's cp pair its ring).
TP2_CP2 = {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_mode": "'fsdp'", "train.batch_size": GLOBAL_BATCH,
           "train.compile": "true"}
PP2_CP2 = {"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "'1f1b'", "parallel.dp_mode": "'fsdp'",
           "train.batch_size": GLOBAL_BATCH, "train.compile": "true"}
LAUNCHES = {  # world -> runs of that launch (name -> settings)
    2: {"cp2_compiled": CP2, "cp2_ulysses_compiled": {**CP2, "parallel.cp_mode": "'ulysses'"}},
    4: {"fsdp2_cp2_compiled": FSDP2_CP2, "tp2_cp2_compiled": TP2_CP2, "pp2_cp2_compiled": PP2_CP2},
}


def _merge_forgetting_earlier_blocks(out, lse, block_out, block_lse):
    """A wrong ring merge: the output keeps only the newest block (the log-sum-exp is right)."""
    import torch

    return block_out, torch.logaddexp(lse, block_lse)


def _train(rank, world, runs, recompile_job=None):
    """Each (name, cfg, run_dir) of `runs` through kiln's trainer on this rank, blocks compiled with
    BACKEND. With `recompile_job`, then the ops' opcheck, the compiled attention check
    (`_compiled_ring_errors`) and the step loop of `_graphs_per_step`, strict from 1 and from 0."""
    import torch

    from kiln.train.trainer import train

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.compile = functools.partial(torch.compile, backend=BACKEND)
    for name, cfg, run_dir in runs:
        try:
            train(cfg, run_dir)
        finally:
            torch._dynamo.reset()
    if recompile_job is None:
        return None
    checks = {"opcheck": _opcheck_ring_ops(), "attention": _compiled_ring_errors(rank, world),
              "dropout_calls_differ": _compiled_dropout_draws_afresh(world),
              "graphs": {strict: _graphs_per_step(rank, world, recompile_job, strict) for strict in (1, 0)}}
    recompile_job.parallel.cp_mode = "ulysses"  # its all-to-alls traced into the blocks' graphs
    checks["graphs_ulysses"] = _graphs_per_step(rank, world, recompile_job, 1)
    return checks


def _compiled_dropout_draws_afresh(world):
    """Whether two calls of the compiled ring with attention dropout drop differently: the seed is
    drawn inside the graph, not traced as a constant."""
    import torch
    import torch.distributed as dist

    from kiln.parallel.ring_attention import Ring, ring_attention

    ring = Ring(dist.group.WORLD)
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 2, 8 * world, 4, generator=g) for _ in range(3))
    attend = torch.compile(lambda q, k, v: ring_attention(q, k, v, ring, 0.5), fullgraph=True)
    try:
        return not torch.equal(attend(q, k, v), attend(q, k, v))
    finally:
        torch._dynamo.reset()


def _opcheck_ring_ops():
    """torch.library.opcheck of both ring ops (schema, fake implementation against the real one
    (shapes, strides, dtypes), autograd registration, AOTAutograd dynamic), q as the model hands
    it (a transposed view). Every rank runs the same checks in the same order, so the ring's
    point-to-point calls pair up."""
    import torch
    import torch.distributed as dist

    from kiln.parallel import ring_attention

    group = ring_attention.Ring(dist.group.WORLD).group_name
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(2, 16, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, 16, 8, generator=g).requires_grad_() for _ in range(2))
    # attention dropout on (its masks are a function of the seed) and a sliding window of 6 over the
    # 4-token chunks: partial and skipped blocks
    dropout = (0.25, torch.tensor([7]), 6)
    forward = torch.library.opcheck(ring_attention._ring_attention_op, (q, k, v, group, *dropout))
    out, lse = ring_attention._ring_attention_op(q.detach(), k.detach(), v.detach(), group, *dropout)
    backward = torch.library.opcheck(ring_attention._ring_attention_backward_op,
                                     (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, group,
                                      *dropout))
    return {"forward": forward, "backward": backward}


def _compiled_ring_errors(rank, world):
    """{(merge, n_heads, n_kv): max |error| of out, dq, dk, dv} of compiled ring attention against
    full causal SDPA (cp_ring_worker.full_and_ring with its ring_attention compiled, fullgraph),
    with kiln's merge ("right") and `_merge_forgetting_earlier_blocks` ("wrong"): one compiled
    function for both, as the opaque op runs whatever merge the module holds when it is called."""
    import torch
    import torch.distributed as dist

    import cp_ring_worker
    from kiln.parallel import ring_blocks
    from kiln.parallel.context_parallel import zigzag_positions
    from kiln.parallel.ring_attention import Ring, ring_attention

    ring = Ring(dist.group.WORLD)
    index = zigzag_positions(8 * world, world, rank)
    merge, eager = ring_blocks.merge_block, cp_ring_worker.ring_attention
    cp_ring_worker.ring_attention = torch.compile(ring_attention, fullgraph=True)
    errors = {}
    try:
        for n_heads, n_kv in ((4, 4), (4, 2)):
            for name, fn in (("right", merge), ("wrong", _merge_forgetting_earlier_blocks)):
                ring_blocks.merge_block = fn
                ref, ref_grads, out, grads, _ = cp_ring_worker.full_and_ring(ring, n_heads, n_kv, 8 * world, index)
                errors[name, n_heads, n_kv] = [float((a - b).detach().abs().max())
                                               for a, b in zip([out, *grads], [ref, *ref_grads])]
    finally:
        ring_blocks.merge_block, cp_ring_worker.ring_attention = merge, eager
        torch._dynamo.reset()
    return errors


def _graphs_per_step(rank, world, cfg, strict_from):
    """Dynamo's graph count after each training step (+ evaluation) of a cp=2 model with compiled
    blocks, `error_on_recompile` set from step `strict_from`; the RecompileError's text if raised."""
    import torch
    from torch._dynamo.utils import counters

    from kiln.eval.scoring import score_batches
    from kiln.model.transformer import Transformer
    from kiln.parallel.context_parallel import ContextParallel
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import parallelize

    torch._dynamo.reset()
    counters.clear()
    cfg.model.vocab_size = 256  # the trainer sets it from the tokenizer; here no tokenizer
    cpu = torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world, seq_len=cfg.data.seq_len)
    dims.build_mesh("cpu")
    model = Transformer(cfg.model)
    model.init_weights(torch.Generator().manual_seed(0))
    model = parallelize(model, dims, cfg, cpu)
    cp = ContextParallel(model, dims, cfg.data.seq_len, cpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    graphs = []
    for step in range(STEPS):
        try:
            with torch._dynamo.config.patch(error_on_recompile=step >= strict_from):
                with cp:
                    model(*cp.shard(x, y)).backward()
                optimizer.step()
                optimizer.zero_grad()
                score_batches(model, [(x, y)], torch.ones(cfg.model.vocab_size), context=cp)  # as the trainer: the ring
        except torch._dynamo.exc.RecompileError as e:
            return str(e)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    """name -> per-step losses of each run of LAUNCHES (the 2-rank launch also runs the attention
    check and the recompile loops: "checks", per rank)."""
    tmp = tmp_path_factory.mktemp("cp_compile")
    out = {}
    for world, layouts in LAUNCHES.items():
        specs = [(name, load_config(None, common(text_file, **extra)), tmp / name) for name, extra in layouts.items()]
        recompile_job = load_config(None, common(text_file, **CP2)) if world == 2 else None
        if world == 2:  # attention dropout in the compiled ring (random: not one process's losses)
            specs.append(("cp2_compiled_dropout", load_config(None, common(text_file, **CP2, **{"model.dropout": 0.1})),
                          tmp / "cp2_compiled_dropout"))
        (tmp / f"world{world}").mkdir()
        result = run_ranks(_train, world, tmp / f"world{world}", specs, recompile_job,
                           timeout=LAUNCH_TIMEOUT * len(specs))
        if world == 2:
            out["checks"] = result
        for name, extra in layouts.items():
            run_row = next(r for r in _rows(tmp / name) if r["kind"] == "run")
            assert run_row["compile"] == "blocks" and run_row["cp"] == 2 and run_row["world_size"] == world
            assert (run_row["tp"], run_row["pp"]) == (extra.get("parallel.tp", 1), extra.get("parallel.pp", 1))
            out[name] = losses(tmp / name)
        if world == 2:
            out["cp2_compiled_dropout"] = losses(tmp / "cp2_compiled_dropout")
    return out


@pytest.mark.timeout(5 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("name", [name for layouts in LAUNCHES.values() for name in layouts])
def test_compiled_blocks_with_context_parallel_match_one_eager_process(runs, dp_reference, name):
    got = runs[name]
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(dp_reference[step], rel=REL), f"step {step}: {got[step]}"


@pytest.mark.timeout(5 * LAUNCH_TIMEOUT)
def test_compiled_ring_trains_with_attention_dropout(runs):
    # The seed is drawn in the graph each call (two calls of the compiled ring drop differently),
    # and the trainer's run differs from the one without dropout, the first step within 5%.
    assert all(checks["dropout_calls_differ"] for checks in runs["checks"])
    plain, dropped = runs["cp2_compiled"], runs["cp2_compiled_dropout"]
    assert sorted(dropped) == sorted(plain) == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in dropped.values())
    assert dropped[1] == pytest.approx(plain[1], rel=0.05)
    assert all(dropped[s] != plain[s] for s in plain), (dropped, plain)


@pytest.mark.timeout(5 * LAUNCH_TIMEOUT)
def test_ring_ops_pass_torch_library_opcheck(runs):
    for rank, checks in enumerate(runs["checks"]):
        for op, results in checks["opcheck"].items():
            assert results and set(results.values()) == {"SUCCESS"}, f"rank {rank} {op}: {results}"


@pytest.mark.timeout(5 * LAUNCH_TIMEOUT)
def test_compiled_ring_attention_matches_full_attention_and_a_wrong_merge_does_not(runs):
    for rank, checks in enumerate(runs["checks"]):
        errors = checks["attention"]
        for heads in ((4, 4), (4, 2)):  # MHA, GQA
            assert max(errors["right", *heads]) < ATOL, f"rank {rank} {heads}: out/dq/dk/dv {errors['right', *heads]}"
        # Each rank's second chunk attends earlier blocks: forgetting them is caught on every rank.
        assert all(errors["wrong", *heads][0] > 100 * ATOL for heads in ((4, 4), (4, 2))), errors


@pytest.mark.timeout(5 * LAUNCH_TIMEOUT)
def test_compiled_blocks_do_not_recompile_across_cp_steps_and_evaluations(runs):
    for rank, checks in enumerate(runs["checks"]):
        steady, strict = checks["graphs"][1], checks["graphs"][0]
        assert isinstance(steady, list) and len(steady) == STEPS, f"rank {rank}: {steady}"
        assert steady[0] >= 1 and len(set(steady)) == 1, f"rank {rank}: graphs per step {steady}"
        ulysses = checks["graphs_ulysses"]
        assert isinstance(ulysses, list) and ulysses[0] >= 1 and ulysses == [ulysses[0]] * STEPS, ulysses
        # Control: from step 0, the first evaluation (no_grad, SDPA instead of the ring) is a recompile.
        assert isinstance(strict, str) and "Recompiling function" in strict, f"rank {rank}: {strict}"
