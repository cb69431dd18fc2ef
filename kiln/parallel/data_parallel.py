"""Data parallelism beyond FSDP2: DDP replication, ZeRO-1 optimizer-state sharding, and the
per-step metrics that need every rank.

Which torch API does what (nothing here is a hand-written collective):
  ddp   -> torch.distributed._composable.replicate (DistributedDataParallel, applied in place so
           parameter names, `model.layers` and checkpoints keep the plain model's FQNs; DDP is
           built at the first forward, after the meta-device model is materialized)
  ddp under pp -> torch.nn.parallel.DistributedDataParallel around each stage chunk
           (`replicate_stage`), the wrapper torch.distributed.pipelining recognizes: it runs
           every forward and all but the last backward of a step under `no_sync`, so gradients
           are all-reduced once per step and chunk, not once per micro-batch
  ddp under pp with a zero-bubble schedule -> no wrapper (`SplitBackwardReplicas`): DDP's
           start-of-training broadcast (torch.distributed.utils._sync_module_states, the call
           DDP's constructor makes), then one bucketed torch.distributed.all_reduce of the
           gradients after the schedule's step; under parallel.ep both leave the experts out, as
           the per-stage DDP does (`leave_experts_to_expert_parallel`)
  ddp with parallel.tp (pp = 1) -> kiln's `OverlappedReplicas`, as torch's DDP swaps tp's DTensor
           parameters for local tensors outside forward: torch's start-of-training broadcast of
           the local shards over the dp (x cp) replicas, then per 25 MB bucket one
           torch.distributed.all_reduce of the local gradient shards, started by post-accumulate-
           grad hooks in the backward of each step's last micro-batch (overlapping it) and waited
           for at the end of that backward; the zero-bubble `SplitBackwardReplicas` shares the core
           (`Replicas`). Under parallel.ep the experts are left to expert parallelism as above
  zero1 -> ddp + torch.distributed.optim.ZeroRedundancyOptimizer (each rank keeps and steps the
           optimizer state of its partition of the parameters, then broadcasts the new values)
  zero1 with parallel.ep and/or parallel.tp -> ZeroRedundancyOptimizer over the dense parameters
           (a tp DTensor through a plain parameter aliasing its local shard: torch's ZeRO cannot
           broadcast DTensors) and a plain optimizer of the same class over the experts
           (`ZeroRedundancyExceptExperts`, kiln's split; its state_dict holds DTensors)
  zero2 / fsdp / hsdp -> FSDP2 `fully_shard` in kiln/parallel/parallelize.py
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError
from kiln.model.moe import MoE
from kiln.parallel.dims import ParallelDims


def grad_mesh(dims: ParallelDims):
    """The 1-D mesh gradients are averaged over (data parallel x cp, flattened); under pp it is
    sliced from this rank's pipeline stage, so its ranks are the replicas of the same stage."""
    mesh = dims.mesh[dims.grad_mesh_names]
    return mesh._flatten() if mesh.ndim > 1 else mesh


def apply_ddp(model: nn.Module, dims: ParallelDims, grad_accum: int = 1) -> None:
    """Replicate `model` over the data-parallel mesh: gradients are all-reduced (averaged) in
    buckets during backward, overlapping with it. Under tp kiln's `OverlappedReplicas` (kept as
    `model.replicas`), the all-reduce in the backward of every `grad_accum`-th forward."""
    from torch.distributed._composable.replicate import replicate

    if dims.tp > 1:
        model.replicas = OverlappedReplicas(model, dims, grad_accum)
        return
    mesh = grad_mesh(dims)
    # Under parallel.ep the experts are DTensors reduced by kiln/parallel/expert_parallel.py.
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)] if dims.ep > 1 else None
    if experts:
        # By its group: given a mesh sliced from a bigger one (dp x cp), DDP turns every DTensor
        # parameter into a local tensor (its DDP + TP workaround), ignored modules included,
        # which would cut the experts off from their gradients.
        replicate(model, process_group=mesh.get_group(), bucket_cap_mb=25, ignored_modules=experts)
        return
    replicate(model, device_mesh=mesh, bucket_cap_mb=25, ignored_modules=experts)


