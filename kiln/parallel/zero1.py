"""ZeRO-1 (`parallel.dp_mode = "zero1"`): the optimizer state partitioned over the data-parallel
replicas, in the forms kiln's trainer and DCP checkpoints need. kiln/parallel/data_parallel.py
`shard_optimizer_state` builds it (and re-exports these names).

torch's: torch.distributed.optim.ZeroRedundancyOptimizer (the per-rank step, the broadcasts of
the new values); DCP's ShardedTensor checkpoints. kiln's:
- the partition (kiln/parallel/zero1_partition.py `partition`, which kiln plan runs too): each
  rank an even share of the elements, not of whole tensors.
  torch's ZeRO gives whole tensors to ranks, largest first, so a tensor larger than a rank's even
  share (the embedding) leaves its rank above it however the others are filled: at 8 ranks
  configs/llama-1b.toml's embedding alone is 1.70 x the even share, at 64 ranks
  configs/llama-7b.toml's 1.24 x (benchmarks/zero1_partition.py). Where the update is elementwise
  (AdamW, SGD, Lion; Muon's AdamW groups) the step of a run of elements is that run of the
  step, so kiln cuts the parameters' concatenation into equal runs, as Megatron-LM's distributed
  optimizer does, and hands ZeRO one 1-D parameter aliasing each run. Updates that read a whole
  tensor (Muon's matrices, LAMB's trust ratio, Adafactor's factors) keep their tensors whole,
  placed first, largest first; the cut runs then fill the ranks to one level.
- a state_dict in the plain optimizer's format, per parameter (`Zero1Optimizer`), whose tensors
  hold only what this rank steps, as boxes of the parameters' global shapes
  (kiln/parallel/zero1_shards.py): each rank saves its own share, nothing is gathered (torch's
  ZeRO consolidates the whole state on one rank), and DCP reshards it, so a checkpoint resumes in
  any layout;
- the split for DTensor parameters: parallel.ep's experts stepped plainly, tensor parallel's
  shards through plain aliases; a tp shard whose update reads the whole tensor is stepped as its
  DTensor by its owner replica's tp ranks together (`ZeroRedundancyState.stepped_as`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from kiln.parallel.zero1_partition import partition
from kiln.parallel import zero1_shards
from kiln.parallel.zero1_shards import is_sharded, largest_local_numel, param_boxes


class ZeroRedundancyState(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer with kiln's partition, which loads a plain optimizer's state.

    The partition: `owner` maps id(param) -> rank (`Zero1Optimizer` passes the cut runs');
    without it, whole tensors largest first across every param group together (`partition` with
    nothing cut). torch's own goes group by group, so kiln's no-decay group (embeddings and norms)
    comes after the matrices are spread evenly and its embedding lands on top of a rank's even
    share (llama-1b at 8 ranks: 2.49 x the even share there, 1.70 x largest first).

    Loading takes a plain optimizer's dict keyed by FQNs or by positions (Zero1Optimizer hands it
    this rank's pieces' states); torch's own loader keeps this rank's partition. For saving,
    Zero1Optimizer reads this rank's state (`optim.state`) itself: nothing is consolidated.
    """

    def __init__(self, params, owner: dict[int, int] | None = None, stepped_as: dict[int, torch.Tensor] | None = None,
                 **kwargs):
        # read by _partition_parameters and _init_local_optimizer, which ZeroRedundancyOptimizer's init calls
        self._owner, self._stepped_as = owner, stepped_as or {}
        super().__init__(params, **kwargs)

    def _init_local_optimizer(self) -> None:
        """The local optimizer, as torch's, but over `stepped_as`'s tensors in place of the pieces it
        names: a tensor-parallel DTensor whose update reads the whole tensor (Muon, LAMB, Adafactor
        under zero1 x tp) is stepped as the DTensor, whose optimizer sums or gathers over tp (its
        owners on every tp coordinate step the same tensors: one partition of the same sizes),
        while torch's broadcasts still go through the plain alias of its local shard."""
        if not self._stepped_as:
            return super()._init_local_optimizer()
        groups = [{**g, "params": [self._stepped_as.get(id(p), p) for p in g["params"]]}
                  for g in self._partition_parameters()[self.rank]]
        self.optim = self._optim_constructor(groups, **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def _partition_parameters(self, params_per_rank=None):
        if params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)
        owner = self._owner
        if owner is None:
            tensors = [p for group in self.param_groups for p in group["params"]]
            runs = partition([p.numel() for p in tensors], [False] * len(tensors), self.world_size)
            owner = {id(p): run[0][2] for p, run in zip(tensors, runs)}
        per_group = [[[] for _ in range(self.world_size)] for _ in self.param_groups]
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                per_group[g][owner[id(p)]].append(p)
        self._partition_parameters_cache = [[] for _ in range(self.world_size)]
        for group, params_per_rank_of_group in zip(self.param_groups, per_group):
            self._partition_param_group(group, params_per_rank_of_group)
        return self._partition_parameters_cache

    def load_state_dict(self, state_dict: dict) -> None:
        # DCP hands over FQN-keyed state (a plain optimizer matches keys by their position in the
        # param groups); ZeRO looks states up by that position number, so translate to it.
        order = [key for group in state_dict["param_groups"] for key in group["params"]]
        position = {key: i for i, key in enumerate(order)}
        super().load_state_dict({
            "state": {position[key]: value for key, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": [position[k] for k in g["params"]]} for g in state_dict["param_groups"]],
        })
        for piece in [p for p in self.optim.state if id(p) in self._stepped_as]:  # torch's keys it by the piece
            self.optim.state[self._stepped_as[id(piece)]] = self.optim.state.pop(piece)


def _is_expert(p: torch.Tensor) -> bool:
    """parallel.ep's experts: the DTensors other than tensor parallel's dense shards, which live
    on the "tp" mesh alone (apply_tp); the experts' mesh is expert_parallel.py's ("edp", "ep"[, "tp"])."""
    return isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) != ("tp",)


