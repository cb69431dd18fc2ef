"""Data parallelism beyond FSDP2: DDP replication, ZeRO-1 optimizer-state sharding (its optimizer
classes in kiln/parallel/zero1.py), and the per-step metrics that need every rank.

Which torch API does what (nothing here is a hand-written collective):
  ddp   -> torch.distributed._composable.replicate (DistributedDataParallel, applied in place so
           parameter names, `model.layers` and checkpoints keep the plain model's FQNs; DDP is
           built at the first forward, after the meta-device model is materialized; its
           `gradient_as_bucket_view`: the gradients live in the all-reduce buckets, not copied
           into them, one gradient-sized buffer less per rank); with
           train.grad_accum > 1 its `set_requires_gradient_sync` lets only the step's last
           micro-batch all-reduce (`sync_on_last_micro_batch`), as DDP's no_sync
  hsdp  -> FSDP2 over (dp_replicate, dp_shard) (kiln/parallel/parallelize.py apply_fsdp); with
           grad_accum > 1 every micro-batch reduce-scatters inside its replica (gradients stay
           sharded) and only the last all-reduces across the replicas (`set_requires_all_reduce`)
  ddp under pp -> torch.nn.parallel.DistributedDataParallel around each stage chunk
           (`replicate_stage`), the wrapper torch.distributed.pipelining recognizes: it runs
           every forward and all but the last backward of a step under `no_sync`, so gradients
           are all-reduced once per step and chunk, not once per micro-batch
  ddp under pp with a zero-bubble schedule -> no wrapper (`SplitBackwardReplicas`): DDP's
           start-of-training broadcast (torch.distributed.utils._sync_module_states, the call
           DDP's constructor makes), then one bucketed torch.distributed.all_reduce of the
           gradients after the schedule's step; under parallel.ep both leave the experts out, as
           the per-stage DDP does (`leave_experts_to_expert_parallel`)
  ddp/zero1 under pp with parallel.tp (any schedule) -> `SplitBackwardReplicas` over all the
           rank's stage chunks, on the local tp shards (torch's DDP cannot take the DTensors):
           one all-reduce per step after the schedule, so it cannot fire per micro-batch, but
           it does not overlap the backward either (zero1: Zero1Optimizer as below)
  ddp with parallel.tp (pp = 1) -> kiln's `OverlappedReplicas`, as torch's DDP swaps tp's DTensor
           parameters for local tensors outside forward: torch's start-of-training broadcast of
           the local shards over the dp (x cp) replicas, then per 25 MB bucket one
           torch.distributed.all_reduce of the local gradient shards, started by post-accumulate-
           grad hooks in the backward of each step's last micro-batch (overlapping it) and waited
           for at the end of that backward; the zero-bubble `SplitBackwardReplicas` shares the core
           (`Replicas`). Under parallel.ep the experts are left to expert parallelism as above
  zero1 -> ddp + torch.distributed.optim.ZeroRedundancyOptimizer (each rank keeps and steps the
           optimizer state of its partition of the parameters, then broadcasts the new values)
           over kiln's partition: an even share of the elements per rank, tensors cut into runs
           where the update is elementwise (kiln/parallel/zero1_partition.py `partition`); under parallel.tp
           a DTensor through a plain parameter aliasing its local shard (torch's ZeRO cannot
           broadcast DTensors); under parallel.ep a plain optimizer of the same class over the
           experts (`Zero1Optimizer`: its state_dict is a plain optimizer's format holding this
           rank's share, which each rank saves alone: kiln/parallel/zero1_shards.py)
  zero2 / fsdp / hsdp -> FSDP2 `fully_shard` in kiln/parallel/parallelize.py
  parallel.reduce_dtype = "bf16" -> FSDP2's `MixedPrecisionPolicy(reduce_dtype)`; a DDP comm
           hook (`bf16_mean_hook`, torch's `register_comm_hook`: the bucket divided, sent and
           summed in bf16, copied back into the fp32 gradients); kiln's `Replicas` buckets the
           same way; the replicated experts' all-reduce likewise (kiln/parallel/expert_parallel.py)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.model.moe import MoE
from kiln.parallel.dims import ParallelDims
from kiln.parallel.zero1 import Zero1Optimizer


def grad_mesh(dims: ParallelDims):
    """The 1-D mesh gradients are averaged over (data parallel x cp, flattened); under pp it is
    sliced from this rank's pipeline stage, so its ranks are the replicas of the same stage."""
    mesh = dims.mesh[dims.grad_mesh_names]
    return mesh._flatten() if mesh.ndim > 1 else mesh


