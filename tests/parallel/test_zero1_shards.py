"""kiln/parallel/zero1_shards.py `boxes`: a run of flat elements as the boxes it covers, in order
(the 3-rank save and load through DCP are in test_zero1_state.py)."""

import itertools
import math

import pytest
import torch

from kiln.parallel.zero1_shards import boxes, local_tensors


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_every_run_is_its_elements_in_order_in_few_boxes(shape):
    flat = torch.arange(math.prod(shape)).view(shape)
    n = flat.numel()
    for start, end in itertools.combinations(range(n + 1), 2):
        got = boxes(shape, start, end)
        elements = [flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1) for offsets, sizes in got]
        assert torch.equal(torch.cat(elements), torch.arange(start, end)), (shape, start, end, got)
        assert all(all(s > 0 for s in sizes) for _, sizes in got)
        assert len(got) <= 2 * len(shape) - 1, (shape, start, end, got)
    assert boxes(shape, 3, 3) == []
    assert boxes(shape, 0, n) == [((0,) * len(shape), shape)]  # a whole tensor: one box


def _diloco_split_save(rank, n, root):
    """DiLoCo's outer state split inside a replica (dp 2) under tp 2 with shards of 24 and 23 rows:
    each rank saves its slice's boxes (nothing gathered), DCP accepts them (the tensors replicated
    over tp are sliced alike on both coordinates), and they load back into another DiLoCo."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from kiln.parallel.diloco import DiLoCo

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("rep", "dp", "tp"))

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 47, bias=False), nn.LayerNorm(47), nn.Linear(47, 4))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})
        return model, DiLoCo(model, inner_steps=1, group=mesh["rep"].get_group(), inside=mesh["dp"].get_group())

    model, diloco = build(0)
    with torch.no_grad():
        for p in model.parameters():  # an inner step's drift, then the outer step: a momentum to save
            (p.to_local() if hasattr(p, "to_local") else p).mul_(0.5)
    diloco.outer_step()
    dcp.save({"diloco": diloco.state_dict()}, checkpoint_id=str(root / "ckpt"))
    _, other = build(1)
    state = {"diloco": other.state_dict()}
    dcp.load(state, checkpoint_id=str(root / "ckpt"))
    other.load_state_dict(state["diloco"])
    same = [torch.equal(a, b) for a, b in zip(diloco.anchors() + diloco.momenta(), other.anchors() + other.momenta())]
    saved = sum(t.numel() for k, v in diloco.state_dict().items() if k != "outer_steps" for t in local_tensors(v))
    return same, saved, 2 * diloco.anchors()[0].numel(), dist.get_rank()


def test_diloco_split_state_saves_each_slice_once(tmp_path):
    from ranks import run_ranks

    (tmp_path / "work").mkdir()
    for same, saved, slices, rank in run_ranks(_diloco_split_save, 4, tmp_path / "work", tmp_path, timeout=120):
        assert all(same), rank
        assert saved <= slices, (rank, saved, slices)  # its slices' elements (less their padding), no more
