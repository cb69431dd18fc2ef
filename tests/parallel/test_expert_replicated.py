"""Expert parallelism under the replicating data-parallel modes (ddp with pp, zero1 with and
without pp; also fsdp/zero2 with a zero-bubble schedule), through kiln's trainer on 4 gloo ranks,
against one process on the same global batch.

Layouts (4 experts, top-2 with capacity factor 1.0, so assignments are dropped: checked on the
reference run; tests/parallel/test_expert_pipeline_context.py's MoE settings and trainer jobs):
- ep2_pp2_ddp: 2 stages x 2 DDP replicas, ep = 2 over each stage's replicas: DDP around each stage
  chunk leaves the experts out (data_parallel.py `leave_experts_to_expert_parallel`), their
  gradients are divided by the 2 data-parallel ranks in backward (expert_parallel.py). 1F1B.
- ep2_zero1: 4 replicas, ep = 2, so each expert is replicated on 2 ranks ("edp"), its gradient
  summed there; ZeRO-1 over the dense parameters, a plain AdamW over the experts
  (data_parallel.py `Zero1Optimizer`).
- ep2_pp2_zero1: 2 stages x 2 replicas under zero1 (GPipe): both of the above in each stage.
- The zero-bubble schedules (torch's split backward: every stage but the first computes its weight
  gradients in a separate `autograd.grad` pass, where DDP's hooks never fire): no DDP wrapper,
  data_parallel.py `SplitBackwardReplicas` broadcasts and averages the dense parameters only (the
  experts left out by the same rule as the per-stage DDP), the experts' gradient hook runs inside
  the weight pass. ep2_pp2_ddp_izb: interleaved zero-bubble, one stage per rank (2 layers, against
  `single`); ep2_pp2_{ddp,zero1,fsdp,zero2}_zbv: ZBV, 2 stages per rank, 4 layers, 2 micro-batches,
  against `single4` (fsdp/zero2: FSDP2 units, the experts' own over edp, with the split weight
  pass; torch's schedule reduce-scatters them at its REDUCE_GRAD step).
  With 2 replicas per stage and ep = 2 each expert lives on one rank per stage (edp = 1): the
  hook's all-reduce over edp inside a weight pass is checked in the same launch on one MoE layer
  with torch's split functions called directly (edp 2 x ep 2, `weight_pass_then_jobs`), not through
  a pipeline schedule (that needs 8 ranks).
ep2_zero1's step-3 checkpoint continues (steps 4-5) in one process (a plain AdamW loads the split
optimizer's state) and in ep2_zero1 itself (the split optimizer loads it back), and the one-process
run's continues in ep2_zero1 (the split optimizer loads a plain one's state).

Tolerance: fp32, relative 1e-5 per step over 5 steps for the loss (LM + weighted aux + z-loss), the
pre-clipping grad norm and the logged aux and z-losses (the layouts change only the order of sums).
Negative controls, each patched into the 4 ranks and required to miss the reference: ep2_pp2_ddp
with the expert gradients neither summed over their replicas nor divided by the data-parallel
ranks (step-1 grad norm), the same under ep2_pp2_ddp_zbv (the hook's division inside the weight
pass is what makes the step-1 grad norm), ep2_pp2_ddp_zbv with SplitBackwardReplicas' average
skipped (the dense gradients stay per replica; step-1 grad norm), and ep2_zero1 with the
schedule's learning rate never handed to the two optimizers (each keeps the constructor's lr; the
step-2 loss misses). Observed: every layout and continuation within 2.3e-7 (the zero-bubble ones
within 1.5e-7); the controls miss by 0.19, 0.18 and 2.1e-2 (grad norm) and 2.4e-2 (loss). (With
the experts left in the per-stage DDP, torch's DDP constructor fails on the DTensors; with them
in SplitBackwardReplicas, its start broadcast fails on mixed Tensor/DTensor; no numbers.)
The layer-level tests below (one rank, and 4 ranks in the shared launch) run torch's split backward
functions on one MoE layer directly: the experts' hook fires only in the weight pass, once per
expert weight, and gives a plain backward's gradients (on 4 ranks, summed over the replicas).
"""