def replicate_stage(chunk: nn.Module, dims: ParallelDims) -> nn.Module:
    """DDP around one pipeline stage chunk (materialized: DDP broadcasts and buckets real
    tensors), for `PipelineStage` to run. torch's stage (pipelining/stage.py,
    `forward_maybe_with_nosync` / `backward_maybe_with_nosync`: run in 2.13; older copies in
    public code have the same DDP branches) knows this class, not composable `replicate`: forwards and all but the last backward of a step
    run under `no_sync`, the last backward re-arms the reducer, so each chunk's gradients (summed
    over the micro-batches) are all-reduced once per step. The wrapper only sits in the schedule;
    the chunk's parameters are still the `PipelineModel`'s under their own names (checkpoints
    and the optimizer see no `module.` prefix). A chunk holds no buffers (the RoPE tables are the
    PipelineModel's), so DDP's buffer sync has nothing to send."""
    from torch.nn.parallel import DistributedDataParallel

    if dims.ep > 1:
        leave_experts_to_expert_parallel(chunk)
    return DistributedDataParallel(chunk, process_group=grad_mesh(dims).get_group(), bucket_cap_mb=25)


def leave_experts_to_expert_parallel(chunk: nn.Module) -> set[str]:
    """Under parallel.ep, the replication of a stage chunk (DDP's, or `SplitBackwardReplicas`')
    must not take the experts: they differ between the ep ranks of its group, and
    kiln/parallel/expert_parallel.py already sums their gradients over their replicas ("edp") in
    backward, as without pp (`apply_ddp`'s ignored_modules). torch's way to leave parameters out of
    the class wrapper: their FQNs in the chunk, set before construction
    (`_set_params_and_buffers_to_ignore_for_model`, what DDP reads in its constructor). Returns
    those FQNs, which SplitBackwardReplicas leaves out of its broadcast and average alike."""
    from torch.nn.parallel import DistributedDataParallel

    experts = _expert_params(chunk)
    names = [name for name, p in chunk.named_parameters() if id(p) in experts]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(chunk, names)
    return set(names)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard (an alias, no copy), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_params(module: nn.Module) -> set[int]:
    return {id(p) for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()}