def batch_group(dims: ParallelDims):
    """The process group of the ranks that see other sequences of the global batch (data parallel;
    under DiLoCo inside a replica; under pp within this rank's stage), or None when there is one:
    what a per-batch count summed over whole sequences (cp and tp ranks hold equal ones) is
    reduced over (MoE expert loads, kiln/model/moe.py balance_experts)."""
    names = [n for n in dims.dp_mesh_names if not (dims.diloco and n == "dp_replicate")]
    if not names or dims.mesh[tuple(names)].size() == 1:
        return None
    mesh = dims.mesh[tuple(names)]
    return (mesh._flatten() if mesh.ndim > 1 else mesh).get_group()


def sync_on_last_micro_batch(model: nn.Module, last: bool) -> None:
    """Before each micro-batch of a step of several: whether its backward reduces across the
    data-parallel replicas. HSDP (an FSDP2 root; a 1-D FSDP mesh has no all-reduce to hold back):
    the reduce-scatter inside a replica runs every micro-batch, the all-reduce across replicas only
    on the last, after FSDP adds the earlier micro-batches' shards in (torch's
    `set_requires_all_reduce`; the sum is the same, the slow link carries it once a step). DDP
    (composable `replicate`): only the last micro-batch all-reduces, the others accumulate
    (`set_requires_gradient_sync`, DDP's no_sync); under parallel.ep its experts alike
    (expert_parallel.py `ReplicatedExpertGrads`). Anything else (one process, kiln's
    OverlappedReplicas, which counts micro-batches itself, pipeline stages, which torch's schedule
    syncs) is left alone."""
    from torch.distributed.fsdp import FSDPModule

    experts = getattr(model, "replicated_expert_grads", None)
    if experts is not None:
        experts.accumulating = not last
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last)
    elif callable(getattr(model, "set_requires_gradient_sync", None)):
        model.set_requires_gradient_sync(last)


def apply_ddp(model: nn.Module, dims: ParallelDims, grad_accum: int = 1) -> None:
    """Replicate `model` over the data-parallel mesh: gradients are all-reduced (averaged) in
    buckets during backward, overlapping with it. Under tp kiln's `OverlappedReplicas` (kept as
    `model.dp_replicas`), the all-reduce in the backward of every `grad_accum`-th forward."""
    from torch.distributed._composable.replicate import replicate

    if dims.tp > 1:
        model.dp_replicas = OverlappedReplicas(model, dims, grad_accum)
        return
    mesh = grad_mesh(dims)
    # Under parallel.ep the experts are DTensors reduced by kiln/parallel/expert_parallel.py.
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)] if dims.ep > 1 else None
    if experts:
        # By its group: given a mesh sliced from a bigger one (dp x cp), DDP turns every DTensor
        # parameter into a local tensor (its DDP + TP workaround), ignored modules included,
        # which would cut the experts off from their gradients.
        replicate(model, process_group=mesh.get_group(), bucket_cap_mb=25, ignored_modules=experts,
                  gradient_as_bucket_view=True)
    else:
        replicate(model, device_mesh=mesh, bucket_cap_mb=25, ignored_modules=experts, gradient_as_bucket_view=True)
    if dims.grad_wire_dtype is not None:
        model.register_comm_hook(mesh.get_group(), bf16_mean_hook)


