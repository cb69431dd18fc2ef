"""Tensor + sequence + loss parallel gives the per-step losses of one process, for the Llama-style
and the GPT-2 architecture and a mixture-of-experts model (expert tensor parallel, with its
load-balancing and z-losses), with the loss on the whole vocab-sharded logits or chunked
(train.loss='chunked', kiln/model/loss.py's vocab-parallel chunks); a wrong plan or a log-sum-exp
not combined over the ranks does not; bad layouts fail before any work; a TP=2 checkpoint
continues in one process with the same losses; fsdp dp_shard 2 x tp 2 through `kiln train` with a
tied vocabulary FSDP shards unevenly gives one process's losses.

Tolerance: fp32, relative 1e-5 per step (TP changes only the order of the sums in the row-wise
reductions and the sharded softmax). The optimizer is SGD with momentum, so a gradient that is
wrong on any rank shows in the next step's loss.
"""

import contextlib
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from kiln.config import ParallelConfig, load_config
from kiln.errors import ConfigError
from kiln.model.transformer import Transformer
from kiln.parallel.dims import ParallelDims
from kiln.train.step import train_step

STEPS = 5
REL = 1e-5
BATCH, SEQ = 2, 16
CLIP = 1.0

LLAMA = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=64",
         "model.max_seq_len=32", "model.dropout=0.0", "data.seq_len=16"]
# GPT-2: learned positions, LayerNorm with bias, biases in every linear, GeLU MLP, untied head;
# a vocabulary that 2 ranks split unevenly (33 + 32 rows).
GPT2 = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=65", "model.max_seq_len=32",
        "model.positions=learned", "model.norm=layernorm", "model.bias=true", "model.activation=gelu",
        "model.tie_embeddings=false", "model.dropout=0.0", "data.seq_len=16"]
POST_NORM = LLAMA + ["model.norm_placement=post", "model.tie_embeddings=false"]
# Qwen3's QK-norm (per head, before RoPE) and heads wider than dim / n_heads (4 x 16 on dim 32, as
# Qwen3-0.6B's 16 x 128 on 1024), with Qwen2's q/k/v biases.
QK_NORM = LLAMA + ["model.qk_norm=true", "model.qkv_bias=true", "model.head_dim=16"]
# One dense block, one MoE block (top-2, capacity 1.25: some assignments are dropped), aux and z
# weights large enough that a wrong aux/z gradient shows in the losses.
MOE = LLAMA + ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2", "model.moe_aux_loss_weight=0.1",
               "model.moe_z_loss_weight=0.01"]


def model_config(overrides):
    return load_config(None, overrides).model


def build_model(overrides, tp_mesh=None, plan_edit=None, loss_impl="full"):
    """The test model, tensor-parallel with a tp_mesh (its plan changed by plan_edit), initialized
    as in one process; loss_impl "chunked": the chunked head + loss (vocab-parallel under tp)."""
    from kiln.parallel import tensor_parallel

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_config(overrides))
    if tp_mesh is not None:
        plan = tensor_parallel.tp_plan(model)
        if plan_edit:
            plan_edit(plan)
        from torch.distributed.tensor.parallel import parallelize_module

        from kiln import torch_compat
        torch_compat.key_embedding_backward_by_vocab()  # as kiln's apply_tp does (torch 2.6: 64 then 65 rows)
        parallelize_module(model, tp_mesh, plan)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    model.loss_impl = loss_impl
    if model.cfg.tie_embeddings:  # the tie survives TP: both modules shard the one weight on dim 0
        assert model.output.weight is model.tok_embeddings.weight
    return model


