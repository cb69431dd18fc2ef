"""Expert parallelism: each rank of an `ep` group holds `E / ep` of every MoE layer's experts;
tokens travel to their expert's rank and back with `all_to_all_single`.

torch APIs: `torch.distributed._functional_collectives.all_to_all_single_autograd` (what
torchtitan uses; differentiable: its backward is the reverse all-to-all, so expert gradients flow
back to the ranks whose tokens produced them);
the plain `torch.distributed.all_to_all_single` exchanges the per-expert counts. The routing,
sorting and regrouping around them are kiln's (torchtitan does the same exchange of counts first).
The exchange the MoE block calls in its forward is kiln/parallel/functional.py
`dispatch_and_combine`; this module lays the experts out and reduces their gradients.

Gradients. Each rank's loss is the mean over its own tokens, and data parallelism averages the
dense gradients over all D data-parallel ranks. An expert on ep rank q receives, through the
all-to-all backward, the sum of the gradients of all ep ranks' losses for the tokens it served;
the global loss is the mean over the D ranks, so that sum must be divided by D and summed
(not averaged) over the D / ep replicas of that expert - never reduced over the ep group, which
holds different experts. `reduce_expert_grads` does exactly that.

In `kiln train` (`apply_expert_parallel_training`) ep is borrowed from the data-parallel ranks
and all of cp, within each pipeline stage (torchtitan's design): `ParallelDims.expert_mesh` has
("edp", "ep") over a stage's D x cp ranks, each consecutive group of ep ranks splits the experts,
and the D x cp / ep ranks holding the same experts form "edp" (dp_replicate x dp_shard x cp / ep
under fsdp/zero2/HSDP, the other replicas x cp / ep under ddp). Below, D counts the ranks the
dense gradients are averaged over (data parallel x cp: each cp rank's loss is the mean over its
slice of the sequences). The dense parameters are unchanged (FSDP over dp_shard x cp, or DDP).
Each expert tensor is a DTensor of the
global shape, `Shard(0)` (expert dimension) over ep; DCP saves every expert once and reshards to
another layout, and the grad norm of a DTensor counts each expert once.
- fsdp/zero2: `fully_shard_experts` adds FSDP2 over edp (torchtitan's dp_shard_mod_ep FSDP), so
  the experts are sharded over all D ranks; FSDP averages their gradients over edp and a hook on
  each forward's local slice scales by edp / D (= 1 / ep here), which makes the 1 / D.
- ddp/zero1: the experts are replicated over edp (`Replicate()`), DDP ignores them (composable
  replicate's ignored_modules; under pp the per-stage DDP class, data_parallel.py
  `leave_experts_to_expert_parallel`), and the hook sums the gradients over edp and divides by D
  (`reduce_expert_grads`' arithmetic; `ReplicatedExpertGrads`, which sums once a step under
  gradient accumulation). zero1 shards the dense parameters' optimizer state only
  (data_parallel.py `Zero1Optimizer`).
The hooks are linear, so gradient accumulation is unchanged.

Expert tensor parallel (parallel.ep > 1 with parallel.tp > 1; torchtitan's ExpertTensorParallel
with etp = tp). ep never borrows tp: the expert mesh is ("pp", "edp", "ep", "tp"), and within each
tp coordinate the ep ranks split the experts as above. tensor_parallel.py's `MoETensorParallel`
runs first (each expert's w1/w3 Shard(2), w2 Shard(1) over tp, the sequence gathered so every tp
rank routes the same tokens); `apply_expert_parallel_training` then slices the experts of that tp
shard over ep, so each weight is a DTensor on the ("ep", "tp") mesh, (Shard(0), hidden shard),
and FSDP adds edp in front (torch's FSDP2 takes a 2-D EP x TP DTensor: _StridedShard over edp).
In forward the all-to-all runs over ep among the ranks of one tp coordinate (its group is
`expert_mesh["ep"]`'s for this rank), each rank computes its hidden slice of the received rows,
the combine all-to-all returns partial sums, and the style reduce-scatters the MoE output over
tp. Gradients: every tp rank of a data-parallel rank has the same loss (loss parallel) and the
full output gradient (the reduce-scatter's backward all-gathers it), so its expert gradient is
exactly its hidden slice of the gradient above - the tp ranks hold disjoint slices, not replicas,
and the 1 / D arithmetic is unchanged (dividing by tp too is the mistake the tests catch). The
tokens and gates the experts read are replicated over tp, so their gradients, partial per hidden
slice after the reverse all-to-all, are summed over tp as without ep: through the router, whose
weight's gradient is summed once a step, and by the reduce-scatter of the block's input gather
(tensor_parallel.py MoETensorParallel). DCP saves each (expert, hidden slice) once; the grad
norm's `full_tensor` sums over edp x ep x tp.

Expert parallel borrowing tp (parallel.etp=1; torchtitan's etp = 1). The ep group spans tp (and cp): the
expert mesh is ("edp", "ep") with ep = dp_shard_in_ep x cp x tp consecutive ranks and edp =
dp_shard * cp * tp / ep (dims.ParallelDims._build_expert_mesh_borrowing_tp). tensor_parallel.py's
`MoELocalSequence` leaves the experts whole and the MoE block's input sequence-sharded, so each tp
rank routes only its own tokens (queue slots, aux and z-losses taken over the whole sequence,
kiln/model/moe.py) and sends them to whole experts: the all-to-all carries every token once, not
tp times, and no expert row is computed twice. Each weight is a DTensor of the global shape,
Shard(0) over ep, FSDP-sharded over edp as above. Gradients: every token lives on exactly one rank
and gets its own true gradient (sequence parallel), so an expert's all-to-all backward sums the
gradients of the dp ranks of its ep group; the global mean over D needs 1 / D over the D * tp / ep
edp replicas' sum, i.e. a hook factor edp / D = tp / ep after FSDP's average over edp (the factor
edp / D is 1 / ep when ep does not borrow tp: one formula). The router runs replicated over tp
on different tokens: its gradient is summed over tp once a step (functional.py
`local_with_partial_grad`, settled by kiln/train/step.py settle_grad_placements). DCP saves each
expert once (Shard(0) over ep x FSDP over edp) and reshards to any other layout.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from kiln import torch_compat
from kiln.model.moe import MoE


def apply_expert_parallel(model: nn.Module, ep_group) -> None:
    """Keep this rank's slice of every MoE layer's experts (call on the meta-device model, before
    init: kiln/model/init.py draws all experts and keeps the slice) and route through `ep_group`."""
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        ex = m.experts
        if ex.n_experts % ep:
            raise ValueError(f"ep={ep} must divide the {ex.n_experts} experts")
        ex.n_local = ex.n_experts // ep
        ex.first = rank * ex.n_local
        for name in ("w1", "w2", "w3"):
            w = getattr(ex, name)
            if w is not None:
                setattr(ex, name, nn.Parameter(w.detach()[ex.first:ex.first + ex.n_local].clone()))
        m.ep_group = ep_group


def apply_expert_parallel_training(model: nn.Module, expert_mesh, dp_size: int, fsdp: bool,
                                   node_groups: tuple | None = None, wire_dtype: torch.dtype | None = None,
                                   per_backward: bool = False) -> None:
    """`kiln train`'s expert parallelism, on the meta-device model before FSDP/DDP (and after
    tensor parallelism): slice the experts over `expert_mesh["ep"]` and turn each local slice into
    a DTensor of the global shape.
    fsdp=True (dp_mode fsdp/zero2): `Shard(0)` on the ep mesh, for `fully_shard_experts` to shard
    further over "edp"; else (ddp): on `expert_mesh["edp", "ep"]`, `Replicate()` over "edp",
    `Shard(0)` over "ep", with gradients summed over "edp" in backward. Either way an expert's
    gradient ends up divided by `dp_size`, the ranks the dense gradients are averaged over
    (data parallel x cp). Under tp (`MoETensorParallel` made each expert weight a DTensor on the tp
    mesh, hidden units sharded) the mesh gains "tp" and the weight keeps its tp placement.
    `node_groups` (dims.expert_node_groups): the two-level dispatch's (inter-node, intra-node) groups.
    `wire_dtype` (dims.grad_wire_dtype): what the ddp sum over "edp" sends (FSDP's is its policy's);
    `per_backward` (under pp): that sum in every backward (`ReplicatedExpertGrads`)."""
    names, placements = (("ep",), [Shard(0)]) if fsdp else (("edp", "ep"), [Replicate(), Shard(0)])
    tp_layouts = _unwrap_tensor_parallel_experts(model)
    if tp_layouts:
        if "tp" not in expert_mesh.mesh_dim_names:
            raise ValueError("tensor-parallel experts need an expert mesh with a 'tp' dimension")
        names = (*names, "tp")
    ep_mesh = expert_mesh["ep"]
    apply_expert_parallel(model, ep_mesh.get_group())
    mesh = expert_mesh[names] if len(names) > 1 else ep_mesh
    if fsdp:  # FSDP averages over edp (reduce-scatter): a further edp / dp_size makes the 1 / dp_size
        hook = functools.partial(_scaled_grad, factor=expert_mesh["edp"].size() / dp_size)
    else:
        replica_group = expert_mesh["edp"].get_group() if expert_mesh["edp"].size() > 1 else None
        hook = model.replicated_expert_grads = ReplicatedExpertGrads(dp_size, replica_group, wire_dtype, per_backward)
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        ex = m.experts
        for name in ("w1", "w2", "w3"):
            w = getattr(ex, name)
            if w is None:
                continue
            shape, tp_placement = tp_layouts.get((id(ex), name), ((ex.n_experts, *w.shape[1:]), None))
            stride = torch.empty(shape, device="meta").stride()
            d = DTensor.from_local(w.detach(), mesh, placements + ([tp_placement] if tp_placement else []),
                                   run_check=False, shape=shape, stride=stride)
            setattr(ex, name, nn.Parameter(d))
        # On the local slice in forward (a parameter hook would not survive materialization).
        ex.grad_hook = hook
        if not fsdp:
            hook.experts.append(ex)
        m.ep_node_groups = node_groups


def _unwrap_tensor_parallel_experts(model: nn.Module) -> dict:
    """Expert weights that tensor parallelism made DTensors on the tp mesh (hidden units sharded,
    kiln/parallel/tensor_parallel.py) become their local tp shards, for `apply_expert_parallel` to
    slice on the expert dim; returns (id(experts), name) -> (global shape, tp placement)."""
    layouts = {}
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        for name in ("w1", "w2", "w3"):
            w = getattr(m.experts, name)
            if isinstance(w, DTensor):
                (placement,) = w.placements
                layouts[(id(m.experts), name)] = (tuple(w.shape), placement)
                setattr(m.experts, name, nn.Parameter(w.to_local().detach()))
    return layouts


def fully_shard_experts(module: nn.Module, expert_mesh, **fsdp_kwargs) -> None:
    """FSDP2 of each MoE layer's experts in `module` over "edp" (the ranks holding the same
    experts; torchtitan's dp_shard_mod_ep FSDP): on top of Shard(0) over ep, so each rank stores
    E / dp_size experts' worth of weights, gradients and optimizer state. Call before the
    enclosing block's `fully_shard`, which then leaves the experts to this inner FSDP unit."""
    from torch.distributed.fsdp import fully_shard

    for m in module.modules():
        if isinstance(m, MoE):
            fully_shard(m.experts, mesh=expert_mesh["edp"], **fsdp_kwargs)
    if expert_mesh.device_type == "cpu":  # torch 2.8's gloo sums where FSDP asks it to average
        torch_compat.force_sum_for_gloo(module)


