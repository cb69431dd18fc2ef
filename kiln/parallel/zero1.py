"""ZeRO-1 (`parallel.dp_mode = "zero1"`): the optimizer state partitioned over the data-parallel
replicas, in the forms kiln's trainer and DCP checkpoints need. kiln/parallel/data_parallel.py
`shard_optimizer_state` picks one (and re-exports these names).

torch's: torch.distributed.optim.ZeroRedundancyOptimizer (the per-rank step, the broadcasts of
the new values, state consolidation). kiln's: the partition of whole tensors over the ranks, largest
first across every param group (`ZeroRedundancyState._partition_parameters`), a state_dict every
rank can give DCP (`ZeroRedundancyState`) and the split for DTensor parameters
(`ZeroRedundancyExceptExperts`: parallel.ep's experts stepped plainly, tensor parallel's shards
through plain aliases).
"""

from __future__ import annotations

import heapq
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError


class ZeroRedundancyState(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose `state_dict()` works wherever a plain optimizer's does.

    torch's version returns the full state only on the rank it was consolidated to; DCP's
    `get_state_dict` asks every rank for the same full, FQN-keyed dict (it saves replicated
    tensors once and reshards on load). So the full state is consolidated to each rank in turn at
    save time (a transient full copy: ZeRO-1 saves memory in the step, not in the checkpoint).
    Loading takes the full dict DCP gives back; torch's own loader keeps this rank's partition.

    The partition is kiln's: torch assigns each param group's tensors largest first to the rank
    holding the fewest elements so far, group by group, so kiln's no-decay group (embeddings and
    norms) comes after the matrices are spread evenly and its embedding lands on top of a rank's
    even share (configs/llama-1b.toml, Llama 3.2 1B's shape, at 8 ranks: 2.49 x the even share of
    the state on that rank). Here the same greedy runs once over every group's tensors together,
    largest first (the embedding first, the matrices then fill the other ranks): 1.70 x there, the
    embedding alone, which no split into whole tensors can beat. Which rank steps which tensor
    changes nothing else (the step is per tensor); kiln/plan/memory.py `zero1_fullest_share`
    predicts the fullest rank from the same rule.
    """

    def _partition_parameters(self, params_per_rank=None):
        if params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)
        held = [(0, rank) for rank in range(self.world_size)]  # (elements, rank): ties to the lowest rank
        per_group = [[[] for _ in range(self.world_size)] for _ in self.param_groups]
        tensors = [(p.numel(), g, p) for g, group in enumerate(self.param_groups) for p in group["params"]]
        for numel, g, p in sorted(tensors, key=lambda t: -t[0]):  # stable: equal sizes keep their order
            elements, rank = heapq.heappop(held)
            heapq.heappush(held, (elements + numel, rank))
            per_group[g][rank].append(p)
        self._partition_parameters_cache = [[] for _ in range(self.world_size)]
        for group, params_per_rank_of_group in zip(self.param_groups, per_group):
            self._partition_param_group(group, params_per_rank_of_group)
        return self._partition_parameters_cache

    def step(self, closure=None):
        loss = super().step(closure)
        # DCP takes an empty `state` for "never stepped" and initializes it with a zero-gradient
        # step, which would decay momenta; the top-level state is only filled by load_state_dict,
        # so expose this rank's partition (state_dict() replaces it with the full state anyway).
        self.state = self.optim.state
        return loss

    def state_dict(self) -> dict:
        for rank in range(dist.get_world_size(self.process_group)):  # ranks within the group
            self.consolidate_state_dict(to=rank)
            if rank == self.rank:
                full = super().state_dict()
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        # DCP hands over FQN-keyed state (a plain optimizer matches keys by their position in the
        # param groups); ZeRO looks states up by that position number, so translate to it.
        order = [key for group in state_dict["param_groups"] for key in group["params"]]
        position = {key: i for i, key in enumerate(order)}
        super().load_state_dict({
            "state": {position[key]: value for key, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": [position[k] for k in g["params"]]} for g in state_dict["param_groups"]],
        })


def _is_expert(p: torch.Tensor) -> bool:
    """parallel.ep's experts: the DTensors other than tensor parallel's dense shards, which live
    on the "tp" mesh alone (apply_tp); the experts' mesh is expert_parallel.py's ("edp", "ep"[, "tp"])."""
    return isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) != ("tp",)


class ZeroRedundancyExceptExperts(torch.optim.Optimizer):
    """ZeRO-1 where some parameters are DTensors: `optimizer`'s param groups, hyper-parameters and
    class, with the dense parameters' state partitioned over `group` (`ZeroRedundancyState`) and
    the experts (parallel.ep's DTensors, `_is_expert`) stepped by a plain optimizer of the same
    class on every rank.

    Dense tensor-parallel DTensors: torch's ZeRO broadcasts `param.data`, and c10d collectives have
    no DTensor sharding rule ("c10d.broadcast_.default does not have a sharding strategy", torch
    2.13), so ZeRO steps a plain parameter aliasing each one's local shard (`_LocalShard`), with the
    local shard of its gradient: every rank of `group` holds the same shard (the replicas of one tp
    coordinate), and the optimizers kiln runs are elementwise (AdamW, SGD, Lion: the step of the
    shards is the shards of the step; Muon/LAMB take whole-matrix norms and are not elementwise).

    Why not ZeRO for the experts too: ZeRO steps each parameter on one rank of `group` and
    broadcasts it, but the ranks of `group` hold different experts (the ep ranks). The experts'
    replicas over "edp" get the same all-reduced gradients, so their plain steps stay identical;
    their state is divided by ep already (each rank holds E / ep experts), not further by edp.

    To the trainer, the LR schedule and DCP this is one optimizer over the original groups (in
    the original order): the schedule sets each group's lr here and `step` hands the
    hyper-parameters to both parts; `state_dict` is the plain optimizer's format (positions in these
    groups; the dense state consolidated as ZeroRedundancyState does, a tp shard's state as a
    DTensor like its parameter's, the experts' as DTensors), so a checkpoint resumes in any layout
    and a plain optimizer's resumes here. The split is kiln's; the partitioning, stepping and
    broadcasting are torch's."""

    def __init__(self, optimizer: torch.optim.Optimizer, group):
        kwargs, cls = _constructor_kwargs(optimizer), type(optimizer)
        groups = [dict(g) for g in optimizer.param_groups]
        dense_groups, expert_groups = [], []
        # Per group: its index in the dense and/or the expert optimizer (absent: no such parameters);
        # per parameter in group order: ("dense" | "experts", its position in that optimizer).
        self._group_index, self._where = [], []
        self._shards: list[_LocalShard | None] = []  # per dense position: its DTensor's local shard
        counts = {"dense": 0, "experts": 0}
        for g in groups:
            parts = {"dense": [p for p in g["params"] if not _is_expert(p)],
                     "experts": [p for p in g["params"] if _is_expert(p)]}
            shards = [_LocalShard(p) if isinstance(p, DTensor) else None for p in parts["dense"]]
            self._shards += shards
            parts["dense"] = [p if s is None else s.local for p, s in zip(parts["dense"], shards)]
            index = {}
            for name, out in (("dense", dense_groups), ("experts", expert_groups)):
                if parts[name]:
                    index[name] = len(out)
                    out.append({**g, "params": parts[name]})
            self._group_index.append(index)
            for p in g["params"]:
                name = "experts" if _is_expert(p) else "dense"
                self._where.append((name, counts[name]))
                counts[name] += 1
        self._parts = {}
        if dense_groups:
            self._parts["dense"] = ZeroRedundancyState(dense_groups, optimizer_class=cls, process_group=group, **kwargs)
        if expert_groups:
            self._parts["experts"] = cls(expert_groups, **kwargs)
        super().__init__(groups, optimizer.defaults)

    @property
    def dense(self):
        return self._parts.get("dense")

    @property
    def experts(self):
        return self._parts.get("experts")

    def _push_hyperparameters(self) -> None:
        for mine, index in zip(self.param_groups, self._group_index):
            values = {k: v for k, v in mine.items() if k != "params"}
            for name, i in index.items():
                self._parts[name].param_groups[i].update(values)

    def _refresh_state(self) -> None:
        # DCP reads `state` only to tell "never stepped" (it then steps on zero gradients).
        self.state = {**(self.dense.optim.state if self.dense else {}), **(self.experts.state if self.experts else {})}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroRedundancyExceptExperts.step takes no closure")
        self._push_hyperparameters()
        for shard in self._shards:
            if shard is not None:
                shard.take_grad()
        for opt in self._parts.values():
            opt.step()
        for shard in self._shards:
            if shard is not None:
                shard.local.grad = None
        self._refresh_state()

    def state_dict(self) -> dict:
        parts = {name: opt.state_dict()["state"] for name, opt in self._parts.items()}
        if "dense" in parts:  # a tp shard's state tensors as DTensors placed like its parameter
            parts["dense"] = {i: v if self._shards[i] is None else self._shards[i].to_dtensors(v)
                              for i, v in parts["dense"].items()}
        state = {k: parts[name][i] for k, (name, i) in enumerate(self._where) if i in parts[name]}
        return {"state": state, "param_groups": _numbered(self.param_groups)}

    def load_state_dict(self, state_dict: dict) -> None:
        # Keyed by positions (a plain optimizer's dict) or by FQNs (what DCP hands over), the
        # saved groups in the order and with the sizes of these groups.
        loaded = state_dict["param_groups"]
        if [len(g["params"]) for g in loaded] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"optimizer state has param groups of sizes {[len(g['params']) for g in loaded]}, "
                             f"this optimizer {[len(g['params']) for g in self.param_groups]}")
        keys = [key for g in loaded for key in g["params"]]
        parts = {name: {"state": {}, "param_groups": _numbered(opt.param_groups)} for name, opt in self._parts.items()}
        for key, (name, i) in zip(keys, self._where):
            if key in state_dict["state"]:
                value = state_dict["state"][key]
                if name == "dense" and self._shards[i] is not None:
                    value = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in value.items()}
                parts[name]["state"][i] = value
        for mine, saved, index in zip(self.param_groups, loaded, self._group_index):
            values = {k: v for k, v in saved.items() if k != "params"}
            mine.update(values)
            for name, i in index.items():
                parts[name]["param_groups"][i].update(values)
        for name, opt in self._parts.items():
            opt.load_state_dict(parts[name])
        self._refresh_state()