import json
import shutil

import pytest

from ranks import patch_for_one_run, run_ranks
from test_expert_pipeline_context import (REL, SAVE_AT, STEPS, assert_matches_one_process, assert_same,
                                          jobs_with_mistakes, moe_job, rows)

ZBV = {"parallel.pp": 2, "parallel.ep": 2, "parallel.pp_schedule": "'zbv_zero_bubble'",
       "parallel.pp_virtual_stages": 2, "parallel.pp_microbatches": 2, "model.n_layers": 4}
LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "ep2_pp2_ddp": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "'ddp'",
                        "parallel.pp_schedule": "'1f1b'"}),
    "ep2_zero1": (4, {"parallel.ep": 2, "parallel.dp_mode": "'zero1'"}),
    # 2 micro-batches a step: the experts' sum over edp once, after the last (ReplicatedExpertGrads)
    "single_ga2": (1, {"train.grad_accum": 2}),
    "ep2_ddp_ga2": (4, {"parallel.ep": 2, "parallel.dp_mode": "'ddp'", "train.grad_accum": 2}),
    "ep2_pp2_zero1": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "'zero1'",
                          "parallel.pp_schedule": "'gpipe'"}),
    # The zero-bubble schedules (torch's split weight pass): one stage per rank with 2 layers ...
    "ep2_pp2_ddp_izb": (4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "'ddp'",
                            "parallel.pp_schedule": "'interleaved_zero_bubble'"}),
    # ... and ZBV's 2 stages per rank with 4 layers, against their own one-process run
    "single4": (1, {"model.n_layers": 4}),
    "ep2_pp2_ddp_zbv": (4, {**ZBV, "parallel.dp_mode": "'ddp'"}),
    "ep2_pp2_zero1_zbv": (4, {**ZBV, "parallel.dp_mode": "'zero1'"}),
    "ep2_pp2_fsdp_zbv": (4, {**ZBV, "parallel.dp_mode": "'fsdp'"}),
    "ep2_pp2_zero2_zbv": (4, {**ZBV, "parallel.dp_mode": "'zero2'"}),
}
# kiln's foreach optimizers on one group of plain dense parameters (DDP) and the experts' DTensors:
# each tensor layout stepped apart (kiln/train/optimizers/foreach.py; before, torch raised "mixed
# torch.Tensor and DTensor", found by scripts/layout_fuzz.py)
for _name, _optim in (("lion", {"optim.name": "'lion'", "optim.lr": 0.001}), ("lamb", {"optim.name": "'lamb'"})):
    LAYOUTS[f"single_{_name}"] = (1, _optim)
    LAYOUTS[f"ep2_ddp_{_name}"] = (4, {"parallel.ep": 2, "parallel.dp_mode": "'ddp'", **_optim})
