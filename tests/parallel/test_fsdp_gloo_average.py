"""FSDP2 on gloo averages the data-parallel gradients on every torch kiln declares: torch 2.8's
gloo reduce-scatter sums where FSDP asks for AVG (kiln/torch_compat.py gloo_reduce_scatter_averages),
so kiln makes FSDP sum and divide after there (`force_sum_for_gloo`; 2.7 by its reduce op and
all-reduce hook). On 2 gloo ranks: the probe says what gloo does, and FSDP's gradient with the
workaround forced on equals the two ranks' mean, for 1-D FSDP and HSDP (a replicate x shard
mesh of 2 x 1), checked on every release, also where gloo averages and the workaround is not
needed. Where FSDP cannot be told to sum (2.7's HSDP, whose all-reduce asks gloo for AVG) and
gloo sums, kiln refuses it in one line instead."""

import torch

from kiln import torch_compat
from conftest import require_fsdp2_on_cpu
from ranks import run_ranks


def fsdp_gradient_on_two_ranks(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kiln import torch_compat
    from kiln.errors import KilnError

    averages = torch_compat.gloo_reduce_scatter_averages()
    out = torch.empty(1)
    torch_compat.reduce_scatter_single(out, torch.full((world,), float(rank)), op=dist.ReduceOp.AVG)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    hsdp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    grads = {}
    for case in ("fsdp alone", "kiln", "forced", "hsdp forced"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
        fully_shard(model, mesh=hsdp_mesh if case.startswith("hsdp") else mesh)
        if case.endswith("forced"):  # as where gloo sums, on every release: FSDP sums and divides after
            torch_compat._GLOO_REDUCE_SCATTER_AVERAGES[:] = [False]
        try:
            if case != "fsdp alone":
                torch_compat.force_sum_for_gloo(model)
        except KilnError as e:
            grads[case] = str(e)
        else:
            x = torch.full((2, 4), float(rank + 1))  # rank 0's input 1, rank 1's 2
            model(x).sum().backward()
            grads[case] = model[0].weight.grad.full_tensor().tolist()
        torch_compat._GLOO_REDUCE_SCATTER_AVERAGES[:] = [averages]
    return {"probed": averages, "avg_result": float(out), "grads": grads}


def test_fsdp_gradients_are_the_ranks_mean_with_or_without_the_gloo_workaround(tmp_path):
    require_fsdp2_on_cpu()
    for got in run_ranks(fsdp_gradient_on_two_ranks, 2, tmp_path):
        assert got["probed"] == (got["avg_result"] == 0.5)  # ranks 0 and 1 average to 0.5, sum to 1
        # d(sum(W x))/dW = sum over the 2 rows of x: 2 * (rank + 1) per entry, mean over the ranks 3
        assert got["grads"]["kiln"] == got["grads"]["forced"] == [[3.0] * 4] * 4
        if torch_compat.fsdp_can_force_sum(hsdp=True):
            assert got["grads"]["hsdp forced"] == [[3.0] * 4] * 4
        else:  # 2.7: HSDP refused in one line wherever gloo sums
            assert "cannot be told to sum instead over dp_replicate (HSDP)" in got["grads"]["hsdp forced"]
        # FSDP alone: the mean where gloo averages, the sum (twice the mean) where it does not (2.8)
        assert got["grads"]["fsdp alone"] == [[3.0 if got["probed"] else 6.0] * 4] * 4
