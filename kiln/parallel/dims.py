"""ParallelDims: `[parallel]` degrees validated against the world size, and the named DeviceMesh.

Everything that needs a rank, a group or a degree asks this object, never `os.environ`. On one
device every degree is 1 and no process group is created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.config import ParallelConfig
from kiln.errors import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    rank: int = 0
    local_rank: int = 0
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh when world_size > 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int | None = None, rank: int | None = None,
                    local_rank: int | None = None) -> "ParallelDims":
        # torchrun's environment is read here, once, and nowhere else.
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        fixed = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(f"world size {world_size} is not divisible by parallel.dp_replicate*cp*tp*pp={fixed}")
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x "
                f"tp={cfg.tp} x pp={cfg.pp} = {fixed * dp_shard}, but the world size is {world_size}")
        if cfg.ep > 1 and (dp_shard * cfg.cp) % cfg.ep:
            raise ConfigError(f"parallel.ep={cfg.ep} must divide dp_shard*cp={dp_shard * cfg.cp}")
        unsupported = [k for k in ("tp", "pp", "cp", "ep") if getattr(cfg, k) > 1]
        if unsupported:  # the mesh is built for them; the model-side plans land with their issues
            raise ConfigError(f"parallel.{unsupported[0]} > 1 is not supported yet; use data parallelism")
        return cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size, rank, local_rank)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        names = [n for n in ("dp_replicate", "dp_shard") if n in self.mesh.mesh_dim_names]
        return self.mesh[tuple(names)]._flatten().get_local_rank() if len(names) > 1 \
            else self.mesh[names[0]].get_local_rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def build_mesh(self, device_type: str) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        dims = [(n, getattr(self, n)) for n in MESH_ORDER if getattr(self, n) > 1]
        if not dims:
            dims = [("dp_shard", 1)]
        self.mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))


def pick_device(name: str, dims: ParallelDims) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{dims.local_rank}"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={name!r} but no CUDA device is available")
        torch.cuda.set_device(device)
    return device
