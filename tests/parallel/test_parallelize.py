"""The final data-parallel stage applies what `[parallel]` names (on a one-rank gloo mesh, so it
runs in this process): ZeRO-2 never reshards after forward, FSDP reshards every block but the
last, reduce_dtype reaches FSDP2's mixed-precision policy, ddp/zero1 replicate in place."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kiln.config import load_config
from kiln.model.transformer import Transformer
from kiln.parallel.dims import ParallelDims
from kiln.parallel.parallelize import apply_data_parallel


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def parallelized(mesh, mode, *overrides):
    cfg = load_config(None, ["model.dim=32", "model.n_layers=3", "model.n_heads=2", "model.vocab_size=64",
                             f"parallel.dp_mode={mode}", *overrides])
    dims = ParallelDims(1, 1, 1, 1, 1, 1, world_size=1, dp_mode=mode)
    dims.mesh = mesh
    with torch.device("meta"):
        model = Transformer(cfg.model)
    apply_data_parallel(model, dims, cfg, torch.device("cpu"))
    return model


def reshards_after_forward(module) -> bool:
    return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


def test_zero2_keeps_parameters_gathered_from_forward_to_backward(one_rank_mesh):
    model = parallelized(one_rank_mesh, "zero2")
    assert [reshards_after_forward(b) for b in model.layers] == [False, False, False]


def test_fsdp_reshards_every_block_but_the_last(one_rank_mesh):
    model = parallelized(one_rank_mesh, "fsdp")
    assert [reshards_after_forward(b) for b in model.layers] == [True, True, False]


@pytest.mark.parametrize("reduce_dtype, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_reduce_dtype_reaches_the_mixed_precision_policy(one_rank_mesh, reduce_dtype, expected):
    model = parallelized(one_rank_mesh, "fsdp", f"parallel.reduce_dtype={reduce_dtype}")
    for module in (*model.layers, model):
        policy = module._get_fsdp_state()._fsdp_param_group.mp_policy
        assert policy.reduce_dtype == expected and policy.param_dtype is None  # bf16 params: GPUs only


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicating_modes_keep_the_module_and_its_names(one_rank_mesh, mode):
    from torch.distributed._composable.replicate import replicate

    model = parallelized(one_rank_mesh, mode)
    assert replicate.state(model) is not None and not hasattr(model.layers[0], "_get_fsdp_state")
    with torch.device("meta"):
        plain = Transformer(load_config(None, ["model.dim=32", "model.n_layers=3", "model.n_heads=2",
                                               "model.vocab_size=64"]).model)
    # Checkpoints are keyed by these names: replication must not prefix them (as DDP's `module.`).
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