# One fixed batch of random tokens: the loss must fall as the model memorizes it.
TOKENS = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def run_steps(overrides, tp_mesh=None, plan_edit=None, plain_step=False, loss_impl="full", muon=False):
    """STEPS of SGD (muon: kiln's Muon) with kiln's train_step on one batch: [loss, grad norm] per
    step (plain_step: loss.backward + SGD, losses only), for `build_model(overrides, tp_mesh,
    plan_edit, loss_impl)`."""
    model = build_model(overrides, tp_mesh, plan_edit, loss_impl)
    if muon:  # hidden matrices and expert stacks orthogonalized (split over the tp ranks), the rest AdamW
        from kiln.config import OptimConfig
        from kiln.train.optim import build_optimizer

        opt = build_optimizer(model, OptimConfig(name="muon", lr=0.05, muon_adam_lr=0.01))
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"]
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    tokens = TOKENS
    out = []
    for _ in range(STEPS):
        if plain_step:  # (clip_grad_norm_ cannot mix the broken plan's plain and DTensor gradients)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
            continue
        # kiln's step, clipping included (the clip is below the first steps' gradient norms).
        loss, grad_norm, _ = train_step(model, opt, [(tokens[:, :-1], tokens[:, 1:])],
                                        autocast=contextlib.nullcontext(), scaler=None, clip=CLIP)
        out += [loss.item(), grad_norm.item()]
        if model.moe_losses is not None:  # the unweighted aux and z-losses of the step's forward
            out += model.moe_losses.tolist()
    if not plain_step:  # evaluation: the loss without gradients, and full logits (as generate uses)
        with torch.no_grad():
            out += [model(tokens[:, :-1], tokens[:, 1:]).item(), model(tokens[:, :-1]).square().mean().item()]
    return out


# name -> (model overrides, whether to break the plan); all run in one 2-rank launch (a process
# start costs seconds on 2 cores).
CASES = {"llama": (LLAMA, None), "gpt2": (GPT2, None), "post_norm": (POST_NORM, None), "qk_norm": (QK_NORM, None),
         "llama_wrong_plan": (LLAMA, "_drop_norm_sequence_parallel"), "moe": (MOE, None),
         "moe_no_grad_sum": (MOE, None), "moe_aux_share_whole": (MOE, None)}
# train.loss='chunked' under tp: name -> (overrides, whether the log-sum-exp is left per rank). The
# head is tied in Llama (even split of 64) and in GPT-2 tied, untied in GPT-2 (65 = 33 + 32 rows).
GPT2_TIED = GPT2 + ["model.tie_embeddings=true"]
CHUNKED_CASES = {"llama_chunked": (LLAMA, False), "gpt2_chunked": (GPT2, False),
                 "gpt2_tied_chunked": (GPT2_TIED, False), "llama_chunked_local_lse": (LLAMA, True)}
BROKEN = {"moe_no_grad_sum", "llama_chunked_local_lse", "qk_norm_grads_wrong_plan"}  # their ranks disagree
LOSS_CHUNK = 12  # 32 tokens -> chunks of 12, 12, 8


