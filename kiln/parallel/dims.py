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
    # Resolved parallel.dp_mode: ddp | zero1 | zero2 | fsdp (fsdp over dp_replicate x dp_shard is HSDP).
    dp_mode: str = "fsdp"
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int | None = None, rank: int | None = None,
                    local_rank: int | None = None, local_world_size: int | None = None) -> "ParallelDims":
        # torchrun's environment is read here, once, and nowhere else.
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1 if world_size == 1 else world_size))
        cfg.validate()
        others = cfg.cp * cfg.tp * cfg.pp
        if world_size % others:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.cp*tp*pp={others}; "
                              f"change those degrees or the number of processes")
        dp_replicate, dp_shard, mode = cfg.dp_replicate, cfg.dp_shard, cfg.dp_mode
        if mode in ("ddp", "zero1"):
            # Replication only: every data-parallel rank is a replica (dp_replicate=1 means "all of them").
            dp_shard = 1
            if dp_replicate == 1:
                dp_replicate = world_size // others
        elif dp_shard == -1:
            if world_size % (dp_replicate * others):
                raise ConfigError(f"world size {world_size} is not divisible by "
                                  f"parallel.dp_replicate*cp*tp*pp={dp_replicate * others}; change "
                                  f"parallel.dp_replicate or the number of processes")
            dp_shard = world_size // (dp_replicate * others)
        total = dp_replicate * dp_shard * others
        if total != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x "
                f"tp={cfg.tp} x pp={cfg.pp} = {total}, but the world size is {world_size}; change "
                f"parallel.dp_shard (-1 takes what is left) or the number of processes")
        if mode == "auto":  # what a user means by "replicate 2" alone is plain data parallelism
            mode = "ddp" if dp_replicate > 1 and dp_shard == 1 else "fsdp"
        if cfg.ep > 1 and (dp_shard * cfg.cp) % cfg.ep:
            raise ConfigError(f"parallel.ep={cfg.ep} must divide dp_shard*cp={dp_shard * cfg.cp}")
        if cfg.ep > 1:
            # kiln/parallel/expert_parallel.py shards experts and routes tokens (tested against one
            # process), but `kiln train` does not apply it yet: per-rank experts would need to be
            # DTensors for checkpoints, and gradient clipping an ep-wide norm.
            raise ConfigError(f"parallel.ep={cfg.ep}: kiln train does not apply expert parallelism yet "
                              f"(kiln.parallel.expert_parallel is library-only); set parallel.ep=1")
        unsupported = [k for k in ("tp", "pp", "cp") if getattr(cfg, k) > 1]
        if unsupported:  # the mesh is built for them; the model-side plans land with their issues
            raise ConfigError(f"parallel.{unsupported[0]} > 1 is not supported yet; use data parallelism")
        return cls(dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size, rank, local_rank,
                   dp_mode=mode, local_world_size=local_world_size)

    @property
    def dp_mesh_names(self) -> tuple[str, ...]:
        """The mesh dimensions data parallelism runs over (replicate first), as built."""
        if self.mesh is None:
            return ()
        return tuple(n for n in ("dp_replicate", "dp_shard") if n in self.mesh.mesh_dim_names)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        names = self.dp_mesh_names
        return self.mesh[names]._flatten().get_local_rank() if len(names) > 1 \
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


def rank_label() -> str:
    """"[rank N] " inside a multi-process launch, "" otherwise: prefixes a failing rank's error line
    (before any ParallelDims exists, e.g. for a config error, so it reads torchrun's RANK itself)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""


def pick_device(name: str, dims: ParallelDims, device_count: int | None = None) -> torch.device:
    """The device of this rank. `cuda` / `auto` give local rank i the GPU `cuda:i`; more processes
    on a node than GPUs is a configuration error, not a CUDA crash (train.device=cpu runs them all
    on CPU with gloo). `device_count` is for tests; by default torch's count of visible GPUs."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if device_count is None else device_count
        if count == 0:
            raise ConfigError(f"train.device={name!r} but no CUDA device is available")
        if name == "cuda":
            if dims.local_world_size > count or dims.local_rank >= count:
                raise ConfigError(
                    f"{dims.local_world_size} processes on this node but {count} visible GPU(s): launch "
                    f"at most {count} per node (torchrun --nproc-per-node={count}) or set train.device=cpu")
            name = f"cuda:{dims.local_rank}"
        elif dims.world_size > 1:
            raise ConfigError(f"train.device={name!r} names one GPU for all {dims.world_size} processes; "
                              f"use train.device=cuda (one GPU per local rank) or auto")
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is not None and device.index >= count:
            raise ConfigError(f"train.device={name!r} but only {count} GPU(s) are visible")
        torch.cuda.set_device(device)
    return device