class _LocalShard:
    """A plain parameter sharing the storage of a DTensor parameter's local shard, for torch's
    ZeroRedundancyOptimizer (see ZeroRedundancyExceptExperts)."""

    def __init__(self, param: DTensor):
        self.param = param
        with torch.no_grad():
            self.local = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)

    def take_grad(self) -> None:
        # Re-aliased every step: a load into the parameter may have replaced its local tensor.
        with torch.no_grad():
            self.local.data = self.param.to_local()
        grad = self.param.grad
        if grad is not None and tuple(grad.placements) != tuple(self.param.placements):
            # e.g. a vocab-sharded embedding's gradient comes back replicated; a plain optimizer
            # would redistribute it inside its DTensor arithmetic (a local slice, no collective).
            grad = grad.redistribute(self.param.device_mesh, self.param.placements)
        self.local.grad = None if grad is None else grad.to_local()

    def to_dtensors(self, state: dict) -> dict:
        shape = self.local.shape
        return {k: DTensor.from_local(v, self.param.device_mesh, self.param.placements, run_check=False,
                                      shape=self.param.shape, stride=self.param.stride())
                if isinstance(v, torch.Tensor) and v.shape == shape and v.dim() > 0 else v
                for k, v in state.items()}


def _numbered(groups: list[dict]) -> list[dict]:
    """`groups` with each parameter replaced by its position over all of them (how torch's
    optimizers key their state in `state_dict`)."""
    out, start = [], 0
    for g in groups:
        n = len(g["params"])
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    return out


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """ZeRO-1 steps a tp-sharded parameter's local shard (ZeroRedundancyExceptExperts), which is
    the shard of the whole step only for elementwise updates; LAMB's trust ratio and Muon's
    orthogonalization take whole-matrix norms, Adafactor row and column statistics."""
    from kiln.train.optimizers import Lion

    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, Lion)):
        raise ConfigError(f"parallel.dp_mode='zero1' with parallel.tp > 1 steps each rank's tensor-parallel "
                          f"shard alone, which {type(optimizer).__name__} cannot (not elementwise); use "
                          f"optim.name='adamw', 'lion' or 'sgd', or parallel.dp_mode='ddp' or 'fsdp'")


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The keyword arguments to build another `type(optimizer)` like it: ZeRO builds a new
    optimizer per rank from the class and keyword arguments; `defaults` can hold derived keys the
    constructor does not take (AdamW's decoupled_weight_decay), which the param groups carry anyway."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
