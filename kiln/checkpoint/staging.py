"""The snapshot half of an asynchronous save (CheckFreq's snapshot/persist split).

`dcp.async_save` asks its stager for a copy of the state that training can no longer change; the
loop blocks only for that copy. DCP's stock stager allocates new host tensors on every save unless
asked to cache them, and its cache is always pinned (which needs CUDA). `ReusedStaging` allocates
the host copy once (`torch.distributed._state_dict_utils._create_cpu_state_dict`, pinned when the
state is on a GPU so device-to-host copies are DMA) and copies into it on each save (`_copy_state_dict`);
it rebuilds the buffers when the state's structure changes (e.g. optimizer state appearing after
the first step). The buffers are reused only after the previous save finished writing them: the
manager keeps at most one save in flight. Cost: one copy of the state in host memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from kiln.parallel import zero1_shards


def owned_state(state_dict: dict[str, Any], group, memo: dict | None = None) -> dict[str, Any]:
    """`state_dict` without the tensors another rank of `group` writes: DCP's own choice
    (`dedup_save_plans` over every rank's local plan, the call its global planning makes, so the
    same rank writes each tensor as without this) taken before the staging copy. A tensor leaves
    only when every chunk of it this rank holds is written elsewhere; other values stay (DCP
    dedups them itself). A collective over `group`: every rank calls it with its state; the
    group's first rank gathers the plans and sends each rank the names it drops (what DCP's own
    planning moves; no rank receives the others' plans). `memo` (a dict kept between saves) skips
    that exchange while no rank's plan changed: one all-reduce of a flag instead."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=False)
    local = planner.create_local_plan()
    signature = hashlib.sha256(repr(local.items).encode()).digest()
    memo = {} if memo is None else memo
    changed = torch.tensor([int(memo.get("signature") != signature)])
    dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=group)
    if changed.item():  # as DCP plans: the coordinator gathers the plans, each rank gets its answer
        world, coordinator = dist.get_world_size(group), dist.get_global_rank(group, 0)
        first = dist.get_rank(group) == 0
        plans: list[Any] | None = [None] * world if first else None
        dist.gather_object(type(local)(local.items), plans, dst=coordinator, group=group)
        answers = None
        if first:  # each plan's tensors before deduplicating: torch 2.6's dedup_save_plans replaces them in place
            tensors = [_tensors(plan) for plan in plans]
            answers = [held - _tensors(kept) for held, kept in zip(tensors, dedup_save_plans(plans))]
        received: list[Any] = [None]
        dist.scatter_object_list(received, answers, src=coordinator, group=group)
        memo.update(signature=signature, dropped=received[0])
    dropped = memo["dropped"]
    return _without(state_dict, [planner.mappings.get(fqn, (fqn,)) for fqn in dropped]) if dropped else state_dict


def _tensors(plan) -> set[str]:
    """The names of the tensors a save plan writes (any chunk of them)."""
    return {item.index.fqn for item in plan.items if item.type != WriteItemType.BYTE_IO}


def _without(obj: Any, paths: list[tuple]) -> Any:
    """`obj` with the leaves at `paths` (DCP's flattening paths: dict keys as str) removed; the
    dicts on the way are copied, never changed. A leaf inside a list stays (removing it would
    shift its neighbours' indices)."""
    if not isinstance(obj, Mapping):
        return obj
    by_head: dict[str, list[tuple]] = {}
    for path in paths:
        by_head.setdefault(str(path[0]), []).append(path[1:])
    out = {}
    for key, value in obj.items():
        rest = by_head.get(str(key))
        if rest is None:
            out[key] = value
        elif not all(rest):  # this key is a dropped leaf
            continue
        else:
            out[key] = _without(value, rest)
    return out


class ReusedStaging:
    def __init__(self, group=None):
        self._buffers: dict[str, Any] | None = None
        self._last: dict[str, Any] | None = None
        self.group = group  # the checkpoint's process group: stage only this rank's writes (owned_state)
        self._owners: dict = {}  # owned_state's memo

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.group is not None:
            state_dict = owned_state(state_dict, self.group, self._owners)
        # ZeRO-1's shares of optimizer state (ShardedTensors) are staged as their local tensors and
        # rewrapped: torch 2.6 stages a ShardedTensor by reference (the loop would change the copy)
        plain, staged = zero1_shards.unwrap(state_dict), None
        if self._buffers is not None:
            try:
                staged = self._copy(plain)
            except Exception:  # structure or shapes changed: allocate anew (CompanionMismatch, copy_ errors)
                self._buffers = None
        if staged is None:
            self._buffers = _create_cpu_state_dict(plain, pin_memory=self._from_gpu(plain))
            staged = self._copy(plain)
        self._last = zero1_shards.rewrap(staged, state_dict)
        return self._last

    @staticmethod
    def _from_gpu(state_dict: dict[str, Any]) -> bool:
        """Whether the state holds GPU tensors: only then pinned buffers and non-blocking copies pay
        (pinning initializes CUDA, which a CPU run on a GPU machine must not do)."""
        stack = [state_dict]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, torch.Tensor):
                if value.device.type == "cuda":
                    return True
        return False

    @property
    def last(self) -> dict[str, Any] | None:
        """The most recent snapshot (valid until the next stage call)."""
        return self._last

    def _copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # One intra-op thread: these copies are memory-bound, and on a busy machine each of the
        # hundreds of OpenMP regions waits for a descheduled worker (120 MB of state: 1-6 s with
        # 2 threads vs 0.02-0.2 s with 1 on the shared 2-core test machine).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            from_gpu = self._from_gpu(state_dict)
            staged = _copy_state_dict(state_dict, self._buffers, non_blocking=from_gpu)
            if from_gpu:
                torch.cuda.synchronize()  # the copies must land before the loop changes the weights
        finally:
            torch.set_num_threads(threads)
        return staged

    @property
    def nbytes(self) -> int:
        total = 0
        stack = [self._buffers]
        while stack:
            obj = stack.pop()
            if isinstance(obj, DTensor):  # its local shard (numel is the global shape's)
                obj = obj.to_local()
            if isinstance(obj, torch.Tensor):
                total += obj.numel() * obj.element_size()
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
        return total


class StagingFileSystemWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (it is also DCP's stager) with the staging copy into reused buffers."""

    def __init__(self, path: str, staging: ReusedStaging):
        super().__init__(path)
        self._staging = staging

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._staging.stage(state_dict)
