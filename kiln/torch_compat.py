"""The torch APIs kiln needs whose name or behaviour changed inside its declared range
(torch>=2.6,<3): one place that picks what the running torch has. Each entry says which releases
need which spelling; scripts/torch_range.sh runs the tests under another release."""

from __future__ import annotations

import functools

import torch.distributed as dist

# torch 2.13 added `all_gather_single` / `reduce_scatter_single` and deprecated the older names
# (a warning per call); 2.6-2.12 have only `all_gather_into_tensor` / `reduce_scatter_tensor`.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllWorks:
    """Every `dist.Work` of one `batch_isend_irecv`, waited on together; and the exchanges of this
    rank with itself, which must have met their other half by then."""

    def __init__(self, works, self_exchange):
        self.works, self.self_exchange = works, self_exchange

    def wait(self, *args):
        for work in self.works:
            work.wait(*args)
        if self.self_exchange["recvs"]:
            raise RuntimeError("pipeline schedule: a stage waited for a tensor from a stage on its own rank "
                               "that was never sent (kiln/torch_compat.py wait_for_every_pipeline_p2p)")
        return True


@functools.cache
def wait_for_every_pipeline_p2p() -> bool:
    """Two gaps of torch's pipeline schedules before 2.8, both on gloo, both closed by replacing
    the schedules' `_batch_p2p` there (returns whether it was replaced):
    - It waited on one `Work` of each batched send/receive (`batch_isend_irecv(ops).pop()`): right
      for NCCL, which coalesces a batch into one `Work`, but gloo returns one per op, and the ones
      left unwaited deadlock 1F1B's fused send/receive phase (torch 2.6, 2 ranks: each waits in its
      fused exchange forever; pytorch/pytorch#132644, fixed by #152938, which added
      `_wait_batch_p2p`). Here the returned `Work` waits on all.
    - The multi-stage runtime sends between two stages on one rank like between ranks (ZBV's V
      holds stages r and 2pp-1-r, and its middle two are neighbours): a send to this rank itself,
      which gloo has no pair for ("writev: Bad file descriptor"). Here such sends and receives are
      matched in order, as gloo matches one peer's messages, and copied locally."""
    import collections

    import torch
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "_wait_batch_p2p") or not hasattr(schedules, "_batch_p2p"):
        return False
    self_exchange = {"sends": collections.deque(), "recvs": collections.deque()}

    def batch_p2p(p2p_ops, desc=None):
        if not p2p_ops:
            return None
        me, remote = dist.get_rank(), []
        for op in p2p_ops:
            if op.peer != me:
                remote.append(op)
            else:
                self_exchange["sends" if op.op.__name__ == "isend" else "recvs"].append(op.tensor)
        with torch.no_grad():
            while self_exchange["sends"] and self_exchange["recvs"]:
                self_exchange["recvs"].popleft().copy_(self_exchange["sends"].popleft())
        return _AllWorks(dist.batch_isend_irecv(remote) if remote else [], self_exchange)

    schedules._batch_p2p = batch_p2p
    return True