def cuts_elementwise(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether `optimizer` updates `group`'s parameters element by element (so ZeRO-1 may cut them
    into runs): torch's AdamW, Adam and SGD, and kiln's optimizers where their `updates_elementwise`
    says so (Lion, Muon's AdamW groups; not Muon's orthogonalized matrices, LAMB or Adafactor)."""
    declared = getattr(optimizer, "updates_elementwise", None)
    if declared is not None:
        return bool(declared(group))
    return isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD))


class Zero1Optimizer(torch.optim.Optimizer):
    """kiln's ZeRO-1: `optimizer`'s param groups, hyper-parameters and class, with the dense
    parameters' state partitioned over `group` (`ZeroRedundancyState`, by `partition`) and
    parallel.ep's experts (`_is_expert`) stepped by a plain optimizer of the same class on every
    rank.

    What ZeRO steps (`_DenseParam`): a plain parameter as it is; a tensor-parallel DTensor's local
    shard through a plain parameter aliasing it (torch's ZeRO broadcasts `param.data`, and c10d
    collectives have no DTensor sharding rule: "c10d.broadcast_.default does not have a sharding
    strategy", torch 2.13); a tensor the partition cuts, one 1-D parameter per run aliasing its
    elements. Every rank of `group` holds the same tensors (the replicas of one tp coordinate), and
    only elementwise updates are cut or stepped by shard; a tp DTensor under another update is
    stepped as the DTensor (`_DenseParam.as_dtensor`).

    Why not ZeRO for the experts too: ZeRO steps each parameter on one rank of `group` and
    broadcasts it, but the ranks of `group` hold different experts (the ep ranks). The experts'
    replicas over "edp" get the same all-reduced gradients, so their plain steps stay identical;
    their state is divided by ep already (each rank holds E / ep experts), not further by edp.

    To the trainer, the LR schedule and DCP this is one optimizer over the original groups (in
    the original order): the schedule sets each group's lr here and `step` hands the
    hyper-parameters to both parts; `state_dict` is the plain optimizer's format (positions in these
    groups) holding this rank's share: a dense parameter's per-element state as the boxes of it
    this rank steps (`_DenseParam.sharded`; absent where it steps none), the experts' as DTensors.
    So each rank saves only what it holds, a checkpoint resumes in any layout, and a plain
    optimizer's state (whole tensors) loads here too. The split and the
    partition are kiln's; the stepping and broadcasting are torch's."""

    def __init__(self, optimizer: torch.optim.Optimizer, group, saved_alike: Iterable[torch.Tensor] = ()):
        zero1_shards.require("parallel.dp_mode='zero1'")
        kwargs, cls = _constructor_kwargs(optimizer), type(optimizer)
        groups = [dict(g) for g in optimizer.param_groups]
        dense = [(p, cuts_elementwise(optimizer, g)) for g in groups for p in g["params"] if not _is_expert(p)]
        # Every tp coordinate's group partitions the same sizes (a shard's largest local size over
        # tp), so a tensor replicated over tp is cut alike in each and DCP writes its boxes once;
        # `saved_alike` (a tied embedding's copies on the first and last pipeline stage, whose
        # state both save under one name) is cut evenly, the same in every stage's group.
        alike = {id(p) for p in saved_alike}
        runs = partition([largest_local_numel(p) for p, _ in dense],
                         [cut and _local(p).is_contiguous() for p, cut in dense], dist.get_world_size(group),
                         even=[id(p) in alike for p, _ in dense])
        self._rank = dist.get_rank(group)
        self._dense = [_DenseParam(p, _clipped(r, _local(p).numel()), group, elementwise)
                       for (p, elementwise), r in zip(dense, runs)]
        owner = {id(piece): rank for d in self._dense for piece, (_, _, rank) in zip(d.pieces, d.runs)}
        stepped_as = {id(d.pieces[0]): d.param for d in self._dense if d.as_dtensor}
        dense_groups, expert_groups = [], []
        # Per group: its index in the dense and/or the expert optimizer (absent: no such parameters);
        # per parameter in group order: ("dense", index in self._dense) or ("experts", position).
        self._group_index, self._where = [], []
        self._positions: list[list[int]] = []  # per dense parameter: its pieces' positions in ZeRO's groups
        records = iter(self._dense)
        pieces_so_far, experts_so_far = 0, 0
        for g in groups:
            pieces, experts = [], []
            for p in g["params"]:
                if _is_expert(p):
                    self._where.append(("experts", experts_so_far))
                    experts.append(p)
                    experts_so_far += 1
                    continue
                record = next(records)
                self._where.append(("dense", len(self._positions)))
                self._positions.append(list(range(pieces_so_far, pieces_so_far + len(record.pieces))))
                pieces += record.pieces
                pieces_so_far += len(record.pieces)
            index = {}
            for name, params, out in (("dense", pieces, dense_groups), ("experts", experts, expert_groups)):
                if params:
                    index[name] = len(out)
                    out.append({**g, "params": params})
            self._group_index.append(index)
        self._parts = {}
        if dense_groups:
            self._parts["dense"] = ZeroRedundancyState(dense_groups, owner=owner, stepped_as=stepped_as,
                                                       optimizer_class=cls, process_group=group, **kwargs)
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
        # DCP reads `state` only to tell "never stepped" (it then steps on zero gradients, a
        # collective here): a rank that steps none of the tensors (fewer whole tensors than ranks)
        # must not look never stepped while the others do not.
        merged = {**(self.dense.optim.state if self.dense else {}), **(self.experts.state if self.experts else {})}
        self.state = merged or {self.param_groups[0]["params"][0]: {}}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Zero1Optimizer.step takes no closure")
        self._push_hyperparameters()
        for record in self._dense:
            record.take_grad()
        for opt in self._parts.values():
            opt.step()
        for record in self._dense:
            record.drop_grads()
        self._refresh_state()

    def state_dict(self) -> dict:
        experts = self.experts.state_dict()["state"] if self.experts else {}
        own = self.dense.optim.state if self.dense else {}  # this rank's pieces' state, ZeRO's local optimizer's
        state = {}
        for k, (name, i) in enumerate(self._where):
            if name == "experts":
                if i in experts:
                    state[k] = experts[i]
                continue
            record = self._dense[i]
            pieces = [own.get(record.held(piece)) for piece, (_, _, r) in zip(record.pieces, record.runs)
                      if r == self._rank]
            if not pieces:  # stepped on other ranks: present and empty (torch's set_state_dict wants every
                state[k] = {}  # parameter's entry; DCP saves and loads nothing for it here)
            elif all(s is not None for s in pieces):
                state[k] = record.sharded(pieces)
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
            if key not in state_dict["state"]:
                continue
            value = state_dict["state"][key]
            if name == "experts":
                parts["experts"]["state"][i] = value
                continue
            for position, piece_state in zip(self._positions[i], self._dense[i].split(value, key)):
                if piece_state is not None:
                    parts["dense"]["state"][position] = piece_state
        for mine, saved, index in zip(self.param_groups, loaded, self._group_index):
            values = {k: v for k, v in saved.items() if k != "params"}
            mine.update(values)
            for name, i in index.items():
                parts[name]["param_groups"][i].update(values)
        for name, opt in self._parts.items():
            opt.load_state_dict(parts[name])
        self._refresh_state()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _clipped(runs: list[tuple[int, int, int]], numel: int) -> list[tuple[int, int, int]]:
    """`runs` of the largest shard's elements, within this shard's `numel` (a smaller last chunk)."""
    kept = [(a, min(b, numel), r) for a, b, r in runs if a < numel]
    return kept or [(0, 0, runs[0][2])]


class _DenseParam:
    """One dense parameter as ZeRO steps it (see Zero1Optimizer): `pieces`, one per run of
    `runs` ((start, end, rank) over its local flat elements): the parameter itself when it is
    plain and whole; else plain parameters aliasing its local tensor (a tp DTensor's shard), or,
    when cut, 1-D runs of it. The aliases are renewed every step (a checkpoint load may have
    replaced the local tensor) and take the same view of its gradient; except `as_dtensor`'s (a
    tp DTensor whose update is not elementwise): ZeRO's local optimizer steps the DTensor itself
    (`ZeroRedundancyState.stepped_as`), its state is DTensors, and the alias is only broadcast."""

    def __init__(self, param: torch.Tensor, runs: list[tuple[int, int, int]], group, elementwise: bool = True):
        self.param, self.runs, self.rank = param, runs, dist.get_rank(group)
        self.as_dtensor = isinstance(param, DTensor) and not elementwise
        with torch.no_grad():
            local = _local(param)
            self.shape = local.shape
            self.boxes = param_boxes(param, runs, group)
            if len(runs) == 1 and not isinstance(param, DTensor):
                self.pieces = [param]
            elif len(runs) == 1:
                self.pieces = [nn.Parameter(local, requires_grad=param.requires_grad)]
            else:
                flat = local.view(-1)
                self.pieces = [nn.Parameter(flat[a:b], requires_grad=param.requires_grad) for a, b, _ in runs]

    @property
    def cut(self) -> bool:
        return len(self.pieces) > 1

    def held(self, piece: torch.Tensor) -> torch.Tensor:
        """What ZeRO's local optimizer keys `piece`'s state by."""
        return self.param if self.as_dtensor else piece

    def take_grad(self) -> None:
        if self.pieces[0] is self.param:
            return
        if self.as_dtensor:  # the optimizer reads the DTensor's own gradient
            self.pieces[0].data = self.param.to_local()
            return
        with torch.no_grad():
            grad = self.param.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(self.param.placements):
                # e.g. a vocab-sharded embedding's gradient comes back replicated; a plain optimizer
                # would redistribute it inside its DTensor arithmetic (a local slice, no collective).
                grad = grad.redistribute(self.param.device_mesh, self.param.placements)
            local, grad = _local(self.param.data), None if grad is None else _local(grad)
            if not self.cut:
                self.pieces[0].data, self.pieces[0].grad = local, grad
                return
            flat, flat_grad = local.view(-1), None if grad is None else grad.reshape(-1)
            for piece, (a, b, _) in zip(self.pieces, self.runs):
                piece.data = flat[a:b]
                piece.grad = None if flat_grad is None else flat_grad[a:b]

    def drop_grads(self) -> None:
        if self.pieces[0] is not self.param:
            for piece in self.pieces:
                piece.grad = None

    def sharded(self, states: list[dict]) -> dict:
        """The state of the pieces this rank steps (`states`, in run order) as the parameter's: each
        per-element tensor a ShardedTensor of the parameter's global shape holding this rank's
        boxes of it (views, kiln/parallel/zero1_shards.py), the rest (Adam's step) the first
        piece's. Nothing is gathered: each rank saves its own share."""
        if self.as_dtensor:
            return dict(states[0])  # DTensors, which DCP saves and reshards as it does a plain tp optimizer's
        own = [(a, b) for a, b, r in self.runs if r == self.rank]
        state = dict(states[0])
        for k, v in states[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == own[0][1] - own[0][0] \
                    and (v.dim() == 1 if self.cut else v.shape == self.shape):
                state[k] = self.boxes.sharded([s[k] for s in states])
        return state

    def _local_of(self, value, name: str):
        """This rank's part of a saved state value: a DTensor's local shard; a whole tensor of a tp
        DTensor parameter's global shape (a plain optimizer's), cut like the parameter."""
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(self.param, DTensor) and isinstance(value, torch.Tensor) and not is_sharded(value) \
                and value.dim() > 0 and value.shape == self.param.shape != self.shape:
            return _placed_like(value, self.param, name).to_local()
        return value

    def split(self, state: dict, name: object = "") -> list[dict | None]:
        """A saved state of the parameter (`name`, its key in the loaded dict) as its pieces' (None
        for the runs another rank steps): from ShardedTensors (what `sharded` gave DCP to load
        into), this rank's boxes; from whole tensors (a plain optimizer's, a tp shard's DTensor),
        the runs copied out of them. Scalar tensors such as Adam's step are copied per piece (each
        piece steps its own). A cut parameter's optimizer is elementwise: every other state tensor
        must have the parameter's shape, else one line says which does not."""
        if self.as_dtensor:  # (checked on every rank: a refused load is refused everywhere)
            placed = {k: _placed_like(v, self.param, f"{name}.{k}") for k, v in state.items()}
            return [placed if self.runs[0][2] == self.rank else None]
        state = {k: self._local_of(v, f"{name}.{k}") for k, v in state.items()}
        runs = {k: iter(self.boxes.runs_of(v, f"{name}.{k}")) for k, v in state.items() if is_sharded(v)}
        for k, v in state.items():
            if k not in runs and isinstance(v, torch.Tensor) and v.dim() > 0 and self.cut and v.shape != self.shape:
                raise ValueError(f"optimizer state {name!r}, {k!r}: a tensor of shape {tuple(v.shape)}, expected "
                                 f"{tuple(self.shape)} (the parameter's) or a scalar")
        out = []
        for a, b, owner in self.runs:
            if owner != self.rank:
                out.append(None)
                continue
            piece = {}
            for k, v in state.items():
                if k in runs:
                    v = next(runs[k])
                    piece[k] = v if self.cut else v.view(self.shape)
                elif self.cut and isinstance(v, torch.Tensor) and v.dim() > 0:
                    piece[k] = v.reshape(-1)[a:b].clone()
                else:
                    piece[k] = v.clone() if isinstance(v, torch.Tensor) else v
            out.append(piece)
        return out


def _placed_like(value, param: DTensor, name: str):
    """A saved state value for the DTensor `param`'s optimizer: a DTensor as it is; a whole tensor
    (a plain optimizer's) cut like `param`, replicated where it has size 1 in a dim `param` is cut
    along (Adafactor's row and column statistics, as kiln's Adafactor places them); anything else as
    it is. A tensor of another shape is refused in one line."""
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value.clone() if isinstance(value, torch.Tensor) else value
    if value.dim() != param.dim() or any(v not in (1, p) for v, p in zip(value.shape, param.shape)):
        raise ValueError(f"optimizer state {name!r}: a tensor of shape {tuple(value.shape)}, expected "
                         f"{tuple(param.shape)} (the parameter's, or 1 in some dims) or a scalar")
    mesh, local, placements = param.device_mesh, value, []
    for m, placement in enumerate(param.placements):
        if placement.is_shard() and value.shape[placement.dim] == param.shape[placement.dim] > 1:
            chunks, c = local.chunk(mesh.size(m), dim=placement.dim), mesh.get_local_rank(m)
            local = chunks[c] if c < len(chunks) else local.narrow(placement.dim, 0, 0)  # torch.chunk's rule
            placements.append(placement)
        else:
            placements.append(Replicate())
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def _numbered(groups: list[dict]) -> list[dict]:
    """`groups` with each parameter replaced by its position over all of them (how torch's
    optimizers key their state in `state_dict`)."""
    out, start = [], 0
    for g in groups:
        n = len(g["params"])
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    return out


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The keyword arguments to build another `type(optimizer)` like it: ZeRO builds a new
    optimizer per rank from the class and keyword arguments; `defaults` can hold derived keys the
    constructor does not take (AdamW's decoupled_weight_decay), which the param groups carry anyway."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
