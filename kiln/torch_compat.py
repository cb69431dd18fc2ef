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
    """Two gaps of torch's pipeline schedules on gloo, closed by replacing the schedules'
    `_batch_p2p` where they are (returns whether it was replaced):
    - Before 2.7 it waited on one `Work` of each batched send/receive (`batch_isend_irecv(ops)
      .pop()`): right for NCCL, which coalesces a batch into one `Work`, but gloo returns one per
      op, and the ones left unwaited deadlock 1F1B's fused send/receive phase (torch 2.6, 2 ranks:
      each waits in its fused exchange forever; pytorch/pytorch#132644, fixed by #152938, which
      added `_wait_batch_p2p`). Here the returned `Work` waits on all.
    - Before 2.10 the multi-stage runtime sends between two stages on one rank like between ranks
      (ZBV's V holds stages r and 2pp-1-r, and its middle two are neighbours): a send to this rank
      itself, which gloo has no pair for (2.6: "writev: Bad file descriptor"; 2.8: "Pair is not
      connected"; 2.10 and later do not send it; 2.7 and 2.9 are taken like 2.8 and their ZBV tests
      pass so). Here such sends and receives are matched in order, as gloo matches one peer's
      messages, and copied locally. Where `_wait_batch_p2p` exists (2.7+) the replacement returns a
      list, as it expects."""
    import collections

    import torch
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules, "_batch_p2p"):
        return False
    listed = hasattr(schedules, "_wait_batch_p2p")  # 2.7+: callers wait on a list of Works
    if listed and torch.torch_version.TorchVersion(torch.__version__) >= (2, 10):
        return False
    self_exchange = {"sends": collections.deque(), "recvs": collections.deque()}

    def batch_p2p(p2p_ops, desc=None):
        if not p2p_ops:
            return [] if listed else None
        me, remote = dist.get_rank(), []
        for op in p2p_ops:
            if op.peer != me:
                remote.append(op)
            else:
                self_exchange["sends" if op.op.__name__ == "isend" else "recvs"].append(op.tensor)
        with torch.no_grad():
            while self_exchange["sends"] and self_exchange["recvs"]:
                self_exchange["recvs"].popleft().copy_(self_exchange["sends"].popleft())
        works = _AllWorks(dist.batch_isend_irecv(remote) if remote else [], self_exchange)
        return [works] if listed else works

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
      neighbouring stages on one rank, and gloo has no pair to itself ("Pair is not connected").
      And 2.9 sends `torch.tensor(stage_index)` (int64, 8 bytes) into the neighbour's float32
      receive of one element (4 bytes): gloo aborts the process ("op.preamble.length <= op.nbytes.
      8 vs 4"), so every pipeline on CPU died at its first step (2.10 sends float32). The value is
      never read: each such send is given the receive's dtype and shape."""
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
            if exchanges_with_itself:
                ops = [op for op in ops if op.group_peer != self.group_rank]
            return [op if op.tensor.dtype == torch.float32 else
                    dist.P2POp(op.op, op.tensor.float().reshape(1), group=op.group, group_peer=op.group_peer)
                    for op in ops]

    if not hasattr(PipelineStage, "_shape_inference"):
        del KilnPipelineStage._shape_inference
    if not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
        del KilnPipelineStage._get_init_p2p_neighbors_ops
    return KilnPipelineStage


@functools.cache
def input_pass_skips_inputs_without_grad() -> bool:
    """Whether torch's zero-bubble input pass (pipelining/_backward.py stage_backward_input) leaves
    out stage inputs that need no gradient, such as packed documents' ids passed as a keyword of
    the schedule (kiln/parallel/pipeline.py). 2.9 filters them; 2.6 differentiates every input
    ("One of the differentiated Tensors does not require grad"). Probed on three-element tensors."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input

    x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    try:
        stage_backward_input([(x * w).sum()], None, [x, torch.zeros(3, dtype=torch.long)], iter([w]))
    except RuntimeError:
        return False
    return True


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


_GLOO_REDUCE_SCATTER_AVERAGES: list[bool] = []  # the probe's answer, once per process


def gloo_reduce_scatter_averages() -> bool:
    """Whether gloo's `reduce_scatter_tensor` with `ReduceOp.AVG` averages. torch 2.6's and 2.8's
    sum without a word ([1, 1] and [2, 2] over two ranks give [3] each; 2.8's all_reduce does
    average, pytorch/pytorch#149781; 2.6's refuses AVG), 2.10's and 2.13's average. FSDP2
    reduce-scatters fp32 and bf16 gradients with AVG, so on 2.8 FSDP on CPU trained on the sum of
    the data-parallel ranks' gradients (the 2-rank fsdp test's step 2 loss 5.408 against one
    process's 5.474). Where it sums, kiln makes
    FSDP reduce with SUM and divide after (`force_sum_for_gloo`). Probed once per process: one
    reduce-scatter of world-size elements on the default group, so every rank must call this at
    the same point (ParallelDims.build_mesh does, for CPU meshes, before any FSDP)."""
    import torch

    if not _GLOO_REDUCE_SCATTER_AVERAGES:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return True  # nothing to average; not cached, a later process group is probed then
        out = torch.empty(1)
        try:  # a release that refuses AVG does so before communicating (2.6's all_reduce does)
            reduce_scatter_single(out, torch.full((world,), float(dist.get_rank())), op=dist.ReduceOp.AVG)
        except RuntimeError:
            _GLOO_REDUCE_SCATTER_AVERAGES.append(False)
        else:
            _GLOO_REDUCE_SCATTER_AVERAGES.append(abs(float(out) - (world - 1) / 2) < 1e-6)
    return _GLOO_REDUCE_SCATTER_AVERAGES[0]


def force_sum_for_gloo(model) -> None:
    """Every FSDP2 unit in `model` reduces its gradients with SUM and divides by the data-parallel
    size after, where gloo's AVG reduce-scatter sums (`gloo_reduce_scatter_averages`); elsewhere
    nothing changes. From 2.8 FSDP's own `set_force_sum_reduction_for_comms`; on 2.7, which lacks
    it, the param group's reduce op is set to SUM (the attribute 2.7's own
    `set_reduce_scatter_divide_factor` sets, there to NCCL's PreMulSum) and `set_all_reduce_hook`
    (which runs on the reduce-scatter output of 1-D FSDP) divides by the group's size. 2.7's HSDP
    all-reduces with AVG, which its gloo refuses: refused in one line (`fsdp_can_force_sum`)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from kiln.errors import KilnError

    # FSDP2 that cannot run on CPU at all (2.6) fails at its first all-gather: kiln's trainer refuses it
    if gloo_reduce_scatter_averages() or not fsdp_runs_on_cpu():
        return
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        hsdp = group is not None and group._is_hsdp
        if not fsdp_can_force_sum(hsdp=hsdp):
            over, instead = (" over dp_replicate (HSDP)", " or parallel.dp_replicate=1") if hsdp else ("", "")
            raise KilnError(f"FSDP2 on CPU under torch {torch.__version__}: gloo sums the gradients where FSDP "
                            f"asks it to average, and this FSDP2 cannot be told to sum instead{over}; set "
                            f"parallel.dp_mode='ddp'{instead} or use torch >= 2.8")
        if hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
        elif group is not None:
            group.reduce_scatter_reduce_op = dist.ReduceOp.SUM
            size = group._reduce_scatter_process_group.size()
            module.set_all_reduce_hook(lambda reduce_output, size=size: reduce_output.div_(size))


def fsdp_can_force_sum(hsdp: bool = False) -> bool:
    """Whether FSDP2 can be told to reduce gradients with SUM and divide after: kiln's way round
    gloo's summing AVG reduce-scatter (`force_sum_for_gloo`). From 2.8 FSDP's own
    `FSDPModule.set_force_sum_reduction_for_comms`; 2.7 through its reduce-scatter op and
    `set_all_reduce_hook`, for 1-D FSDP only (`hsdp` False): its HSDP all-reduce asks gloo for
    AVG, which 2.7's gloo refuses ("Cannot use ReduceOp.AVG with Gloo"). 2.6 has no all-reduce
    hook (and its FSDP2 does not run on CPU)."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        return True
    return not hsdp and hasattr(FSDPModule, "set_all_reduce_hook")


def fsdp_set_reshard_after_forward(module, reshard: bool, recurse: bool = True) -> None:
    """`FSDPModule.set_reshard_after_forward(reshard, recurse)` (from 2.8) on `module`; on 2.7,
    which lacks it, what that method sets: each param group's post-forward mesh info, None for no
    reshard, as `fully_shard(reshard_after_forward=...)` computes it. (2.7's lazy init at the first
    forward sets an FSDP root's to None whatever was set: a root is never resharded after forward.)"""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "set_reshard_after_forward"):
        module.set_reshard_after_forward(reshard, recurse=recurse)
        return
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    for m in module.modules() if recurse else [module]:
        if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group) is not None:
            group.post_forward_mesh_info = _get_post_forward_mesh_info(reshard, group.mesh_info)


def fsdp_shards_tp_unevenly() -> bool:
    """Whether FSDP2 shards a tensor parallel DTensor whose first dimension does not split evenly
    over the FSDP ranks (2.8 on; 2.7: NotImplementedError "FSDP+TP sharding does not support
    uneven sharding", e.g. a 262-row vocabulary over tp 2 x fsdp 2). Where it cannot, kiln's
    `apply_fsdp` turns that error into one line."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def gpipe_takes_fewer_microbatches() -> bool:
    """Whether torch's `ScheduleGPipe` runs fewer micro-batches than pipeline stages: 2.11 to
    2.13 do (only `Schedule1F1B` refuses them, checked in each one's source and 2.12/2.13 by a
    test); 2.6-2.10 refuse them in every single-stage schedule (`PipelineScheduleSingle.__init__`).
    kiln's pipeline check (`pipeline_layout.check_pipeline_config`) says so in one line where
    torch would raise."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 11)


def max_autotune_trains_exactly() -> bool:
    """Whether torch.compile's max-autotune (train.autotune) gives eager's gradients: 2.6's CPU
    inductor in that mode returns a wrong gradient for a tied embedding (seen: 0.028 off in 0.18
    on kiln's test model, tests/parallel/test_parallelize.py; its default mode exact); 2.7 and
    later match eager within fp32 noise. kiln's trainer refuses train.autotune before 2.7."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 7)


def same_layout(a, b) -> bool:
    """Whether two DTensors have one mesh and one placement per dimension, type included: a
    `_StridedShard` compares equal to the `Shard` of its dim, yet places other rows."""
    pairs = zip(a.placements, b.placements)
    return a.device_mesh == b.device_mesh and all(type(x) is type(y) and x == y for x, y in pairs)


def optimizer_state_like_parameters(optim_state: dict, model_state: dict) -> list[str]:
    """Give each DTensor optimizer state of a parameter's shape the parameter's own DTensor layout
    (same local tensor, no copy), in a `get_state_dict` pair; returns the keys it changed. torch
    2.8's FSDP2 leaves the optimizer state of experts sharded by FSDP over edp on top of ep's
    Shard(0) (a strided shard) with another layout than the parameter's, so DCP wrote their chunks
    at other experts' offsets: on 4 ranks (ep 2, edp 2) the experts' momentum was saved in the
    order 0, 2, 1, 3, and a checkpoint continued in another layout stepped with another expert's
    momentum (the same layout read it back the same wrong way, so it went unseen). Where the layouts
    already agree (2.10, 2.13) nothing changes."""
    from torch.distributed.tensor import DTensor

    changed = []
    for name, state in optim_state.get("state", {}).items():
        param = model_state.get(name)
        if not isinstance(param, DTensor) or not isinstance(state, dict):
            continue
        for key, value in state.items():
            if (isinstance(value, DTensor) and value.shape == param.shape
                    and not same_layout(value, param) and value.to_local().shape == param.to_local().shape):
                state[key] = DTensor.from_local(value.to_local(), param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())
                changed.append(f"{name}.{key}")
    return changed


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
    (2.11 passes, 2.6 fails; 2.7-2.10 pass their tp tests with this) the schema of
    `embedding_dense_backward` left its `num_weights` (the rows) out of the cache key: under tp, the backward of a second embedding of
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
    kiln compiles whole blocks), 2.9 on the host read of the sizes ("DataDependentOutputException:
    aten._local_scalar_dense.default"), and 2.7-2.8 are taken alike (not run with the gate
    lowered). There train.compile with model.moe_experts is refused in one line
    (kiln/parallel/dims.py)."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 10)


def dynamo_traces_ring_objects() -> bool:
    """Whether dynamo compiles a block whose attention is cp's ring attention, given its `Ring`
    (kiln/parallel/ring_attention.py, a plain object holding the process group): 2.9, 2.10, 2.11
    and 2.13 do; 2.6 fails ("Unexpected type in sourceless builder ... Ring"; a graph break around
    it is refused too, kiln compiles whole blocks), and 2.7-2.8 are taken alike (not run with the
    gate lowered). Ulysses' all-to-alls (kiln/parallel/ulysses.py) compile on 2.9-2.13 too; on 2.6
    inductor hands the all-to-all a non-contiguous buffer ("Tensors must be contiguous"). There
    train.compile with parallel.cp > 1 is refused in one line (kiln/parallel/dims.py)."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


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


def fsdp_shards_2d_dtensors() -> bool:
    """Whether FSDP2 shards a parameter that is already a DTensor of two placements, as MoE experts
    are under ep x tp with etp = tp (Shard over ep, Shard over tp): 2.9 and 2.10 do ("2D EP+TP",
    the ep x tp equivalence tests pass); 2.8's FSDP takes 1-D TP only ("FSDP only supports 1D TP,
    not (Shard(dim=0), Shard(dim=2))"), and 2.7 is taken alike (its FSDP on CPU is refused anyway,
    `fsdp_can_force_sum`). There fsdp/zero2 with ep x tp (etp = tp) is refused in one line
    (kiln/parallel/dims.py `ParallelDims.check_model`); etp = 1 keeps the experts 1-D."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def dtensor_takes_float8_scales() -> bool:
    """Whether DTensor can compute torchao's float8 scales of a sharded tensor: 2.7 on (the float8
    TP tests pass there, docs/torch-range.md); 2.6 has no sharding rule for the amax they take
    ("Operator aten.amax.default does not have a sharding strategy registered", torchao 0.10), so
    there train.float8 with parallel.tp > 1 is refused in one line (ParallelDims.check_model)."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 7)


def shard_size_and_offset(size: int, n_shards: int, index: int) -> tuple[int, int]:
    """(rows, first row) of shard `index` of `size` rows split by DTensor's `Shard` over `n_shards`:
    `Shard.local_shard_size_and_offset` in 2.10 and later, `_local_shard_size_and_offset` in 2.8,
    `_local_shard_size_on_dim` in 2.6."""
    from torch.distributed.tensor import Shard

    for name in ("local_shard_size_and_offset", "_local_shard_size_and_offset"):
        if hasattr(Shard, name):
            return tuple(getattr(Shard, name)(size, n_shards, index))
    return tuple(Shard._local_shard_size_on_dim(size, n_shards, index, return_offset=True))


def fused_adam_across_meshes() -> bool:
    """Whether torch's multi-tensor Adam kernels step DTensors of several device meshes in one
    call: fused from 2.9 (pytorch/pytorch#157682, which keeps each `state_steps` on its own mesh).
    2.6's fused AdamW raises "DTensor does not support cross-mesh operation yet"; foreach before
    2.9 is taken to fail alike (not run). kiln/train/optim.py then steps one tensor at a time."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def schedule_grad_scaling(schedule_class, params=()) -> dict:
    """The `scale_grads` keyword for a pipeline schedule: {"scale_grads": True} where the schedule
    can divide each stage's gradients by the micro-batch count after its backward; else the
    schedule sums them ({"scale_grads": False}, or {} on 2.6, whose schedules take no such
    keyword and always sum) and the loss must carry the division (kiln/parallel/pipeline_fp16.py
    ScaledLoss.divide).
    The schedule divides in place (`grad.div_`), and under tp a norm weight's gradient is a
    Partial(sum) DTensor until kiln settles it after the step: 2.13's DTensor keeps it Partial and
    divides each rank's part; 2.10's refuses ("in-place operations that require placement changes
    are not supported ... Partial(sum) to Replicate"); 2.8's reduces it, divides, and keeps the
    Partial placement, so the gradient it leaves is the tp degree times too large, silently.
    Probed when `params` hold a DTensor, on its mesh (`dtensor_divides_partial_in_place`).
    Before the runtime scaled in a REDUCE_GRAD action of its own (2.9 has none; 2.11 and 2.13 do),
    `_PipelineScheduleRuntime` divided a stage's gradients only when its last backward was a full
    one, and DualPipeV (the one schedule on that runtime there) ends every stage with a weight
    pass: on 2.9 its gradients came out the micro-batch count times too large (grad norm 3.34
    against 1.10 at 4 micro-batches, tests/parallel/test_pipeline_parallel.py). There the loss
    divides instead."""
    import inspect

    from torch.distributed.pipelining import schedules

    if "scale_grads" not in inspect.signature(schedule_class.__init__).parameters:
        return {}
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if runtime is not None and issubclass(schedule_class, runtime) and not hasattr(schedules, "REDUCE_GRAD"):
        return {"scale_grads": False}
    return {"scale_grads": dtensor_divides_partial_in_place(params)}


def dtensor_divides_partial_in_place(params) -> bool:
    """Whether `grad.div_(n)` divides a Partial(sum) DTensor right, on the mesh of the first
    DTensor in `params` (True when there is none). See `schedule_grad_scaling`. Every rank of that
    mesh must call this at the same point: the probe (a local 1 on each rank wrapped as Partial,
    divided by 2 in place) is refused before any communication, or its full value (the mesh size
    / 2 when right) is read with a collective."""
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
    return abs(float(probe.full_tensor()) - mesh.size() / 2) < 1e-6


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


def process_groups() -> list:
    """Every process group this rank belongs to (torch keeps them in the private `_world.pg_map`,
    the same name in 2.6-2.13; the groups DeviceMesh and `new_group` create included)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def set_group_timeout(group, seconds: float) -> bool:
    """How long `group`'s collectives wait from now on (torch's private `_set_pg_timeout`, 2.6-2.13).
    False where that cannot change it: gloo before torch 2.9 takes the new value and goes on waiting
    by the one its transport was created with (2.6, 2.7 and 2.8, measured: a 3 s bound set on a
    group still waited the 8 s its peer was late); NCCL's and 2.9's gloo's apply it."""
    import datetime

    from torch.distributed import distributed_c10d

    if "nccl" not in str(dist.get_backend(group)) and not gloo_timeouts_change():
        return False
    distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)
    return True


def gloo_timeouts_change() -> bool:
    """Whether a gloo group's timeout can change after its creation (`set_group_timeout`): 2.9 on."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)
