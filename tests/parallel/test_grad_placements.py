"""kiln.train.step.settle_grad_placements on 2 gloo ranks: a Partial gradient of a replicated
DTensor parameter (what torch 2.11 leaves on a norm weight under sequence parallelism) is reduced
to the parameter's placements (clip_grad_norm does it first where torch_compat says the optimizer
would not), so the optimizer sees the sum; a gradient already in its parameter's placements is left
as it is (no collective)."""

import torch

from ranks import run_ranks


def settle_on_two_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from kiln.train.step import settle_grad_placements

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    norm_weight = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    norm_weight.grad = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])  # sums to 3
    linear = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    linear.grad = distribute_tensor(torch.full((4, 2), 2.0), mesh, [Shard(0)])
    kept = linear.grad
    settle_grad_placements([norm_weight, linear])
    out = {"placements": str(norm_weight.grad.placements), "local": norm_weight.grad.to_local().tolist(),
           "kept": linear.grad is kept}
    return out


def test_partial_gradients_are_reduced_to_the_parameters_placements(tmp_path):
    for got in run_ranks(settle_on_two_ranks, 2, tmp_path):
        assert got["placements"] == "(Replicate(),)" and got["local"] == [3.0] * 4
        assert got["kept"]  # already as its parameter: untouched


def divide_partial_on_two_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from kiln import torch_compat

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    probed = torch_compat.dtensor_divides_partial_in_place([torch.ones(2), weight])
    grad = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])  # sums to 3
    try:
        grad.div_(2.0)  # what a pipeline schedule's scale_grads does to a stage's gradients
    except RuntimeError:
        return {"probed": probed, "divided": None}
    return {"probed": probed, "divided": grad.full_tensor().tolist(), "placements": str(grad.placements)}


def test_the_probe_for_in_place_division_of_partial_gradients_says_what_torch_does(tmp_path):
    """kiln/parallel/pipeline.py lets the schedule divide the gradients only where the probe says
    it can (torch 2.13 keeps a divided Partial gradient Partial; 2.10 refuses; 2.8 silently leaves
    it tp times too large), else the loss does."""
    from kiln import torch_compat

    assert torch_compat.dtensor_divides_partial_in_place([torch.ones(2)])  # no DTensor: nothing to refuse
    for got in run_ranks(divide_partial_on_two_ranks, 2, tmp_path):
        # right: the sum 3 halved; 2.8 gives 3 (reduced, halved, left Partial); 2.10 refuses
        assert got["probed"] == (got["divided"] == [1.5] * 4)
        if got["probed"]:
            assert got["placements"] == "(Partial(sum),)"