@functools.cache
def pipeline_stage_class():
    """torch.distributed.pipelining's PipelineStage, subclassed for two gaps of older releases:
    - A stage infers the shapes it exchanges with one forward on its first step
      (`_shape_inference`). Before 2.13 that forward ran under `no_grad` inside the caller's
      autocast, whose cache then held the bf16 casts of the weights without autograd history;
      every later forward of the step reused them, and no Linear weight got a gradient (torch 2.6:
      "the tied embedding got no gradient", the norms' weights alone had one). The autocast cache is
      cleared after that forward, on every release (one extra cast per weight, once).
    - Schedules that open the pipeline by exchanging a dummy tensor with every neighbouring stage
      (`_get_init_p2p_neighbors_ops`, 2.6-2.12; 2.13 replaced it by a vote that skips this): the
      exchanges whose peer is this rank itself are left out. A V-shaped schedule (ZBV) holds two
      neighbouring stages on one rank, and gloo has no pair to itself ("Pair is not connected")."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    wait_for_every_pipeline_p2p()  # every pipeline builds its stages here
    exchanges_with_itself = not hasattr(schedules.PipelineScheduleMulti, "_warmup_p2p")

    class KilnPipelineStage(PipelineStage):
        def _shape_inference(self, *args, **kwargs):
            try:
                return super()._shape_inference(*args, **kwargs)
            finally:
                torch.clear_autocast_cache()

        def _get_init_p2p_neighbors_ops(self):
            ops = super()._get_init_p2p_neighbors_ops()
            return [op for op in ops if op.group_peer != self.group_rank] if exchanges_with_itself else ops

    if not hasattr(PipelineStage, "_shape_inference"):
        del KilnPipelineStage._shape_inference
    if not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
        del KilnPipelineStage._get_init_p2p_neighbors_ops
    return KilnPipelineStage


@functools.cache
def weight_pass_takes_python_functions() -> bool:
    """Whether torch's zero-bubble weight pass (pipelining/_backward.py stage_backward_weight) can
    differentiate from a custom autograd.Function's node: it keeps the nodes that consume a
    stage's weights (found through `next_functions`) after the stage's output is gone and calls
    autograd.grad on GradientEdges to them. 2.13 keeps such a node usable; on 2.11 it has expired
    by then ("Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase").
    Probed, not read off the version: the same sequence on three-element CPU tensors, from 2.11 on;
    2.10 raises there too; before 2.10 not probed and taken as no: on 2.6 the probe's call on the
    expired node crashed the process (segmentation fault in autograd's _make_grads)."""
    import torch
    from torch.autograd.graph import GradientEdge

    if torch.torch_version.TorchVersion(torch.__version__) < (2, 10):
        return False

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    out = Product.apply(x, w) * 2
    node = out.grad_fn.next_functions[0][0]
    torch.autograd.grad(out.sum(), [x], retain_graph=True)  # the input pass
    del out
    try:
        torch.autograd.grad([GradientEdge(node, 0)], [w], grad_outputs=[torch.ones(3)])
    except RuntimeError:
        return False
    return True


def all_gather_autograd(tensor, gather_dim: int, group):
    """torch's differentiable all-gather (functional collectives, concatenated over `gather_dim`):
    `all_gather_single_autograd` from 2.13, which deprecated `all_gather_tensor_autograd`, the
    only name in 2.6-2.12. Looked up at each call, so a test can patch either."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor, gather_dim, group)


def fsdp_runs_on_cpu() -> bool:
    """Whether FSDP2 (`fully_shard`) can run on CPU tensors: it records events on the device's
    streams, which torch 2.6's `torch.cpu.Stream` cannot (AttributeError 'record_event' at the
    first all-gather); 2.11 and 2.13 can."""
    import torch

    return hasattr(torch.cpu.Stream, "record_event")


def cudagraph_unsafe_tag():
    """The op tag that makes inductor split a CUDA graph around an op (`torch.Tag.cudagraph_unsafe`,
    which ring attention's custom ops carry), or None on releases without it (2.6)."""
    import torch

    return getattr(torch.Tag, "cudagraph_unsafe", None)


def dcp_no_dist(dcp_call, distributed: bool) -> dict:
    """DCP's `no_dist=True` (one process, no process group) where `dcp_call` (save, async_save,
    load) takes it; torch 2.6's have no such argument and infer it from the process group."""
    import inspect

    return {"no_dist": not distributed} if "no_dist" in inspect.signature(dcp_call).parameters else {}


def dcp_metadata_path(reader, rank: int | None):
    """Where a DCP FileSystemReader's `.metadata` is: the reader's own per-rank name where it has
    one (`_get_metadata_path`), else torch 2.6's single `.metadata` file."""
    if hasattr(reader, "_get_metadata_path"):
        return reader._get_metadata_path(rank)
    return reader.fs.concat_path(reader.path, ".metadata")


def distribute_tensor(tensor, mesh, placements, src_data_rank: int | None = 0):
    """torch's `distribute_tensor`; `src_data_rank=None` (every rank slices its own full copy, no
    scatter) from 2.7 on. torch 2.6 has no such argument and scatters from the mesh's first rank,
    which gives the same shards where every rank holds the same full tensor (kiln's init and its
    tp styles)."""
    import inspect

    from torch.distributed.tensor import distribute_tensor as distribute

    if "src_data_rank" in inspect.signature(distribute).parameters:
        return distribute(tensor, mesh, placements, src_data_rank=src_data_rank)
    return distribute(tensor, mesh, placements)


@functools.cache
def key_embedding_backward_by_vocab() -> bool:
    """DTensor caches the sharding it propagates per op schema, and until pytorch/pytorch#174727
    (2.11 passes, 2.6 fails; 2.7-2.10 not run) the schema of `embedding_dense_backward` left its
    `num_weights` (the rows) out of the cache key: under tp, the backward of a second embedding of
    another size in the process (a 64-token model, then a 65-token one; in one GPT-2 model, its
    positions and its tokens) reused the first one's shape ("EmbeddingBackward0 returned an
    invalid gradient ... got [64, 32] but expected shape compatible with [65, 32]"). Where the op
    has no such key, it gets torch's own fix, the schema info that hashes the arguments from
    `num_weights` on. Returns whether it was added."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.embedding_dense_backward.default
    known = [getattr(propagator, name, {}).get(op) for name in
             ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy")]  # the latter from 2.12
    if any(info is not None and info.static_argnum <= 2 for info in known):
        return False
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=2)
    return True


def dynamo_skips_checkpoint_side_effects() -> bool:
    """Whether dynamo has `skip_fwd_side_effects_in_bwd_under_checkpoint`, which a compiled,
    checkpointed MoE block needs (it stores its aux and z losses in forward: kiln/parallel/
    parallelize.py sets the switch). 2.6 has none and refuses such a block ("HigherOrderOperator:
    Mutating a variable not in the current scope"): kiln refuses that combination there."""
    import torch._dynamo

    return hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")


def dynamo_traces_data_dependent_splits() -> bool:
    """Whether dynamo compiles MoE's per-expert loop (kiln/model/moe.py `GroupedExperts.compute`
    where grouped_mm does not run: a split by sizes read from a tensor, then `new_zeros` of the
    rest): 2.10, 2.11 and 2.13 do; 2.6 fails on the unbacked sizes ("Failed running call_function
    split ... [u0, u1, u2, u3, -u0 - u1 - u2 - u3 + 128]"; a graph break around it is refused too,
    kiln compiles whole blocks), and 2.7-2.9 were not run and are taken alike. There train.compile
    with model.moe_experts is refused in one line (kiln/parallel/dims.py)."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 10)


def dynamo_traces_ring_objects() -> bool:
    """Whether dynamo compiles a block whose attention is cp's ring attention, given its `Ring`
    (kiln/parallel/context_parallel.py, a plain object holding the process group): 2.10, 2.11 and
    2.13 do; 2.6 fails ("Unexpected type in sourceless builder ... Ring"; a graph break around it
    is refused too, kiln compiles whole blocks), and 2.7-2.9 were not run and are taken alike. There
    train.compile with parallel.cp > 1 is refused in one line (kiln/parallel/dims.py)."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 10)


@functools.cache
def dynamo_traces_intermediate_hooks() -> bool:
    """Whether dynamo compiles (fullgraph) a `register_hook` on an intermediate tensor, as kiln's
    MoE does under expert parallelism (kiln/model/moe.py `GroupedExperts._local`: the hook on the
    local slice of each expert weight that reduces its gradient): 2.13 and 2.14 do; 2.6 and 2.10
    raise "Compilation of intermediate hooks requires compiled autograd". Probed: the same call on
    a two-element CPU tensor, traced by dynamo with the eager backend (about a second, once per
    process, only for a compiled run with ep > 1). There train.compile with parallel.ep > 1 is
    refused in one line (kiln/parallel/dims.py)."""
    import torch

    def hooked(x):
        y = x * 2
        y.register_hook(lambda grad: grad)
        return y.sum()

    try:
        torch.compile(hooked, fullgraph=True, backend="eager")(torch.ones(2, requires_grad=True))
    except Exception:  # dynamo's Unsupported (and whatever a release raises instead)
        return False
    return True


def shard_size_and_offset(size: int, n_shards: int, index: int) -> tuple[int, int]:
    """(rows, first row) of shard `index` of `size` rows split by DTensor's `Shard` over `n_shards`:
    `Shard.local_shard_size_and_offset` from 2.7; 2.6 has only `_local_shard_size_on_dim`."""
    from torch.distributed.tensor import Shard

    if hasattr(Shard, "local_shard_size_and_offset"):
        return tuple(Shard.local_shard_size_and_offset(size, n_shards, index))
    return tuple(Shard._local_shard_size_on_dim(size, n_shards, index, return_offset=True))


def fused_adam_across_meshes() -> bool:
    """Whether torch's multi-tensor Adam kernels step DTensors of several device meshes in one
    call: fused from 2.9 (pytorch/pytorch#157682, which keeps each `state_steps` on its own mesh).
    2.6's fused AdamW raises "DTensor does not support cross-mesh operation yet"; foreach before
    2.9 is taken to fail alike (not run). kiln/train/optim.py then steps one tensor at a time."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def schedule_scales_grads(schedule_class, params=()) -> bool:
    """Whether torch's pipeline schedules can divide each stage's gradients by the micro-batch
    count after its backward (`scale_grads`, from 2.7; 2.6's sum the micro-batches' gradients), so
    that otherwise the loss carries the division (kiln/parallel/pipeline_fp16.py ScaledLoss.divide).
    The schedule divides in place (`grad.div_`), and under tp a norm weight's gradient is a
    Partial(sum) DTensor until kiln settles it after the step: 2.10's DTensor refuses that ("in-place
    operations that require placement changes are not supported ... Partial(sum) to Replicate"),
    2.13's keeps it Partial. Probed when `params` hold a DTensor, on its mesh: a local tensor
    wrapped as Partial and divided in place, which no release communicates for (it either stays
    Partial or is refused before any redistribution)."""
    import inspect

    if "scale_grads" not in inspect.signature(schedule_class.__init__).parameters:
        return False
    return dtensor_divides_partial_in_place(params)


def dtensor_divides_partial_in_place(params) -> bool:
    """Whether `grad.div_(n)` works on a Partial(sum) DTensor on the mesh of the first DTensor
    in `params` (True when there is none). See `schedule_scales_grads`."""
    import torch
    from torch.distributed.tensor import DTensor, Partial

    mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
    if mesh is None:
        return True
    probe = DTensor.from_local(torch.ones(1, device=mesh.device_type), mesh, [Partial()] * mesh.ndim,
                               run_check=False)
    try:
        probe.div_(2.0)
    except RuntimeError:
        return False
    return True


def stage_placement_kwargs(schedule_class, stage_to_rank: dict[int, int]) -> dict:
    """What to pass a multi-stage schedule so that it knows which pp rank holds which stage. 2.6's
    ZBV takes `stage_index_to_group_rank` and, without it, assumes the looped placement (stage s
    on rank s mod pp): a V's last stage then took its predecessor for a local one and skipped
    receiving the shapes it infers from ("StageChunk.forward() missing 1 required positional
    argument"). Later releases derive the V themselves and take no such argument."""
    import inspect

    if "stage_index_to_group_rank" in inspect.signature(schedule_class.__init__).parameters:
        return {"stage_index_to_group_rank": stage_to_rank}
    return {}


def step_without_outputs(schedule) -> dict:
    """The keywords that make a pipeline schedule's `step` keep no merged outputs of the last
    stage: `return_outputs=False` from 2.7. 2.6's `step` passes unknown keywords on to the stages'
    forward and always concatenates the last stage's micro-batch outputs, which fails where they
    are the chunked loss's scalars ("zero-dimensional tensor cannot be concatenated"): there the
    schedule's merge is switched off on the instance instead."""
    import inspect

    if "return_outputs" in inspect.signature(schedule.step).parameters:
        return {"return_outputs": False}
    schedule._merge_outputs = lambda output_chunks: None
    return {}


def raise_recompile_limit(limit: int) -> None:
    """At least `limit` entries in dynamo's per-frame recompile cache: `recompile_limit`, which
    2.6 calls `cache_size_limit`."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))
