"""kiln/torch_compat.py optimizer_state_like_parameters: the optimizer state of a parameter is
saved with the parameter's own DTensor layout. torch 2.8 left FSDP'd experts' state (a strided
shard over edp x ep) with a plain Shard layout, and DCP then wrote it at other experts' offsets
(tests/parallel/test_expert_parallel.py's ep2 -> ddp resume caught it on 2.8). On one gloo rank:
a state tensor whose layout differs in a placement's type takes the parameter's, keeping its local tensor; one that agrees is left alone."""

from ranks import run_ranks


def relayout_on_one_rank(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from kiln import torch_compat

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("edp", "ep"))
    local = torch.arange(8.0).view(4, 2)
    param = DTensor.from_local(local.clone(), mesh, [_StridedShard(0, split_factor=2), Shard(0)], run_check=False)
    plain = DTensor.from_local(local.clone(), mesh, [Shard(0), Shard(0)], run_check=False)
    agreeing = DTensor.from_local(local.clone(), mesh, list(param.placements), run_check=False)
    state = {"state": {"w": {"momentum_buffer": plain, "exp_avg": agreeing, "step": torch.tensor(3.0)}}}
    changed = torch_compat.optimizer_state_like_parameters(state, {"w": param})
    moved = state["state"]["w"]["momentum_buffer"]
    return {"equal_before": plain.placements == param.placements, "changed": changed,
            "same_layout": torch_compat.same_layout(moved, param),
            "shares_local": moved.to_local().data_ptr() == plain.to_local().data_ptr(),
            "agreeing_kept": state["state"]["w"]["exp_avg"] is agreeing}


def test_optimizer_state_takes_its_parameters_layout(tmp_path):
    (got,) = run_ranks(relayout_on_one_rank, 1, tmp_path)
    # torch 2.8's _StridedShard compared equal to the Shard of its dim (2.13's does not), which is
    # why kiln compares the placements' types too (torch_compat.same_layout)
    assert got["changed"] == ["w.momentum_buffer"] and got["same_layout"] and got["shares_local"]
    assert got["agreeing_kept"]