def _worker(rank, world, store_path, result_path):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        losses = {}
        for name, (overrides, plan_edit) in CASES.items():
            broken = {"moe_no_grad_sum": _without_moe_grad_sum, "moe_aux_share_whole": _aux_share_whole}
            with broken.get(name, contextlib.nullcontext)():
                edit = globals()[plan_edit] if plan_edit else None
                losses[name] = run_steps(overrides, mesh, edit, plain_step=edit is not None)
        for name, (overrides, local_lse) in CHUNKED_CASES.items():
            with _small_loss_chunks(), _lse_not_combined() if local_lse else contextlib.nullcontext():
                losses[name] = run_steps(overrides, mesh, loss_impl="chunked")
        losses["moe_muon"] = run_steps(MOE, mesh, muon=True)
        losses["qk_norm_grads"] = qk_norm_grads(mesh)
        losses["qk_norm_grads_wrong_plan"] = qk_norm_grads(mesh, _drop_qk_norm)
        losses["vocab_parallel_math"] = _vocab_parallel_math(rank, world, mesh)
        with _lse_not_combined():
            losses["vocab_parallel_math_local_lse"] = _vocab_parallel_math(rank, world, mesh)
        torch.save(losses, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def _drop_norm_sequence_parallel(plan):
    # A classic SP bug: norm weights left as plain tensors see only their rank's slice of the
    # sequence, so their gradients are never summed over the tp ranks.
    for key in [k for k in plan if k.endswith("norm")]:
        del plan[key]


def _drop_qk_norm(plan):
    # The same for QK-norm: weights left plain see only their rank's heads.
    for key in [k for k in plan if k.endswith(("q_norm", "k_norm"))]:
        del plan[key]


@contextlib.contextmanager
def _without_moe_grad_sum():
    # The expert-TP bug: the router's weight gradient, partial over tp (each rank's gates see only
    # its hidden units' share of the experts' outputs), taken as whole: never summed over tp.
    from kiln.parallel import functional

    saved = functional.local_with_partial_grad
    functional.local_with_partial_grad = lambda param: param.to_local()
    try:
        yield
    finally:
        functional.local_with_partial_grad = saved


@contextlib.contextmanager
def _aux_share_whole():
    # Every tp rank computes the same aux and z-losses; their gradients join the gates' partial
    # ones, summed over tp afterwards: a share not divided by tp is counted tp times.
    from kiln.parallel import functional

    saved = functional.grad_share_over_tp
    functional.grad_share_over_tp = lambda t, mesh: t
    try:
        yield
    finally:
        functional.grad_share_over_tp = saved


@contextlib.contextmanager
def _small_loss_chunks():
    # Several chunks (the last one short) in the tiny models' 32 tokens.
    from kiln.parallel import functional

    saved = functional.parallel_chunked_lm_loss
    functional.parallel_chunked_lm_loss = functools.partial(saved, chunk=LOSS_CHUNK)
    try:
        yield
    finally:
        functional.parallel_chunked_lm_loss = saved


@contextlib.contextmanager
def _lse_not_combined():
    # The vocab-parallel bug: each rank's log-sum-exp (its sum-exp) and target logit over its own
    # vocabulary rows only, never reduced over tp.
    from kiln.model import loss

    saved = loss.combine_over_vocab_shards
    loss.combine_over_vocab_shards = lambda lse, target_logit, group: (lse, target_logit)
    try:
        yield
    finally:
        loss.combine_over_vocab_shards = saved


MATH_VOCAB, MATH_DIM = 65, 24  # rank 0 owns rows 0..32, rank 1 rows 33..64
MATH_CHUNKS = (1, 7, 4096)


def math_inputs():
    """Hidden states (BATCH, SEQ, dim), head weight, targets: every shard's first and last row
    among the targets, and padding (IGNORE_INDEX) ones."""
    from kiln.model.loss import IGNORE_INDEX

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(BATCH, SEQ, MATH_DIM, generator=gen)
    weight = torch.randn(MATH_VOCAB, MATH_DIM, generator=gen)
    targets = torch.randint(0, MATH_VOCAB, (BATCH, SEQ), generator=gen)
    targets[0, :4] = torch.tensor([0, 32, 33, 64])
    targets[1, -3:] = IGNORE_INDEX
    return hidden, weight, targets


def _vocab_parallel_math(rank, world, mesh):
    """chunk -> (loss, d hidden, d weight) of the vocab-parallel chunked loss with an upstream
    gradient of 3, the gradients gathered whole (the same on every rank)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from kiln.parallel.functional import parallel_chunked_lm_loss

    hidden, weight, targets = math_inputs()
    seq = SEQ // world
    out = {}
    for chunk in MATH_CHUNKS:
        local = hidden[:, rank * seq:(rank + 1) * seq].clone().requires_grad_()
        w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        loss = parallel_chunked_lm_loss(local, w, targets, chunk=chunk)
        (loss * 3.0).backward()
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.grad)
        out[chunk] = (loss.detach(), torch.cat(shards, dim=1), w.grad.full_tensor())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the matmuls in bf16 on each shard, softmax fp32
        w = distribute_tensor(weight, mesh, [Shard(0)])
        out["bf16"] = parallel_chunked_lm_loss(hidden[:, rank * seq:(rank + 1) * seq], w, targets, chunk=7)
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """name -> per-step losses on 2 tensor-parallel ranks (asserted equal on both ranks)."""
    tmp = tmp_path_factory.mktemp("tp2")
    world = 2
    ctx = mp.start_processes(_worker, args=(world, str(tmp / "store"), str(tmp / "losses")),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    # join() returns False whenever some rank is still running (one may finish first); a hung rank
    # fails the test at the deadline instead of hanging it.
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("the 2-rank tensor-parallel run did not finish in 240 s")
    per_rank = [torch.load(tmp / f"losses.{r}") for r in range(world)]
    for name in per_rank[0]:  # the loss is replicated over the tp ranks (the broken runs' ranks diverge)
        if name not in BROKEN and not name.startswith("vocab_parallel_math"):
            assert per_rank[0][name] == per_rank[1][name], name
    for chunk in MATH_CHUNKS:
        (loss, dh, dw), other = per_rank[0]["vocab_parallel_math"][chunk], per_rank[1]["vocab_parallel_math"][chunk]
        assert torch.equal(loss, other[0]) and torch.equal(dh, other[1]) and torch.equal(dw, other[2]), chunk
    return per_rank[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "gpt2", "post_norm", "qk_norm"])
def test_tp2_matches_one_process(tp2, name):
    expected = run_steps(CASES[name][0])
    # (loss, grad norm) per step, then the eval loss and the mean square of the logits
    assert tp2[name] == pytest.approx(expected, rel=REL), (tp2[name], expected)
    assert expected[2 * STEPS - 2] < expected[0]  # it trains
    assert expected[1] > CLIP  # and clipping is exercised


@pytest.fixture(scope="module")
def moe_one_process():
    return run_steps(MOE)


@pytest.mark.timeout(300)
def test_moe_tp2_matches_one_process_aux_losses_included(tp2, moe_one_process):
    expected = moe_one_process
    # Per step: loss, grad norm, aux loss, z-loss; then the eval loss and the logits' mean square.
    # Every tp rank routes the whole sequence, so the aux/z losses are one process's, not an estimate.
    assert tp2["moe"] == pytest.approx(expected, rel=REL), (tp2["moe"], expected)
    assert expected[4 * STEPS - 4] < expected[0] and expected[1] > CLIP
    assert expected[2] > 0 and expected[3] > 0


@pytest.mark.timeout(300)
def test_muon_under_tp2_matches_one_process(tp2):
    """Muon's Newton-Schulz on tp-sharded matrices (column- and row-parallel) and on the experts'
    stacks sharded over their hidden units: each matrix orthogonalized whole, on one tp rank."""
    expected = run_steps(MOE, muon=True)
    assert tp2["moe_muon"] == pytest.approx(expected, rel=REL), (tp2["moe_muon"], expected)
    assert expected[4 * STEPS - 4] < expected[0]  # it trains


@pytest.mark.timeout(300)
def test_moe_tp2_without_the_router_gradient_sum_differs(tp2, moe_one_process):
    expected = moe_one_process
    got = tp2["moe_no_grad_sum"]
    assert got[0] == pytest.approx(expected[0], rel=REL)  # the forward is still right...
    # ...the router's gradient is not (this rank's hidden units' share only): outside the
    # tolerance the equivalence test holds every value to. Deterministic; only the router learns
    # wrongly, so the errors start small and grow over the steps.
    rel = [abs(g - e) / abs(e) for g, e in zip(got[1:], expected[1:])]
    assert max(rel) > 20 * REL and sum(r > 2 * REL for r in rel) >= 5, " ".join(f"{r:.1e}" for r in rel)


@pytest.mark.timeout(300)
def test_moe_tp2_with_the_aux_losses_counted_on_every_rank_differs(tp2, moe_one_process):
    """The router's gradient is summed over tp after backward (the gates' partial sums); the aux and
    z-losses, the same on every rank, enter divided by tp. Undivided, they count tp times."""
    expected = moe_one_process
    got = tp2["moe_aux_share_whole"]
    assert got[0] == pytest.approx(expected[0], rel=REL)
    rel = [abs(g - e) / abs(e) for g, e in zip(got[1:], expected[1:])]
    assert max(rel) > 20 * REL and sum(r > 2 * REL for r in rel) >= 5, " ".join(f"{r:.1e}" for r in rel)


@pytest.mark.timeout(300)
def test_wrong_plan_changes_the_losses(tp2):
    expected = run_steps(LLAMA, plain_step=True)
    got = tp2["llama_wrong_plan"]
    assert got[0] == pytest.approx(expected[0], rel=REL)  # the first loss is still right...
    assert got[1:] != pytest.approx(expected[1:], rel=REL)  # ...the norms' gradients are not


def qk_norm_grads(tp_mesh=None, plan_edit=None):
    """The QK-norm weights' gradients after one backward (whole tensors), as lists. In the
    loss trajectories above a wrong QK-norm gradient hardly shows (5 steps move those weights
    little), so the gradients are compared themselves."""
    model = build_model(QK_NORM, tp_mesh, plan_edit)
    for p in model.parameters():  # sharper attention: the QK-norm gains then matter to the loss
        if p.ndim == 2:
            p.data.mul_(3)
    model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist()
    return grads


@pytest.mark.timeout(300)
def test_qk_norm_gradients_under_tp_match_one_process_and_need_their_plan(tp2):
    expected = qk_norm_grads()
    assert len(expected) == 4 and all(any(abs(g) > 1e-4 for g in grad) for grad in expected.values())
    for name, grad in expected.items():
        assert tp2["qk_norm_grads"][name] == pytest.approx(grad, rel=1e-4, abs=1e-7), name
    # Plain weights (no plan entry): each rank's gradient covers only its own heads.
    wrong = tp2["qk_norm_grads_wrong_plan"]
    assert any(wrong[name] != pytest.approx(grad, rel=1e-2) for name, grad in expected.items())


@pytest.fixture(scope="module")
def one_process():
    """name -> one process's losses with the plain loss, for the models the chunked cases use."""
    return {name: run_steps(overrides) for name, (overrides, _) in CHUNKED_CASES.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama_chunked", "gpt2_chunked", "gpt2_tied_chunked"])
def test_tp2_chunked_loss_matches_one_process(tp2, one_process, name):
    expected = one_process[name]
    # (loss, grad norm) per step, then the eval loss (chunked too) and the logits' mean square
    assert tp2[name] == pytest.approx(expected, rel=REL), (tp2[name], expected)
    assert expected[2 * STEPS - 2] < expected[0] and expected[1] > CLIP


@pytest.mark.timeout(300)
def test_tp2_chunked_loss_without_combining_over_tp_differs(tp2, one_process):
    got, expected = tp2["llama_chunked_local_lse"], one_process["llama_chunked_local_lse"]
    # Rank 0's loss over its half of the vocabulary: wrong from the first step on.
    assert got[0] != pytest.approx(expected[0], rel=100 * REL), (got[0], expected[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", MATH_CHUNKS)
def test_vocab_parallel_chunked_loss_and_grads_equal_lm_loss(tp2, chunk):
    from kiln.model.loss import lm_loss

    hidden, weight, targets = math_inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    ref = lm_loss(hidden @ weight.t(), targets)
    gh, gw = torch.autograd.grad(ref * 3.0, (hidden, weight))
    loss, dh, dw = tp2["vocab_parallel_math"][chunk]
    torch.testing.assert_close(loss, ref.detach(), rtol=REL, atol=0)
    # Each gradient element sums (softmax - onehot) terms over the vocabulary, split over the ranks:
    # elements that nearly cancel are compared to the largest one (rounding of the terms, not of the sum).
    torch.testing.assert_close(dh, gh, rtol=REL, atol=REL * gh.abs().max().item())
    torch.testing.assert_close(dw, gw, rtol=REL, atol=REL * gw.abs().max().item())
    assert not dh[1, -3:].any()  # padding targets give no gradient
    # The negative control: a log-sum-exp per vocabulary shard is far off.
    broken = tp2["vocab_parallel_math_local_lse"][chunk]
    assert not torch.allclose(broken[0], ref, rtol=100 * REL)
    assert not torch.allclose(broken[1], gh, rtol=100 * REL, atol=1e-5)


@pytest.mark.timeout(300)
def test_vocab_parallel_chunked_loss_under_bf16_autocast_is_close_to_lm_loss(tp2):
    from kiln.model.loss import lm_loss

    hidden, weight, targets = math_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits in both; the sums differ in order
        ref = lm_loss(torch.nn.functional.linear(hidden, weight), targets)
    got = tp2["vocab_parallel_math"]["bf16"]
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=1e-3), (got, ref)


def dims_for(tp, world, **cfg):
    return ParallelDims.from_config(ParallelConfig(tp=tp, **cfg), world_size=world, rank=0, local_rank=0,
                                    local_world_size=world)


@pytest.mark.parametrize("overrides, key", [
    (["model.n_heads=6", "model.n_kv_heads=6", "model.dim=48"], "model.n_heads=6"),
    (["model.n_heads=4", "model.n_kv_heads=1"], "model.n_kv_heads=1"),
    (["model.ffn_hidden=30"], "model.ffn_hidden (the FFN hidden size)=30"),
    (["data.seq_len=30"], "data.seq_len=30"),
])
def test_tp_not_fitting_the_model_is_one_line_naming_the_value(overrides, key):
    cfg = load_config(None, ["model.dim=32", "model.n_heads=4", "data.seq_len=32", *overrides])
    with pytest.raises(ConfigError) as e:
        dims_for(4, 4).check_model(cfg)
    assert key in str(e.value) and "parallel.tp=4" in str(e.value) and "\n" not in str(e.value)


def test_tp_layouts():
    d = dims_for(2, 4)
    assert (d.tp, d.dp_shard, d.dp_mode) == (2, 2, "fsdp")
    d.check_model(load_config(None, ["model.dim=32", "model.n_heads=4", "data.seq_len=32"]))
    d.check_model(load_config(None, ["model.dim=32", "model.n_heads=4", "data.seq_len=32", "train.loss=chunked"]))
    assert dims_for(2, 4, dp_mode="ddp").dp_replicate == 2  # ddp x tp: tests/parallel/test_data_tensor_parallel.py


# ---- end to end: `kiln train` under torchrun, the loader and checkpoints included


@pytest.fixture(scope="module")
def reference(dp_reference):
    return dp_reference  # one process, the global batch: test_data_parallel's, once per session (conftest)


@pytest.mark.timeout(600)
def test_kiln_train_tp2_matches_and_its_checkpoint_continues_in_one_process(tmp_path, text_file, reference):
    import json
    import shutil

    from test_data_parallel import GLOBAL_BATCH, STEPS, assert_same_losses, common, losses, run_kiln, sets

    run = tmp_path / "tp2"
    run_kiln(["train", "--run-dir", str(run),
              *sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH, "parallel.tp": 2}))], nproc=2)
    run_row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert (run_row["tp"], run_row["loss_impl"], run_row["world_size"]) == (2, "parallel", 2)
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))
    # TP=2 -> one process from the step-3 checkpoint: same weights, optimizer, loader position.
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    run_kiln(["train", str(run / "config.toml"), "--run-dir", str(run), "--resume", *sets(["parallel.tp=1"])])
    assert_same_losses(reference, losses(run), range(4, STEPS + 1))


