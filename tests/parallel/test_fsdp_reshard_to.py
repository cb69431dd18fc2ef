"""parallel.fsdp_reshard_to = k (FSDP2's reshard_after_forward=k; ZeRO++'s hpZ): after a block's
forward its parameters stay sharded over k consecutive shard ranks, so its backward all-gather
spans those k alone. On 4 gloo ranks with k = 2: every unit's forward gathers over 4 ranks, every
resharded unit's backward gathers over 2 (the last block is kept gathered, as under plain fsdp),
and the gradients equal plain FSDP's. (`kiln train` with it: tests/parallel/test_cross_layout.py,
fsdp4_reshard2; bad values: tests/parallel/test_dims.py.)"""

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks

N_LAYERS = 3


def _gathers_and_grads(rank, world, reshard_to):
    from kiln.config import load_config
    from kiln.model.transformer import Transformer
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import apply_data_parallel

    cfg = load_config(None, ["model.dim=32", f"model.n_layers={N_LAYERS}", "model.n_heads=2", "model.vocab_size=64",
                             "parallel.dp_mode='fsdp'", f"parallel.fsdp_reshard_to={reshard_to}"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_data_parallel(model, dims, cfg, torch.device("cpu"))
    sizes, phase = {"forward": [], "backward": []}, ["forward"]
    # FSDP2's all-gather: dist.all_gather_single from torch 2.13, all_gather_into_tensor before
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[2] if len(args) > 2 else None
            sizes[phase[0]].append(dist.get_world_size(group))
            return real[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, counting(n))
    try:
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        loss = model(tokens).float().square().mean()
        phase[0] = "backward"
        loss.backward()
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return sizes, grads


def _both(rank, world):
    return {k: _gathers_and_grads(rank, world, k) for k in (2, 4)}


@pytest.mark.timeout(200)
def test_backward_gathers_over_the_reshard_ranks_with_the_same_gradients(tmp_path):
    results = run_ranks(_both, 4, tmp_path, timeout=180)
    for result in results:
        (sizes, grads), (full_sizes, full_grads) = result[2], result[4]
        units = N_LAYERS + 1  # every block and the root (embedding, final norm, head)
        assert sizes["forward"] == full_sizes["forward"] == [4] * units
        assert full_sizes["backward"] == [4] * (units - 1)  # the last block is kept gathered
        assert sizes["backward"] == [2] * (units - 1)
        for name, g in grads.items():
            torch.testing.assert_close(g, full_grads[name], rtol=1e-6, atol=1e-7, msg=name)