REFERENCE = {name: "single4" if LAYOUTS[name][1].get("model.n_layers") == 4 else "single" for name in LAYOUTS}
REFERENCE.update(ep2_ddp_ga2="single_ga2", ep2_ddp_lion="single_lion", ep2_ddp_lamb="single_lamb")
SINGLES = ("single", "single4", "single_ga2", "single_lion", "single_lamb")


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.pp": 1, "parallel.ep": 1, **parallel}
    return moe_job(text_file, shards, per_rank, world // per_rank["parallel.pp"])


def replicated_mistake(kind):
    """Patch one deliberate mistake into this process; returns the undo."""
    if kind == "expert_grads_not_reduced":  # the hook is bound when the experts are parallelized
        from kiln.parallel import expert_parallel as xp

        return patch_for_one_run(xp.ReplicatedExpertGrads, "__call__", lambda self, grad: grad)
    if kind == "accumulated_expert_grads_not_reduced":  # the once-a-step sum over edp skipped
        from kiln.parallel import expert_parallel as xp

        return patch_for_one_run(xp.ReplicatedExpertGrads, "_launch", lambda self, w: False)
    if kind == "split_replicas_not_averaged":  # the dense gradients of a zero-bubble step left per replica
        from kiln.parallel.data_parallel import SplitBackwardReplicas

        return patch_for_one_run(SplitBackwardReplicas, "average", lambda self: None)
    if kind == "lr_not_handed_on":
        from kiln.parallel.data_parallel import Zero1Optimizer as Split

        return patch_for_one_run(Split, "_push_hyperparameters", lambda self: None)
    return lambda: None


def weight_pass_then_jobs(rank, world, jobs):
    """In the launch the trainer jobs share: first `split_and_plain_backward` on 4 ranks with the
    experts on ("edp" 2, "ep" 2), so the hook's all-reduce over edp runs inside the weight pass
    (which the trainer layouts, edp = 1, never do); then the jobs. Returns the former's result."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    got = split_and_plain_backward(mesh, world, seed=rank)  # each rank its own tokens
    jobs_with_mistakes(rank, world, replicated_mistake, jobs)
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.model.moe import MoE
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("ep_replicated")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    dropped = {name: [] for name in SINGLES}  # each reference's dropped share, every MoE forward
    forward = MoE.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        dropped[reference].append(float(self.last_dropped_fraction))
        return out

    MoE.forward = recording
    try:
        for reference in SINGLES:  # the first writes the shared shards
            train(load_config(None, sets[reference]), root / reference)
    finally:
        MoE.forward = forward
    out = {name: root / name for name in LAYOUTS}
    out["dropped"] = dropped
    for name in ("ep2_zero1->ep2_zero1", "ep2_zero1->single", "single->ep2_zero1", "expert_grads_not_reduced",
                 "lr_not_handed_on", "zbv_expert_grads_not_reduced", "zbv_split_replicas_not_averaged",
                 "accumulated_expert_grads_not_reduced"):
        out[name] = root / name.replace(">", "")
    jobs = [(None, out[name], sets[name], None, None) for name in LAYOUTS if not name.startswith("single")]
    jobs += [(out["ep2_zero1"], out["ep2_zero1->ep2_zero1"], sets["ep2_zero1"], None, None),
             (out["single"], out["single->ep2_zero1"], sets["ep2_zero1"], None, None),
             (None, out["expert_grads_not_reduced"], sets["ep2_pp2_ddp"], 1, "expert_grads_not_reduced"),
             (None, out["lr_not_handed_on"], sets["ep2_zero1"], 2, "lr_not_handed_on"),
             (None, out["zbv_expert_grads_not_reduced"], sets["ep2_pp2_ddp_zbv"], 1, "expert_grads_not_reduced"),
             (None, out["zbv_split_replicas_not_averaged"], sets["ep2_pp2_ddp_zbv"], 1, "split_replicas_not_averaged"),
             (None, out["accumulated_expert_grads_not_reduced"], sets["ep2_ddp_ga2"], 1,
              "accumulated_expert_grads_not_reduced")]
    (root / "ranks").mkdir()
    out["weight_pass"] = run_ranks(weight_pass_then_jobs, 4, root / "ranks", jobs, timeout=400)
    shutil.copytree(out["ep2_zero1"], out["ep2_zero1->single"], ignore=shutil.ignore_patterns(f"step-{STEPS}"))
    train(load_config(None, sets["single"]), out["ep2_zero1->single"], resume=True)
    return out


def run_rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, mode", [("ep2_pp2_ddp", "ddp"), ("ep2_zero1", "zero1"), ("ep2_pp2_zero1", "zero1"),
                                        ("ep2_ddp_ga2", "ddp"),
                                        ("ep2_pp2_ddp_izb", "ddp"), ("ep2_pp2_ddp_zbv", "ddp"),
                                        ("ep2_pp2_zero1_zbv", "zero1"), ("ep2_pp2_fsdp_zbv", "fsdp"),
                                        ("ep2_pp2_zero2_zbv", "zero2"), ("ep2_ddp_lion", "ddp"),
                                        ("ep2_ddp_lamb", "ddp")])
def test_ep_under_ddp_or_zero1_matches_one_process(runs, name, mode):
    # capacity 1.0 drops assignments: the dropping path is compared too
    assert max(runs["dropped"][REFERENCE[name]]) > 0
    row = run_rows(runs[name])[0]
    assert row["dp_mode"] == mode
    assert row.get("pp_schedule") == (LAYOUTS[name][1].get("parallel.pp_schedule", "").strip("'") or None)
    assert_matches_one_process(runs[REFERENCE[name]], runs[name], 4, name)


@pytest.mark.parametrize("pair, world", [("ep2_zero1->single", 1), ("ep2_zero1->ep2_zero1", 4),
                                         ("single->ep2_zero1", 4)])
def test_zero1_ep_checkpoint_continues(runs, pair, world):
    expected, got = rows(runs["single"]), rows(runs[pair])
    run_row = run_rows(runs[pair])[-1]
    assert run_row["resumed_from"] == SAVE_AT and run_row["world_size"] == world
    assert sorted(got) == list(range(1, STEPS + 1))  # the copied rows 1..3, then this run's 4..5
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), pair)


@pytest.mark.parametrize("name, step, key, reference", [
    ("expert_grads_not_reduced", 1, "grad_norm", "single"), ("lr_not_handed_on", 2, "loss", "single"),
    ("zbv_expert_grads_not_reduced", 1, "grad_norm", "single4"),
    ("zbv_split_replicas_not_averaged", 1, "grad_norm", "single4"),
    ("accumulated_expert_grads_not_reduced", 1, "grad_norm", "single_ga2")])
def test_each_deliberate_mistake_fails_the_comparison(runs, name, step, key, reference):
    expected, got = rows(runs[reference]), rows(runs[name])
    assert sorted(got) == list(range(1, step + 1))
    assert got[step][key] != pytest.approx(expected[step][key], rel=10 * REL)
    with pytest.raises(AssertionError):
        assert_same(expected, got, [step], name)


@pytest.mark.parametrize("sets, expected", [
    # (ep x tp x pp under ddp/zero1 runs: tests/parallel/test_data_tensor_pipeline_parallel.py)
    # ep is carved out of the replicas under zero1 as under ddp
    ({"dp_mode": "zero1", "ep": 4, "pp": 4}, "parallel.ep=4 must divide dp_replicate=2"),
])
def test_remaining_refusals_name_the_key(sets, expected):
    from kiln.config import ParallelConfig
    from kiln.errors import ConfigError
    from kiln.parallel.dims import ParallelDims

    cfg = ParallelConfig(**{"ep": 2, **sets})
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")) as e:
        ParallelDims.from_config(cfg, world_size=8, rank=0, local_rank=0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_ep_with_pp_and_zero1_are_accepted(mode):
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    d = ParallelDims.from_config(ParallelConfig(ep=2, pp=2, dp_mode=mode), world_size=8, rank=0, local_rank=0)
    assert (d.dp_mode, d.dp_replicate, d.pp, d.ep) == (mode, 4, 2, 2)
    d = ParallelDims.from_config(ParallelConfig(ep=2, dp_mode="zero1"), world_size=4, rank=0, local_rank=0)
    assert (d.dp_mode, d.dp_replicate, d.ep) == ("zero1", 4, 2)


# ------------------------------------------------- the split optimizer's state in one gloo process

@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _model_with_experts(seed):
    """Two dense layers and an 'experts' weight that is a DTensor (as parallel.ep makes them)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    model = nn.Module()
    model.inp, model.out = nn.Linear(4, 6), nn.Linear(6, 2)
    model.experts = nn.Parameter(distribute_tensor(torch.randn(6, 6) * 0.3, init_device_mesh("cpu", (1,)), [Shard(0)]))
    return model


def _adamw(model, lr=0.01):
    import torch

    groups = [{"name": "decay", "params": [model.inp.weight, model.experts, model.out.weight], "weight_decay": 0.1},
              {"name": "no_decay", "params": [model.inp.bias, model.out.bias], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, foreach=False)


def _step(model, opt, seed, lr):
    import torch

    for g in opt.param_groups:  # as LRSchedule does: on the outer groups only
        g["lr"] = lr
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    h = torch.tanh(model.inp(x))
    model.out(h @ model.experts.to_local()).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _whole(value):
    """A saved optimizer state value as one tensor: a ZeRO-1 share (one rank: every box) put
    together, a DTensor's local tensor (one rank: all of it)."""
    import torch

    from kiln.parallel.zero1_shards import is_sharded

    if not is_sharded(value):
        return value.to_local() if hasattr(value, "to_local") else value
    whole = torch.full(tuple(value.size()), float("nan"))
    for s in value.local_shards():
        whole[tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))] = s.tensor
    return whole