@pytest.mark.timeout(600)
def test_kiln_train_fsdp2_x_tp2_on_four_ranks_with_a_tied_uneven_vocab_matches(tmp_path, text_file):
    from test_data_parallel import GLOBAL_BATCH, STEPS, assert_same_losses, common, losses, run_kiln, sets

    # A tied vocabulary of 262 rows: 131 per tp shard, which FSDP splits unevenly (66 + 65). FSDP2
    # pads the shorter shard into a copy; with the embedding and the head left two parameters by
    # parallelize_module, the embedding all-gathered a stale copy from step 2 on (apply_tp re-ties).
    uneven = {"model.vocab_size": 262, "model.tie_embeddings": "true"}
    run, single = tmp_path / "dp2tp2", tmp_path / "single"
    run_kiln(["train", "--run-dir", str(run), *sets(common(
        text_file, **{"train.batch_size": GLOBAL_BATCH // 2, "parallel.tp": 2, **uneven}))], nproc=4)
    run_kiln(["train", "--run-dir", str(single),
              *sets(common(text_file, **{"train.batch_size": GLOBAL_BATCH, **uneven}))])
    assert_same_losses(losses(single), losses(run), range(1, STEPS + 1))


def test_kiln_train_with_tp_not_dividing_heads_fails_before_any_work(tmp_path, text_file, monkeypatch, capsys):
    from test_data_parallel import common, sets

    from kiln.cli import main

    run = tmp_path / "bad"
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    args = sets(common(text_file, **{"parallel.tp": 2, "model.n_heads": 1, "model.dim": 16}))
    assert main(["train", "--run-dir", str(run), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp=2 must divide model.n_heads=1" in lines[0], lines
    assert not run.exists()  # nothing was written, no process group was started