def compile_moe_steps(moe: MoE) -> None:
    """torch.compile (fullgraph) of a MoE layer's steps one by one, for a block that cannot be
    compiled whole because its experts are their own FSDP unit (fully_shard_experts), whose hooks
    dynamo does not trace: routing and sorting (`sort_by_expert`), the experts' math on their local
    weights (`GroupedExperts.compute`) and, without ep, the weighted sum (`weighted_sum`) become
    graphs; the all-to-all with the gated sums on the experts' side (functional.py
    `dispatch_and_combine`), the regrouping of the received rows, the FSDP unit's hooks and the
    DTensor unwrapping with its gradient hook run eagerly between them (torchtitan's apply_compile for MoE
    leaves the experts' FSDP unit out the same way). Compiled in place on the instance, so module
    and parameter names do not change.

    The number of rows an ep rank receives changes every step, so the experts' input is marked
    dynamic on its first dimension: one graph for every count from 2 up (dynamo specializes 0 and
    1, so such a batch runs the same math eagerly instead of compiling again)."""
    moe.sort_by_expert = torch.compile(moe.sort_by_expert, fullgraph=True)
    moe.weighted_sum = torch.compile(moe.weighted_sum, fullgraph=True)
    eager = moe.experts.compute
    compiled = torch.compile(eager, fullgraph=True)

    def compute(x, counts, w1, w2, w3):
        if x.shape[0] < 2:
            return eager(x, counts, w1, w2, w3)
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x, counts, w1, w2, w3)

    moe.experts.compute = compute


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert weight (differentiable; a plain tensor is returned as is)."""
    return w.to_local() if isinstance(w, DTensor) else w


@torch.no_grad()
def _scaled_grad(grad: torch.Tensor, factor: float) -> torch.Tensor:
    return grad * factor


class ReplicatedExpertGrads:
    """ddp/zero1's expert gradients: divided by dp_size on each forward's local slice
    (`Experts.grad_hook`, this object called), then summed over edp in the backward of the step's
    last micro-batch (`accumulating` is set by data_parallel.sync_on_last_micro_batch before each
    one but the last, as DDP's no_sync), overlapping it as DDP's buckets do: a post-accumulate-grad
    hook on each expert weight starts its all-reduce (async, in parallel.reduce_dtype) as soon as
    its gradient is final, and a callback queued at the end of that backward (the autograd engine's
    `queue_callback`, as DDP's reducer does) waits for them all. One all-reduce per expert tensor
    a step. The parameter hooks are registered in the first backward (the parameters are replaced
    at materialization, after this is built); a weight whose sum did not start by the callback
    (that first backward) is summed there. Pipeline stages (`per_backward`: the schedule runs the
    backwards) sum each backward's slice gradient in its hook instead.

    The sum is of the accumulated gradient, so every backward of a step but the last must be marked
    `accumulating` (kiln's train_step does): an unmarked earlier backward's sum would be counted
    again. DDP, which divides each bucket just before its sum, has no such rule; here the slices
    are divided by dp_size while the sum runs over the edp ranks only (fewer under ep)."""

    def __init__(self, dp_size: int, replica_group, wire_dtype: torch.dtype | None = None,
                 per_backward: bool = False) -> None:
        self.dp_size, self.replica_group, self.wire_dtype = dp_size, replica_group, wire_dtype
        self.per_backward = per_backward
        self.experts: list[nn.Module] = []  # the modules, not their parameters: those are replaced at materialization
        self.accumulating = False
        self._queued = False  # the step's last backward runs: sums start as gradients become final
        self._inflight: dict[int, tuple] = {}  # id(weight) -> (local gradient, what is sent, work)
        self._hooked: set[int] = set()
        self.started_in_backward = 0  # sums the last backward started before its end (tests read it)

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.replica_group is None:
            return grad / self.dp_size
        if self.per_backward:
            grad = grad.clone()
            _reduce_(grad, self.dp_size, self.replica_group, self.wire_dtype)
            return grad
        if not self.accumulating and not self._queued:
            self._hook_weights()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued, self.started_in_backward = True, 0
        return grad / self.dp_size

    def _weights(self) -> list[torch.Tensor]:
        return [w for ex in self.experts for w in (ex.w1, ex.w2, ex.w3) if w is not None]

    def _hook_weights(self) -> None:
        for w in self._weights():
            if id(w) not in self._hooked:
                w.register_post_accumulate_grad_hook(self._start)
                self._hooked.add(id(w))

    def _start(self, w: torch.Tensor) -> None:
        """The post-accumulate-grad hook: `w`'s gradient is final in the last micro-batch's backward."""
        self.started_in_backward += self._launch(w)

    def _launch(self, w: torch.Tensor) -> bool:
        """Start the sum of `w`'s accumulated gradient over edp; whether it started now."""
        if self.accumulating or not self._queued or id(w) in self._inflight:
            return False
        local = local_weight(w.grad)
        self._inflight[id(w)] = (local, *_start_all_reduce(local, self.replica_group, self.wire_dtype))
        return True

    def _finish(self) -> None:
        for w in self._weights():
            if w.grad is not None:
                self._launch(w)
        for local, wire, work in self._inflight.values():
            work.wait()
            if wire is not local:
                local.copy_(wire)
        self._inflight, self._queued = {}, False


def _reduce_(grad: torch.Tensor, dp_size: int, replica_group, wire_dtype: torch.dtype | None = None) -> None:
    if replica_group is not None and dist.get_world_size(replica_group) > 1:
        _all_reduce_in(grad, replica_group, wire_dtype)
    grad.div_(dp_size)


def _start_all_reduce(t: torch.Tensor, group, wire_dtype: torch.dtype | None) -> tuple[torch.Tensor, object]:
    """Start the sum of `t` over `group`, sent in `wire_dtype` (parallel.reduce_dtype) when given:
    (what is summed, `t` itself or its cast copy to copy back; the work)."""
    wire = t if wire_dtype is None or t.dtype == wire_dtype else t.to(wire_dtype)
    return wire, dist.all_reduce(wire, group=group, async_op=True)


def _all_reduce_in(t: torch.Tensor, group, wire_dtype: torch.dtype | None) -> None:
    """Sum `t` over `group` in place, sent in `wire_dtype` when given."""
    wire, work = _start_all_reduce(t, group, wire_dtype)
    work.wait()
    if wire is not t:
        t.copy_(wire)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that differ between ep ranks (the local experts)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, dp_size: int, replica_group=None) -> None:
    """Expert gradients after backward: sum over the replicas of this rank's experts
    (`replica_group`, None when each expert lives on one rank only) and divide by the number of
    data-parallel ranks, so they equal the single-process gradient of the global mean loss."""
    for p in expert_parameters(model):
        if p.grad is not None:
            _reduce_(local_weight(p.grad), dp_size, replica_group)