def test_split_optimizer_saves_and_loads_as_a_plain_one(one_rank, tmp_path):
    """Same steps, same state as a plain AdamW over the same groups (a changing lr reaches both
    parts); DCP's FQN-keyed dict loads into a fresh split optimizer, and through a DCP checkpoint
    into a plain AdamW, and all three continue identically."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from kiln.parallel.data_parallel import Zero1Optimizer

    model, plain_model = _model_with_experts(0), _model_with_experts(0)
    split, plain = Zero1Optimizer(_adamw(model), one_rank), _adamw(plain_model)
    assert isinstance(split.experts.param_groups[0]["params"][0], type(model.experts))
    for s, lr in enumerate([0.01, 0.03, 0.02]):
        _step(model, split, s, lr)
        _step(plain_model, plain, s, lr)
    ours, theirs = split.state_dict(), plain.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"]) == set(range(5))
    for k in theirs["state"]:
        for name, value in theirs["state"][k].items():
            torch.testing.assert_close(_whole(ours["state"][k][name]), _whole(value), rtol=0, atol=0)

    model_sd, optim_sd = copy.deepcopy(get_state_dict(model, split))  # as if read back from disk
    assert set(optim_sd["state"]) == {"inp.weight", "inp.bias", "out.weight", "out.bias", "experts"}
    resumed_model = _model_with_experts(1)
    resumed = Zero1Optimizer(_adamw(resumed_model, lr=0.5), one_rank)
    set_state_dict(resumed_model, resumed, model_state_dict=model_sd, optim_state_dict=optim_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))
    other_model = _model_with_experts(2)
    other = _adamw(other_model, lr=0.5)
    other_sd = dict(zip(("model", "optim"), get_state_dict(other_model, other)))  # whole tensors to read into
    dcp.load(other_sd, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(other_model, other, model_state_dict=other_sd["model"], optim_state_dict=other_sd["optim"])
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in other.param_groups] == [0.02, 0.02]
    for m, opt in ((model, split), (resumed_model, resumed), (other_model, other)):
        _step(m, opt, 7, 0.015)
    for name, p in model.named_parameters():
        for m in (resumed_model, other_model):
            torch.testing.assert_close(dict(m.named_parameters())[name], p, rtol=0, atol=0)


def test_split_optimizer_refuses_a_state_of_other_groups(one_rank):
    from kiln.parallel.data_parallel import Zero1Optimizer

    model = _model_with_experts(0)
    split = Zero1Optimizer(_adamw(model), one_rank)
    state = split.state_dict()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:2]
    with pytest.raises(ValueError, match=r"param groups of sizes \[2, 2\], this optimizer \[3, 2\]"):
        split.load_state_dict(state)


def split_and_plain_backward(mesh, dp_size, seed):
    """One MoE layer with kiln's ddp-mode experts on `mesh` ("edp", "ep"; DTensors, the gradient
    hook on each forward's local slice), backward twice on this rank's input (drawn from `seed`):
    torch's zero-bubble split (pipelining/_backward.py: input pass, then the weight pass from the
    saved intermediates with `autograd.grad`, where no AccumulateGrad hook runs) and one plain
    backward. Returns the hook calls during the input pass, during the weight pass and in the plain
    backward, and per parameter (split gradient, plain gradient), local tensors."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.distributed.tensor import DTensor

    from kiln.config import ModelConfig
    from kiln.model.moe import MoE
    from kiln.parallel import expert_parallel as xp

    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0)

    def layer():
        torch.manual_seed(0)  # the same experts everywhere, sliced over ep
        moe = MoE(cfg, 16)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.3)
        xp.apply_expert_parallel_training(moe, mesh, dp_size=dp_size, fsdp=False, per_backward=True)  # a stage's
        calls = []
        hook = moe.experts.grad_hook
        moe.experts.grad_hook = lambda grad: calls.append(grad.shape) or hook(grad)
        return moe, calls

    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed))
    dy = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed + 100))
    plain, plain_calls = layer()
    inp = x.clone().requires_grad_()
    (inp + plain(inp)).backward(dy)  # a residual block's output, as a stage sends it
    split, calls = layer()
    split_inp = x.clone().requires_grad_()  # a later stage's input: torch splits its backward
    weights = list(split.parameters())
    _, param_groups = stage_backward_input([split_inp + split(split_inp)], [dy], [split_inp], iter(weights))
    input_pass_calls = len(calls)
    no_expert_grad_yet = all(p.grad is None for p in split.experts.parameters())
    stage_backward_weight(iter(weights), param_groups)
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    grads = {name: (local(p.grad), local(q.grad)) for (name, p), q in zip(split.named_parameters(), plain.parameters())}
    grads["input"] = (split_inp.grad, inp.grad)
    return {"input_pass_calls": input_pass_calls, "no_expert_grad_after_input_pass": no_expert_grad_yet,
            "weight_pass_calls": len(calls) - input_pass_calls, "plain_calls": len(plain_calls), "grads": grads}


