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
