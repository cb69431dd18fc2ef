"""The one `parallelize` entry for kiln's transformer, applied to the model on the meta device.

Order (torchtitan's): pipeline split -> tensor/sequence parallel -> activation checkpointing ->
compile -> FSDP/DDP. On one device only checkpointing and compile apply. Materialization and
init come after this (see kiln/train/trainer.py), so sharded weights are allocated sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from kiln.config import JobConfig
from kiln.parallel.dims import ParallelDims


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute block activations in backward: every block (full) or every other (selective)."""
    for i, block in enumerate(model.layers):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_compile(model: nn.Module) -> None:
    # Per block: every block has the same graph, so one compilation serves all of them.
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=True)


def apply_fsdp(model: nn.Module, dims: ParallelDims, param_dtype: torch.dtype | None, cpu_offload: bool) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    names = [n for n in ("dp_replicate", "dp_shard") if n in dims.mesh.mesh_dim_names]
    mesh = dims.mesh[tuple(names)]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:  # gloo cannot all-gather pinned CPU tensors; pin_memory=False is required on CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for i, block in enumerate(model.layers):
        # The last block is not resharded after forward: backward needs it first.
        fully_shard(block, reshard_after_forward=i < len(model.layers) - 1, **kwargs)
    fully_shard(model, **kwargs)


def parallelize(model: nn.Module, dims: ParallelDims, cfg: JobConfig, device: torch.device) -> nn.Module:
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        apply_compile(model)
    if dims.world_size > 1 and dims.dp_size > 1:
        param_dtype = torch.bfloat16 if (cfg.train.dtype == "bf16" and device.type == "cuda") else None
        apply_fsdp(model, dims, param_dtype, cpu_offload=device.type == "cpu")
    return model