def bf16_mean_hook(group, bucket):  # unannotated: DDP compares annotations with classes, not strings
    """DDP comm hook for parallel.reduce_dtype = "bf16": the bucket divided by the group size,
    all-reduced in bf16 and copied back into the fp32 bucket. torch's `bf16_compress_hook` does the
    same but DDP refuses it by name without CUDA and NCCL, so the CPU/gloo runs (and their tests)
    could not use it; this one divides before the cast, as kiln's `Replicas` do."""
    buffer = bucket.buffer()
    wire = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)

    def copy_back(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(wire, group=group, async_op=True).get_future().then(copy_back)


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
    group = grad_mesh(dims).get_group()
    ddp = DistributedDataParallel(chunk, process_group=group, bucket_cap_mb=25, gradient_as_bucket_view=True)
    if dims.grad_wire_dtype is not None:
        ddp.register_comm_hook(group, bf16_mean_hook)
    return ddp


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
    complete: one transient flat copy of the gradients (DDP's buckets stay for the run, the
    gradients living in them: kiln's `gradient_as_bucket_view`). With parallel.reduce_dtype bf16
    the copy is cast before its all-reduce (`wire_dtype`)."""

    BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size

    def __init__(self, group, bucket_cap_mb: float = 25, wire_dtype: torch.dtype | None = None):
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.wire_dtype = wire_dtype  # parallel.reduce_dtype bf16: each bucket all-reduced in bf16
        self.params: list[nn.Parameter] = []
        self.buckets: list[list[nn.Parameter]] = []
        self._inflight: dict[int, tuple] = {}

    def _setup(self, params: list[nn.Parameter], buffers: list[torch.Tensor],
               part_of: dict[int, int] | None = None) -> None:
        """`part_of`: a bucket never spans two parts (id(parameter) -> part, e.g. stage chunks)."""
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
            part = (part_of or {}).get(id(p))
            if not self.buckets or (p.dtype, p.device, part) != key or size + nbytes > cap:
                self.buckets.append([])
                size, key = 0.0, (p.dtype, p.device, part)
            self.buckets[-1].append(p)
            size += nbytes

    def _launch(self, index: int, scale: float = 1.0) -> None:
        """Start bucket `index`'s all-reduce (of the gradients times `scale`). A parameter that got
        no gradient on this rank takes part with zeros, so every replica sends the same buckets and
        ends with the same gradient."""
        from torch._utils import _flatten_dense_tensors

        grads = []
        for p in self.buckets[index]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        flat = _flatten_dense_tensors(grads).div_(self.size)
        if scale != 1.0:
            flat.mul_(scale)
        if self.wire_dtype is not None:  # divided first (in fp32), as DDP's bf16_compress_hook sends it
            flat = flat.to(self.wire_dtype)
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
    gradient all-reduce cannot run, and for every schedule under parallel.tp (the chunks' DTensor
    parameters, on their local shards): built once the chunks are materialized, then `average()`
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
        super().__init__(grad_mesh(dims).get_group(), bucket_cap_mb, dims.grad_wire_dtype)
        seen: set[int] = set()
        params, buffers, part_of = [], [], {}
        for index, chunk in enumerate(chunks):  # DDP's constructor, per chunk as replicate_stage's DDP would do it
            ignored = leave_experts_to_expert_parallel(chunk) if dims.ep > 1 else set()
            params += [p for name, p in chunk.named_parameters()
                       if name not in ignored and not (id(p) in seen or seen.add(id(p)))]
            buffers += [b for name, b in chunk.named_buffers() if name not in ignored]
            part_of.update({id(p): index for p in chunk.parameters() if id(p) not in part_of})
        # buckets per chunk, as DDP per chunk: torch's multi-stage schedules divide a chunk's
        # gradients by the micro-batch count right after its own last backward, not at the step's end
        self._setup(params, buffers, part_of)


class OverlappedStageReplicas(SplitBackwardReplicas):
    """ddp/zero1 replicas of a rank's stage chunks under tp for the schedules whose backward
    accumulates gradients through autograd (every schedule but the zero-bubble ones, whose weight
    pass bypasses AccumulateGrad): a bucket's all-reduce starts as soon as each of its parameters
    has accumulated the step's last micro-batch gradient (a post-accumulate-grad hook counts them,
    whichever order the schedule runs the micro-batches and chunks in), overlapping the backward
    work still to come on the rank (other chunks, other micro-batches), as DDP's reducer does for
    the last micro-batch. `average()` after the schedule's step waits for them and reduces the
    buckets whose parameters got fewer gradients (unused in some micro-batch).

    torch's schedule divides a chunk's gradients by the micro-batch count after that chunk's last
    backward (`scale_grads`; the multi-stage schedules at the chunk's REDUCE_GRAD, the single-stage
    ones at the step's end); a bucket (never spanning chunks) launched before that carries the
    division (`after_backward_scale`, set per step by the pipeline), and its copy-back replaces the
    divided local gradients."""

    def __init__(self, chunks: list[nn.Module], dims: ParallelDims, microbatches: int, bucket_cap_mb: float = 25):
        super().__init__(chunks, dims, bucket_cap_mb)
        self.microbatches = microbatches
        holders: dict[int, int] = {}  # a parameter two of the rank's chunks share accumulates in both
        for chunk in chunks:
            for p in chunk.parameters():
                holders[id(p)] = holders.get(id(p), 0) + 1
        self._expected = {id(p): microbatches * holders.get(id(p), 1) for p in self.params}
        self.after_backward_scale = 1.0 / microbatches
        self.launched_in_backward = 0  # buckets started inside the step's backward (tests read it)
        self._counts: dict[int, int] = {}
        self._waiting = [{id(p) for p in bucket} for bucket in self.buckets]
        for index, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._hook(index))

    def _hook(self, index: int):
        def accumulated(p: torch.Tensor) -> None:
            count = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
            if count < self._expected[id(p)]:
                return
            self._waiting[index].discard(id(p))
            if not self._waiting[index] and index not in self._inflight:
                self._launch(index, self.after_backward_scale)
                self.launched_in_backward += 1
        return accumulated

    def average(self) -> None:
        self._wait_all()
        self._counts = {}
        self._waiting = [{id(p) for p in bucket} for bucket in self.buckets]


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
        super().__init__(grad_mesh(dims).get_group(), bucket_cap_mb, dims.grad_wire_dtype)
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


def shard_optimizer_state(optimizer: torch.optim.Optimizer, dims: ParallelDims, model: nn.Module | None = None
                          ) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer (class, param groups, hyper-parameters) with its state
    partitioned over the data-parallel ranks (under parallel.ep the dense parameters' state only),
    `Zero1Optimizer`; under pp a tied embedding's tensors (`model.tied_embedding_weights`) are cut
    alike on both end stages. Returns `optimizer` itself unless dp_mode is zero1; under ddp,
    Muon's Newton-Schulz is dealt out over the replicas (`Muon.share_over_replicas`)."""
    share = getattr(optimizer, "share_over_replicas", None)
    if dims.dp_mode == "ddp" and dims.grad_ranks > 1 and share is not None:
        share(grad_mesh(dims).get_group())  # the ranks DDP averages over: equal gradients
    if dims.dp_mode != "zero1" or dims.grad_ranks == 1:  # (DiLoCo: the ranks inside a replica)
        return optimizer
    tied = getattr(model, "tied_embedding_weights", list)()
    return Zero1Optimizer(optimizer, grad_mesh(dims).get_group(), saved_alike=tied)  # under pp: this stage's replicas


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
