"""parallel.fsdp_reshard_to = k (FSDP2's reshard_after_forward=k; ZeRO++'s hpZ): after a block's
forward its parameters stay sharded over k consecutive shard ranks, so its backward all-gather
spans those k alone. On 4 gloo ranks with k = 2: every unit's forward gathers over 4 ranks, every
resharded unit's backward gathers over 2 (the last block is kept gathered, as under plain fsdp),
and the gradients equal plain FSDP's and one process's over the 4 ranks' batches. The root (final
norm, head; a tied embedding) is not gathered again in backward, nor is an untied embedding (its
own unit: kiln/parallel/parallelize.py own_embedding_unit), under either. (`kiln train` with it:
tests/parallel/test_cross_layout.py, fsdp4_reshard2; bad values: tests/parallel/test_dims.py.)"""

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks

N_LAYERS = 3


def _config(reshard_to, tied):
    from kiln.config import load_config

    return load_config(None, ["model.dim=32", f"model.n_layers={N_LAYERS}", "model.n_heads=2", "model.vocab_size=64",
                              f"model.tie_embeddings={str(tied).lower()}", "parallel.dp_mode='fsdp'",
                              f"parallel.fsdp_reshard_to={reshard_to}"])


def _tokens(rank):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))


def _gathers_and_grads(rank, world, reshard_to, tied):
    from kiln.model.transformer import Transformer
    from kiln.parallel.dims import ParallelDims
    from kiln.parallel.parallelize import apply_data_parallel

    cfg = _config(reshard_to, tied)
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
        loss = model(_tokens(rank)).float().square().mean()
        phase[0] = "backward"
        loss.backward()
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return sizes, grads


def _one_process_grads(world, tied):
    """The gradient of the mean of the ranks' losses, in one process (what FSDP averages)."""
    from kiln.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(_config(4, tied).model)
    for rank in range(world):
        (model(_tokens(rank)).float().square().mean() / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _all(rank, world):
    return {(k, tied): _gathers_and_grads(rank, world, k, tied) for k in (2, 4) for tied in (True, False)}


@pytest.mark.timeout(300)
def test_backward_gathers_over_the_reshard_ranks_with_the_same_gradients(tmp_path):
    results = run_ranks(_all, 4, tmp_path, timeout=240)
    for tied in (True, False):
        reference = _one_process_grads(4, tied)
        # every block, the root (final norm, head; tied: the embedding too) and an untied embedding
        units = N_LAYERS + 1 + (not tied)
        for result in results:
            (sizes, grads), (full_sizes, full_grads) = result[(2, tied)], result[(4, tied)]
            assert sizes["forward"] == full_sizes["forward"] == [4] * units
            # backward: every block but the last (kept gathered, as under plain fsdp); not the root, kept
            # from forward, nor the embedding, whose backward reads no weight
            assert full_sizes["backward"] == [4] * (N_LAYERS - 1)
            assert sizes["backward"] == [2] * (N_LAYERS - 1)
            assert grads.keys() == reference.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, full_grads[name], rtol=1e-6, atol=1e-7, msg=name)
                torch.testing.assert_close(g, reference[name], rtol=1e-5, atol=1e-6, msg=name)