def assert_hook_runs_in_the_weight_pass(got):
    import torch

    assert got["input_pass_calls"] == 0 and got["no_expert_grad_after_input_pass"]
    assert got["weight_pass_calls"] == got["plain_calls"] == 3  # once per expert weight (w1, w2, w3)
    for name, (split, plain) in got["grads"].items():
        torch.testing.assert_close(split, plain, rtol=1e-6, atol=1e-9, msg=name)


def test_expert_gradient_hook_fires_once_in_the_split_weight_pass(one_rank):
    """On one rank (dp_size 2, no replicas): the input pass leaves the experts alone, the weight
    pass runs the hook once per expert weight, every gradient is the plain backward's, and the
    experts' are the unhooked ones divided by dp_size (the hook did act)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("edp", "ep"))
    got = split_and_plain_backward(mesh, 2, seed=1)
    assert_hook_runs_in_the_weight_pass(got)
    unhooked = split_and_plain_backward(mesh, 1, seed=1)  # dp_size 1, one replica: the hook is the identity
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        torch.testing.assert_close(got["grads"][name][0], unhooked["grads"][name][0] / 2, rtol=1e-6, atol=0)


def test_expert_hook_reduces_over_replicas_inside_the_weight_pass(runs):
    """4 ranks, experts on ("edp" 2, "ep" 2), each rank its own input: split == plain backward on
    every rank, and the two replicas of each expert (ranks r and r + 2) hold the same gradient,
    which their different inputs give only through the hook's sum over edp."""
    import torch

    got = runs["weight_pass"]
    for r in range(4):
        assert_hook_runs_in_the_weight_pass(got[r])
    for r in (0, 1):
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            torch.testing.assert_close(got[r]["grads"][name][0], got[r + 2]["grads"][name][0], rtol=1e-6, atol=0)
        assert not torch.equal(got[r]["grads"]["router.weight"][0], got[r + 2]["grads"]["router.weight"][0])
