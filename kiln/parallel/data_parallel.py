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
           gradients after the schedule's step
  zero1 -> ddp + torch.distributed.optim.ZeroRedundancyOptimizer (each rank keeps and steps the
           optimizer state of its partition of the parameters, then broadcasts the new values)
  zero2 / fsdp / hsdp -> FSDP2 `fully_shard` in kiln/parallel/parallelize.py
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from kiln.model.moe import MoE
from kiln.parallel.dims import ParallelDims


def grad_mesh(dims: ParallelDims):
    """The 1-D mesh gradients are averaged over (data parallel x cp, flattened); under pp it is
    sliced from this rank's pipeline stage, so its ranks are the replicas of the same stage."""
    mesh = dims.mesh[dims.grad_mesh_names]
    return mesh._flatten() if mesh.ndim > 1 else mesh


def apply_ddp(model: nn.Module, dims: ParallelDims) -> None:
    """Replicate `model` over the data-parallel mesh: gradients are all-reduced (averaged) in
    buckets during backward, overlapping with it."""
    from torch.distributed._composable.replicate import replicate

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

    return DistributedDataParallel(chunk, process_group=grad_mesh(dims).get_group(), bucket_cap_mb=25)


class SplitBackwardReplicas:
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
    other ddp layout has; not tried.)

    What is torch's: DDP's own start (`_verify_param_shape_across_processes`, then
    `_sync_module_states`: the group's first rank broadcasts parameters and buffers in 250 MB
    coalesced buckets), `_flatten_dense_tensors` / `_unflatten_dense_tensors` and the
    `all_reduce` collective. What is kiln's: the bucket plan (consecutive parameters of one dtype
    and device, up to `bucket_cap_mb`, as DDP's default 25 MB) and the pre-division by the group
    size before a SUM (DDP's allreduce_hook; gloo has no AVG). Every bucket is in flight at once
    (async) and copied back as it completes: one transient flat copy of the gradients, where DDP
    keeps its buckets for the whole run. Unlike DDP nothing overlaps the backward: the gradients
    are final only at the schedule's end (its REDUCE_GRAD step per stage)."""

    BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size

    def __init__(self, chunks: list[nn.Module], dims: ParallelDims, bucket_cap_mb: float = 25):
        from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

        self.group = grad_mesh(dims).get_group()
        self.size = dist.get_world_size(self.group)
        for chunk in chunks:  # DDP's constructor, per chunk as replicate_stage's DDP would do it
            _verify_param_shape_across_processes(self.group, list(chunk.parameters()))
            _sync_module_states(chunk, self.group, self.BROADCAST_BUCKET_BYTES, src=0,
                                params_and_buffers_to_ignore=set())
        seen: set[int] = set()
        self.params = [p for chunk in chunks for p in chunk.parameters()
                       if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        self.buckets: list[list[nn.Parameter]] = []  # the same plan on every replica: same model
        cap, size, key = bucket_cap_mb * 1024 * 1024, 0.0, None
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (p.dtype, p.device) != key or size + nbytes > cap:
                self.buckets.append([])
                size, key = 0.0, (p.dtype, p.device)
            self.buckets[-1].append(p)
            size += nbytes

    def average(self) -> None:
        """Replace every parameter's gradient by its mean over the replicas. A parameter that got
        no gradient on this rank takes part with zeros, so every replica sends the same buckets
        and ends with the same gradient."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        pending = []
        for bucket in self.buckets:
            grads = []
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            flat = _flatten_dense_tensors(grads).div_(self.size)
            pending.append((grads, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        for grads, flat, work in pending:
            work.wait()
            for grad, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(mean)


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


def shard_optimizer_state(optimizer: torch.optim.Optimizer, dims: ParallelDims) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer (class, param groups, hyper-parameters) with its state
    partitioned over the data-parallel ranks. Returns `optimizer` itself unless dp_mode is zero1."""
    if dims.dp_mode != "zero1" or dims.dp_size * dims.cp == 1:
        return optimizer
    group = grad_mesh(dims).get_group()  # under pp: this stage's replicas, over its parameters
    groups = [dict(g) for g in optimizer.param_groups]
    # ZeRO builds a new optimizer per rank from the class and keyword arguments; `defaults` can
    # hold derived keys the constructor does not take (AdamW's decoupled_weight_decay), which the
    # param groups carry anyway.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyState(groups, optimizer_class=type(optimizer), process_group=group, **kwargs)


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