class Replicas:
    """Data-parallel replicas that kiln synchronizes itself, on the local tensors of each parameter
    (a tensor-parallel DTensor's shard: the replicas of one tp coordinate hold the same shard, so
    broadcasting and averaging the shards over `group` is DDP on the whole parameter).

    What is torch's: DDP's own start (`_verify_param_shape_across_processes`, then
    `_sync_params_and_buffers`: the group's first rank broadcasts in 250 MB coalesced buckets),
    `_flatten_dense_tensors` / `_unflatten_dense_tensors` and the `all_reduce` collective. What is
    kiln's: the bucket plan (consecutive parameters of one dtype and device, up to `bucket_cap_mb`,
    as DDP's default 25 MB) and the pre-division by the group size before a SUM (DDP's
    allreduce_hook; gloo has no AVG). Buckets are in flight at once (async) and copied back as they
    complete: one transient flat copy of the gradients, where DDP keeps its buckets for the run."""

    BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size

    def __init__(self, group, bucket_cap_mb: float = 25):
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.params: list[nn.Parameter] = []
        self.buckets: list[list[nn.Parameter]] = []
        self._inflight: dict[int, tuple] = {}

    def _setup(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        from torch.distributed.utils import _sync_params_and_buffers, _verify_param_shape_across_processes

        self.size = dist.get_world_size(self.group)
        states = [_local(t.detach()) for t in params + buffers]  # in place, as DDP's (detached) broadcast
        _verify_param_shape_across_processes(self.group, states)
        _sync_params_and_buffers(self.group, states, self.BROADCAST_BUCKET_BYTES, 0)
        self.params = [p for p in params if p.requires_grad]
        self.buckets = []  # the same plan on every replica: same model
        cap, size, key = self.bucket_cap_mb * 1024 * 1024, 0.0, None
        for p in self.params:
            nbytes = _local(p).numel() * p.element_size()
            if not self.buckets or (p.dtype, p.device) != key or size + nbytes > cap:
                self.buckets.append([])
                size, key = 0.0, (p.dtype, p.device)
            self.buckets[-1].append(p)
            size += nbytes

    def _launch(self, index: int) -> None:
        """Start bucket `index`'s all-reduce. A parameter that got no gradient on this rank takes
        part with zeros, so every replica sends the same buckets and ends with the same gradient."""
        from torch._utils import _flatten_dense_tensors

        grads = []
        for p in self.buckets[index]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        flat = _flatten_dense_tensors(grads).div_(self.size)
        self._inflight[index] = (grads, flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def _wait_all(self) -> None:
        from torch._utils import _unflatten_dense_tensors

        for index in range(len(self.buckets)):
            if index not in self._inflight:
                self._launch(index)
        for grads, flat, work in self._inflight.values():
            work.wait()
            for grad, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(mean)
        self._inflight = {}

    def average(self) -> None:
        """Replace every parameter's gradient by its mean over the replicas."""
        self._wait_all()


class SplitBackwardReplicas(Replicas):
    """Data-parallel replicas of a rank's stage chunks for the zero-bubble schedules, where DDP's
    gradient all-reduce cannot run: built once the chunks are materialized, then `average()`
    once per step, after the schedule's step and before clipping.

    Why not DDP: its reducer all-reduces a bucket when the autograd hooks on the parameters'
    AccumulateGrad nodes have fired for all of it. torch's weight pass (pipelining/_backward.py
    stage_backward_weight, every stage but the first) computes the weight gradients with
    `autograd.grad` and adds them to `.grad` itself: no AccumulateGrad runs, no hook fires, and
    the reducer has no public call to reduce its buckets afterwards. (torch's other replicate,
    `_composable.replicate_with_fsdp`, has a manual post-backward that torch's REDUCE_GRAD
    action calls, but it turns every parameter into a DTensor: another parameter type for the
    optimizer, ZeroRedundancyOptimizer's broadcasts (zero1) and the checkpoints than every
    other ddp layout has; not tried.) Unlike DDP nothing overlaps the backward: the gradients
    are final only at the schedule's end (its REDUCE_GRAD step per stage).

    Under parallel.ep the experts are neither broadcast nor averaged (the rule DDP follows here,
    `leave_experts_to_expert_parallel`): they differ between the ep ranks of the group, and their
    gradients are reduced by expert_parallel.py's hook on each forward's local slice, which fires
    in the weight pass too (`autograd.grad` runs tensor hooks; tests/parallel/test_expert_replicated.py)."""

    def __init__(self, chunks: list[nn.Module], dims: ParallelDims, bucket_cap_mb: float = 25):
        super().__init__(grad_mesh(dims).get_group(), bucket_cap_mb)
        seen: set[int] = set()
        params, buffers = [], []
        for chunk in chunks:  # DDP's constructor, per chunk as replicate_stage's DDP would do it
            ignored = leave_experts_to_expert_parallel(chunk) if dims.ep > 1 else set()
            params += [p for name, p in chunk.named_parameters()
                       if name not in ignored and not (id(p) in seen or seen.add(id(p)))]
            buffers += [b for name, b in chunk.named_buffers() if name not in ignored]
        self._setup(params, buffers)


class OverlappedReplicas(Replicas):
    """ddp/zero1 with tensor parallelism (pp = 1): DDP over the dp (x cp) replicas of each tp
    coordinate, on the local shards of the DTensor parameters.

    Why not torch's: DDP (and composable `replicate`) given a mesh sliced from a 2-D one swaps the
    DTensor parameters for plain local tensors outside forward (torch.distributed.tensor.parallel
    .ddp `_pre_dp_module_transform`, "a temporary work around ... state_dict" in DDP's
    constructor): the optimizer, the tp-wide grad norm and DCP checkpoints would see unsharded
    plain tensors of the wrong shape. The FSDP2-based `replicate_with_fsdp` takes only a 1-D mesh
    and makes its own DTensors. So kiln's `Replicas`, the parameters staying DTensors.

    Built at the model's first forward (after the meta-device model is materialized, as DDP is):
    the start-of-training broadcast, then a post-accumulate-grad hook per parameter. In the
    backward of the step's last micro-batch (every `grad_accum`-th forward with autograd on and
    the model in training mode; evaluation runs without grad) a bucket's all-reduce starts as
    soon as all its gradients are final, overlapping the rest of the backward; a callback at the
    end of that backward (the autograd engine's `queue_callback`, as DDP's reducer does) starts
    the buckets still waiting (parameters without a gradient) and waits for all. Earlier
    micro-batches only accumulate: one all-reduce per step, as DDP's `no_sync`. Under
    parallel.ep the experts are left to expert_parallel.py (as `apply_ddp`'s ignored_modules)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, grad_accum: int, bucket_cap_mb: float = 25):
        super().__init__(grad_mesh(dims).get_group(), bucket_cap_mb)
        self.grad_accum, self.forwards, self.armed, self.built = grad_accum, 0, False, False
        self.leave_experts = dims.ep > 1
        self._callback_queued = False
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, model: nn.Module, args) -> None:
        if not self.built:
            self._build(model)
        if torch.is_grad_enabled() and model.training:
            self.forwards += 1
            self.armed = self.forwards % self.grad_accum == 0

    def _build(self, model: nn.Module) -> None:
        experts = _expert_params(model) if self.leave_experts else set()
        params = [p for p in model.parameters() if id(p) not in experts]
        # Buffers (the RoPE tables) are computed alike on every rank; DDP broadcasts them anyway.
        self._setup(params, [b for b in model.buffers()])
        self._waiting = [set() for _ in self.buckets]
        for index, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._hook(index))
        self.built = True

    def _hook(self, index: int):
        def ready(p: torch.Tensor) -> None:
            if not self.armed:
                return
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
                self._waiting = [{id(q) for q in bucket} for bucket in self.buckets]
            self._waiting[index].discard(id(p))
            if not self._waiting[index] and index not in self._inflight:
                self._launch(index)
        return ready

    def _finish(self) -> None:
        self._wait_all()
        self._callback_queued, self.armed = False, False


class ZeroRedundancyState(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose `state_dict()` works wherever a plain optimizer's does.

    torch's version returns the full state only on the rank it was consolidated to; DCP's
    `get_state_dict` asks every rank for the same full, FQN-keyed dict (it saves replicated
    tensors once and reshards on load). So the full state is consolidated to each rank in turn at
    save time (a transient full copy: ZeRO-1 saves memory in the step, not in the checkpoint).
    Loading takes the full dict DCP gives back; torch's own loader keeps this rank's partition.
    """

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


def shard_optimizer_state(optimizer: torch.optim.Optimizer, dims: ParallelDims) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer (class, param groups, hyper-parameters) with its state
    partitioned over the data-parallel ranks (under parallel.ep the dense parameters' state only,
    `ZeroRedundancyExceptExperts`). Returns `optimizer` itself unless dp_mode is zero1."""
    if dims.dp_mode != "zero1" or dims.dp_size * dims.cp == 1:
        return optimizer
    group = grad_mesh(dims).get_group()  # under pp: this stage's replicas, over its parameters
    groups = [dict(g) for g in optimizer.param_groups]
    if any(isinstance(p, DTensor) and not _is_expert(p) for g in groups for p in g["params"]):
        _check_elementwise(optimizer)
    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):  # parallel.ep's experts, tp's shards
        return ZeroRedundancyExceptExperts(optimizer, group)
    return ZeroRedundancyState(groups, optimizer_class=type(optimizer), process_group=group,
                               **_constructor_kwargs(optimizer))


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


def window_stats_over_ranks(window_s: float, memory_mb: float, device: torch.device) -> dict[str, float]:
    """One all-gather per metrics window (not per step): the slowest rank's time for the window
    (the job steps as fast as its slowest rank) and memory per rank (max and min). The caller has
    already waited for its device (the fetch of the window's losses), so the time is compute's."""
    row = torch.tensor([window_s, memory_mb], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"window_s": window_s, "memory_mb": memory_mb, "memory_mb_min": memory_mb}
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    table = torch.stack(rows).cpu()
    return {"window_s": table[:, 0].max().item(), "memory_mb": table[:, 1].max().item(),
            "memory_mb_min": table[:, 1].min().item()}


def sum_over_ranks(value: float, device: torch.device) -> float:
    """Sum of a per-rank number (e.g. each rank's peak FLOP/s, for MFU of the whole job)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()
