"""The one `parallelize` entry for kiln's transformer, applied to the model on the meta device.

Order (torchtitan's): pipeline split -> float8 -> tensor/sequence parallel -> activation
checkpointing -> compile -> FSDP/DDP (DDP and ZeRO-1 live in data_parallel.py). float8 comes before
TP as torchtitan converts its model first: torchao's float8 TP styles shard Float8Linear modules
(converting after TP would replace the sharded modules and drop TP's input/output hooks). On one
device float8, checkpointing and compile apply; a whole-model compile comes last, after data
parallelism.
Materialization and init come after this (see kiln/train/trainer.py), so sharded weights are
allocated sharded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

from kiln import torch_compat
from kiln.config import JobConfig
from kiln.errors import ConfigError
from kiln.model.moe import MoE
from kiln.parallel.data_parallel import apply_ddp
from kiln.parallel.dims import ParallelDims
from kiln.parallel.expert_parallel import compile_moe_steps, fully_shard_experts
from kiln.parallel.tensor_parallel import apply_tp


def replace_blocks(model: nn.Module, wrap) -> None:
    """Replace every block by wrap(layer index in the whole model, block). Under pp the rank's
    PipelineModel keys its layers by that index and its stage chunks get the same wrapper."""
    if hasattr(model, "replace_layers"):  # kiln/parallel/pipeline_stages.py PipelineModel
        model.replace_layers(wrap)
        return
    for i, block in enumerate(model.layers):
        model.layers[i] = wrap(i, block)


def keep_random_op_outputs(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy (torch's `create_selective_checkpoint_contexts`): the outputs of
    random ops (dropout; CPU's flash SDPA kernel, tagged random even at dropout 0) are kept from
    the forward, everything else is recomputed. Same values as replaying their RNG state.

    Why: under compile, torch 2.13's partitioner replays a recomputed random op on a non-CUDA
    device by returning its RNG state from the forward graph, placed before the symints but after
    the opaque objects saved for backward (`functionalize_rng_ops` in torch/_functorch/
    partitioners.py). A block with DTensor parameters (tp, ep) saves one: their DeviceMesh, an
    opaque type in compiled graphs since pytorch/pytorch#169867. The forward then fails ("expected
    all tensors_saved_with_vc_check to be Tensors", a DeviceMesh among them). No upstream issue
    found for it (searched 2026-11). CUDA replays with graph inputs (graphsafe RNG), not outputs,
    so GPUs never take this path. Pinned by a strict-xfail repro in
    tests/parallel/test_tensor_parallel_compile.py: when torch is fixed, this can go."""
    from torch.utils.checkpoint import CheckpointPolicy

    random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    return CheckpointPolicy.MUST_SAVE if random else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def compute_ops_kept() -> tuple[frozenset, frozenset]:
    """(matmuls, others) whose outputs `train.activation_checkpointing = "op"` keeps: the matmuls
    (torchao's float8 `_scaled_mm` and MoE's grouped GEMM where this torch has them), every SDPA
    kernel, FlexAttention and cp's ring attention, the collectives whose results backward would
    otherwise fetch again (tp's reduce-scatter, ep's all-to-all), and whole-tensor max (float8's
    amax, a scalar whose recompute would read the tensor again and, under tp, all-reduce).
    torchtitan's op-level list, with every matmul kept."""
    import kiln.parallel.ring_attention  # noqa: F401  (registers kiln::ring_attention)

    aten, funcol = torch.ops.aten, torch.ops._c10d_functional

    def ops(namespace, *names):
        return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}

    matmuls = ops(aten, "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
    others = ops(aten, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                 "_efficient_attention_forward")
    others |= ops(funcol, "reduce_scatter_tensor", "all_to_all_single") | ops(torch.ops.kiln, "ring_attention")
    others |= {aten.max.default}
    flex = getattr(torch._higher_order_ops, "flex_attention", None)  # a higher-order op, not an OpOverload
    return frozenset(matmuls), frozenset(others | ({flex} if flex is not None else set()))


def keep_compute_op_outputs(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy of `train.activation_checkpointing = "op"` (torch's
    `create_selective_checkpoint_contexts`): keep the outputs of matmuls, attention and tp/ep's
    reduce-scatter and all-to-all (`compute_ops_kept`) and of random ops (`keep_random_op_outputs`),
    recompute everything else in backward: norms, activations, RoPE, casts, elementwise ops, and
    tp's all-gathers, so a block keeps its normed inputs sequence-sharded and gathers them again in
    backward (what Megatron-LM's sequence parallelism does) instead of saving them whole.
    A row-parallel matmul (its input sharded on the contraction dimension, so its output is
    partial sums over the whole sequence) is recomputed: its reduce-scatter's output, 1/tp of
    it, is what is kept."""
    from torch.distributed.tensor import DTensor
    from torch.utils.checkpoint import CheckpointPolicy

    if keep_random_op_outputs(ctx, op) == CheckpointPolicy.MUST_SAVE:  # the one random-op rule
        return CheckpointPolicy.MUST_SAVE
    matmuls, others = compute_ops_kept()
    if op in matmuls:
        a = args[1] if op in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) else args[0]
        if isinstance(a, DTensor) and any(p.is_shard(a.ndim - 1) for p in a.placements):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_SAVE if op in others else CheckpointPolicy.PREFER_RECOMPUTE


def ignore_profiler_ops_in_selective_checkpoints() -> None:
    """Let torch's selective checkpoint pass the profiler's record-function markers through
    instead of replaying them by count (its `SAC_IGNORED_OPS`, which holds ops of that kind).

    Why: an FSDP unit inside a checkpointed block (the experts of ep under fsdp/zero2) opens more
    record-function ranges in the recompute than in the forward (its backward hooks), so the
    selective checkpoint `keep_random_op_outputs` needs under ep x tp stopped at the first
    backward ("profiler._record_function_enter_new.default invocation index 2 ... not found in
    storage", torch 2.13, 4 ranks on gloo). The markers compute nothing a block uses; a pending
    torch change does the same (pytorch/pytorch#196862). Idempotent: a set update."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    profiler = torch.ops.profiler
    SAC_IGNORED_OPS.update({profiler._record_function_enter_new.default, profiler._record_function_exit.default,
                            profiler._record_function_exit._RecordFunction})


def apply_activation_checkpointing(model: nn.Module, mode: str, keep_random_outputs: bool = False) -> None:
    """Recompute block activations in backward: every block (full), every other (selective) or
    every K-th (every_k:K, the setting kiln plan's activation-checkpoint planner writes). The
    rule is on the global layer index (blocks 0, K, 2K, ... of the whole model), so a pipeline
    rank checkpoints exactly the layers that one process would (torch's checkpoint_wrapper).
    "op": every block, keeping its matmul and attention outputs (`keep_compute_op_outputs`,
    torchtitan's op-level selective checkpointing): the cheap ops are recomputed, no matmul is.
    `keep_random_outputs`: compiled blocks keep their random ops' outputs instead of recomputing
    them (`keep_random_op_outputs`, a torch 2.13 workaround that parallelize applies off CUDA;
    "op" keeps them anyway)."""
    k = {"full": 1, "selective": 2, "op": 1}.get(mode) or int(mode.removeprefix("every_k:"))
    # A MoE block sets its aux/z losses as attributes in forward (kiln/model/moe.py), a side effect
    # that dynamo refuses inside a compiled checkpoint ("HOP: Unsafe side effect": train.compile
    # with AC and MoE failed at the first step). They are read once, right after forward, so the
    # recompute in backward need not replay it (torchtitan sets the same when compiling MoE).
    with contextlib.suppress(AttributeError):  # torch 2.6 has no such switch (an unknown key raises)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    kwargs = {"preserve_rng_state": True}
    if keep_random_outputs or mode == "op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        ignore_profiler_ops_in_selective_checkpoints()
        policy = keep_compute_op_outputs if mode == "op" else keep_random_op_outputs
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    replace_blocks(model, lambda i, block: checkpoint_wrapper(block, **kwargs) if i % k == 0 else block)


def check_float8_device(device: torch.device) -> None:
    """train.float8's requirements, checked before any work (kiln/train/trainer.py) and again here:
    a GPU with float8 tensor cores, and torchao installed."""
    from kiln.errors import ConfigError

    if device.type != "cuda":
        raise ConfigError("train.float8=true needs a CUDA GPU with float8 tensor cores (e.g. H100); "
                          "set train.float8=false on this device")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"train.float8=true needs float8 tensor cores (compute capability >= 8.9); "
                          f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}; "
                          f"set train.float8=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("train.float8=true needs torchao: pip install 'kiln-lm[float8]'") from None
    except AttributeError as e:  # a torchao built for a newer torch (0.18 on torch 2.6)
        raise ConfigError(f"train.float8=true: torchao does not import with torch {torch.__version__} ({e}); "
                          f"install the torchao release made for this torch") from None


def apply_float8(model: nn.Module, recipe: str, device: torch.device, emulate: bool = False) -> None:
    """Swap the blocks' nn.Linear for torchao's float8 training linear (dynamic scaling, per
    tensor or per row). The LM head stays in bf16 (its loss is sensitive; torchtitan does the
    same), as do the MoE routers (routing reads their weight in fp32, kiln/model/moe.py) and any
    linear whose dimensions are not multiples of 16 (a float8 GEMM limit). Runs before tensor
    parallelism, which then gives the float8 linears torchao's float8 TP styles (tensor_parallel.py).

    `emulate` (tests only, not a config key): torchao's fp32 emulation of the float8 GEMMs, the same
    casts and scales, on any device; `kiln train` never sets it, so float8 stays GPU-only there."""
    if not emulate:
        check_float8_device(device)
    from torchao.float8 import Float8LinearConfig

    convert_float8(model, dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate))


def convert_float8(model: nn.Module, config) -> None:
    """torchao's swap of the eligible block linears (see apply_float8) for a Float8LinearConfig.
    Under pp `model` is the rank's PipelineModel: its fqns are the whole model's (`layers.N...`,
    `output`), so the filter keeps the head out on the last stage, and torchao swaps each linear
    in its parent module, which the stage chunks share, so the chunks run the float8 linears."""
    from torchao.float8 import convert_to_float8_training

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn.startswith("layers.") and not fqn.endswith(".router")
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def compile_scope(cfg: JobConfig, dims: ParallelDims) -> str:
    """"model" (one graph: forward, LM head and loss) on one device, "blocks" under sharding,
    where FSDP needs a module boundary per block to gather and free its parameters."""
    if cfg.train.compile_scope != "auto":
        return cfg.train.compile_scope
    return "blocks" if dims.world_size > 1 else "model"


def wait_collective_inputs(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a compiled block: an input still in flight from an eager collective
    (an `AsyncCollectiveTensor`, e.g. `to_local()` of the tensor-parallel embedding's
    reduce-scatter) enters the graph as a plain tensor that keeps its autograd edge.

    Why: torch 2.13's AOTAutograd resolves such inputs with `trigger_wait()`, which drops
    `requires_grad` (pytorch/pytorch#179849; the proposed fix, #191113, is not in 2.13): the block
    is traced as if its input needed no gradient, and the backward never reaches the embedding
    (AttributeError '_local_tensor' in its redistribute, or, under FSDP, silently wrong training).
    `clone()` waits through the tensor's own dispatch and records an ordinary CloneBackward; it
    costs one copy of the first block's input per step (only the eager embedding hands a block
    an in-flight tensor; compiled blocks return plain ones). A MoE block compiled piecewise (ep
    under fsdp/zero2, `apply_compile`) has it on each wrapped child: the first block's first
    piece (its attention norm) takes that embedding output (tests/parallel/
    test_expert_parallel_compile.py's negative control: ep x tp with the pieces not waiting trains
    wrong). Pinned by a strict-xfail repro in
    tests/parallel/test_tensor_parallel_compile.py: when torch is fixed, this hook can go."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if not any(isinstance(a, AsyncCollectiveTensor) for a in args):
        return args
    return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def keep_tp_embedding_eager(root: nn.Module) -> None:
    """Under tp, a whole-model (or stage-chunk) graph leaves the vocab-sharded embedding out: it
    runs eagerly (torch.compiler.disable), its output waited for before the graph takes it.

    Why: torch 2.13's AOTAutograd fails to trace the embedding's MaskPartial (its mask buffer is
    made in another fake mode: "Mixing fake modes NYI" in _ops/_mask_buffer.py, seen with tp=2 on
    CPU); per-block compile never has the embedding in a graph either. Its output is an in-flight
    reduce-scatter (AsyncCollectiveTensor) that would lose its gradient entering the graph
    (`wait_collective_inputs`), so the wait runs inside the eager part, as the embedding's last
    forward hook. The wrapper is an OptimizedModule: checkpoint names drop its `_orig_mod`, as
    for compiled blocks."""
    from torch.distributed.tensor import DTensor

    embedding = getattr(root, "tok_embeddings", None)
    if embedding is None or not isinstance(embedding.weight, DTensor):
        return
    embedding.register_forward_hook(lambda module, args, out: wait_collective_inputs(module, (out,))[0])
    root.tok_embeddings = torch.compiler.disable(embedding)


def compile_mode(cuda_graphs: bool, autotune: bool) -> str | None:
    """torch.compile's mode for train.cuda_graphs and train.autotune (None: its default)."""
    if autotune:
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if cuda_graphs else None


def apply_compile(model: nn.Module, scope: str, cuda_graphs: bool = False, experts_fsdp: bool = False,
                  autotune: bool = False) -> None:
    """torch.compile, in one graph for the whole model ("model"; under pp one per stage chunk) or per
    block ("blocks"), each
    block whole (fullgraph). `experts_fsdp` (ep under fsdp/zero2): a MoE block's experts will be
    their own FSDP unit, whose hooks dynamo does not trace (torch 2.13: "Attempted to call
    function marked as skipped" at the first step), so such a block is compiled piecewise, as
    torchtitan does: each child but the MoE (attention, norms), and the MoE's routing,
    experts' math and weighted sum as separate graphs (expert_parallel.py `compile_moe_steps`),
    leaving the block's residual adds, the all-to-all and the FSDP hooks eager; each wrapped
    child waits for its in-flight collective inputs first, as whole blocks do
    (`wait_collective_inputs`; the MoE's steps were seen to receive none under tp). Under activation
    checkpointing the pieces are compiled inside the (eager) checkpoint wrapper. Dense blocks,
    and MoE blocks under ddp, are compiled whole."""
    if scope == "model":
        # In place (nn.Module.compile), so parameter names and checkpoints stay the same. Under pp
        # the schedule calls the rank's stage chunks (kiln/parallel/pipeline_stages.py StageChunk), not the
        # model: each chunk is one graph (embedding, its blocks, and on the last stage the head, with
        # train.loss = "chunked" the loss too; the schedule's full loss stays eager). Under tp the
        # graph holds the blocks and the vocab-sharded head; the embedding (keep_tp_embedding_eager)
        # and the loss under loss_parallel (functional.parallel_lm_loss: dynamo traces it
        # without loss_parallel's context, "got mixed torch.Tensor and DTensor") run eagerly around it.
        for root in getattr(model, "chunks", [model]):
            keep_tp_embedding_eager(root)
            root.compile(mode=compile_mode(cuda_graphs, autotune))
        return
    # Per block: every block has the same graph, so one compilation serves all of them (under pp
    # the blocks of every stage chunk of this rank). The hook runs eagerly, before the graph
    # (FSDP's pre-forward hooks gather parameters; order is moot).
    def compile_block(i: int, block: nn.Module) -> nn.Module:
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        if experts_fsdp and any(isinstance(m, MoE) for m in inner.children()):
            # torch.compile of a torch.nn module (a norm, dropout) runs through dynamo's wrap_inline,
            # whose one `inner` frame every such piece shares: each module type, hook set and grad
            # mode is one more entry in that frame's recompile cache, 7 here on torch 2.13 and past
            # the default limit of 8 on 2.11 (its evaluation under no_grad adds entries), a hard
            # failure under fullgraph. These are distinct graphs, not thrashing: allow more.
            torch_compat.raise_recompile_limit(64)
            for name, child in inner.named_children():
                if isinstance(child, MoE):
                    compile_moe_steps(child)
                else:  # wrapped as the whole blocks are (torch.nn's own forwards cannot be compiled in place)
                    piece = torch.compile(child, fullgraph=True, mode=compile_mode(False, autotune))
                    piece.register_forward_pre_hook(wait_collective_inputs)
                    setattr(inner, name, piece)
            return block
        compiled = torch.compile(block, fullgraph=True, mode=compile_mode(False, autotune))
        compiled.register_forward_pre_hook(wait_collective_inputs)
        return compiled

    replace_blocks(model, compile_block)


def own_embedding_unit(model: nn.Module) -> list[nn.Module]:
    """The token (and learned position) embeddings, when they are an FSDP unit of their own: not
    when the head shares the token embedding's weight (tie_embeddings: the root's then), nor on
    a pipeline stage without them."""
    tokens = getattr(model, "tok_embeddings", None)
    head = getattr(model, "output", None)
    if tokens is None or (head is not None and head.weight is tokens.weight):
        return []
    return [m for m in (tokens, getattr(model, "pos_embeddings", None)) if m is not None]


def apply_fsdp(model: nn.Module, dims: ParallelDims, param_dtype: torch.dtype | None, cpu_offload: bool,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool | int = True,
               mesh_names: tuple[str, ...] | None = None) -> None:
    """FSDP2 over the data-parallel mesh: 1-D (dp_shard) shards, 2-D (dp_replicate x dp_shard) is
    HSDP (sharded within a replica group, all-reduced across groups). reshard_after_forward=True
    is ZeRO-3; False keeps each block's parameters gathered from forward to backward (ZeRO-2:
    parameters are still stored sharded between steps, gradients and optimizer state always); an
    int k (parallel.fsdp_reshard_to) reshards them over k consecutive shard ranks after forward,
    so backward gathers over those alone (torch's; ZeRO++'s hpZ). parallel.ep's experts, an FSDP
    unit over their own mesh, are resharded in full."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    names = mesh_names or dims.grad_mesh_names
    if "cp" in names and len(names) > 1:  # cp shards with dp_shard (torchtitan's dp_shard_cp)
        shard = tuple(n for n in names if n != "dp_replicate")
        if len(shard) > 1:
            dims.mesh[shard]._flatten("dp_shard_cp")
            names = tuple(n for n in names if n not in shard) + ("dp_shard_cp",)
    mesh = dims.mesh[names]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:  # gloo cannot all-gather pinned CPU tensors; pin_memory=False is required on CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    try:
        for i, block in enumerate(model.layers):
            # The last block is not resharded after forward: backward needs it first.
            reshard = reshard_after_forward if i < len(model.layers) - 1 else False
            if dims.ep > 1:  # the experts: their own FSDP unit over edp (kiln/parallel/expert_parallel.py)
                fully_shard_experts(block, dims.expert_mesh, reshard_after_forward=reshard is not False,
                                    **{k: v for k, v in kwargs.items() if k != "mesh"})
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        embedding = own_embedding_unit(model)
        if embedding:  # gathered for its forward only: its backward reads no weight
            fully_shard(embedding, reshard_after_forward=True, **kwargs)
            embedding[0].set_unshard_in_backward(False)
        # The root (the head and final norm, and a tied embedding) stays gathered from forward into
        # backward, which starts with the head: torch's default for a root, which an explicit True
        # (torch >= 2.9) would override with a second all-gather of its parameters every step.
        fully_shard(model, reshard_after_forward=False, **kwargs)
    except NotImplementedError as e:  # torch 2.7: a tp shard that does not split evenly over FSDP's ranks
        if torch_compat.fsdp_shards_tp_unevenly() or "uneven sharding" not in str(e):
            raise
        raise ConfigError(f"parallel.dp_mode={dims.dp_mode!r} with parallel.tp={dims.tp} under torch "
                          f"{torch.__version__}: this FSDP2 cannot shard a tensor parallel shard unevenly ({e}); "
                          f"make the model's sizes divisible by tp x the FSDP ranks, set parallel.dp_mode='ddp', "
                          f"or use torch >= 2.8") from None
    if mesh.device_type == "cpu":  # torch 2.8's gloo sums where FSDP asks it to average
        torch_compat.force_sum_for_gloo(model)


def apply_ep(model: nn.Module, dims: ParallelDims) -> None:
    """Experts sharded over ep (dims.expert_mesh); over the other data-parallel (and cp) ranks
    FSDP-sharded (fsdp/zero2, in apply_fsdp) or replicated (ddp). Gradients are averaged over
    dp x cp ranks (under DiLoCo a replica's own), as the dense ones (grad_mesh_names)."""
    from kiln.parallel.expert_parallel import apply_expert_parallel_training

    apply_expert_parallel_training(model, dims.expert_mesh, dims.grad_ranks,
                                   fsdp=dims.dp_mode in ("fsdp", "zero2"), node_groups=dims.expert_node_groups,
                                   wire_dtype=dims.grad_wire_dtype, per_backward=dims.pp > 1)


def parallelize(model: nn.Module, dims: ParallelDims, cfg: JobConfig, device: torch.device) -> nn.Module:
    if dims.pp > 1:  # this rank keeps its stages' modules (kiln/parallel/pipeline_stages.py)
        from kiln.parallel.pipeline_stages import split_model

        model = split_model(model, cfg, dims.mesh["pp"].get_local_rank())
    if cfg.train.float8:  # before TP, which picks torchao's float8 styles for the float8 linears
        apply_float8(model, cfg.train.float8_recipe, device)
    if dims.tp > 1:
        apply_tp(model, dims.mesh["tp"], shard_experts=not dims.ep_borrows_tp)
    if dims.ep > 1:  # before FSDP, which leaves the experts (DTensors on its own mesh) to EP
        apply_ep(model, dims)
    experts_fsdp = dims.ep > 1 and dims.dp_mode in ("fsdp", "zero2")  # MoE blocks compiled piecewise
    if cfg.train.activation_checkpointing != "none":
        # Where torch 2.13 cannot replay a random op next to a saved DeviceMesh (keep_random_op_outputs).
        # Not for ep alone under fsdp/zero2: no piece's graph holds a DTensor (the experts' math takes
        # local weights). Under ep x tp the experts' FSDP unit sits inside the selective checkpoint
        # (ignore_profiler_ops_in_selective_checkpoints).
        mesh_saved = dims.tp > 1 or (dims.ep > 1 and not experts_fsdp)
        keep_random = cfg.train.compile and device.type != "cuda" and mesh_saved
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing, keep_random)
    scope = compile_scope(cfg, dims)
    if cfg.train.compile and scope == "blocks":
        apply_compile(model, "blocks", experts_fsdp=experts_fsdp, autotune=cfg.train.autotune)
    # Context parallel needs no module change (its attention is swapped in per step, see
    # context_parallel.py), only the gradient average over cp, which data parallelism does.
    # DiLoCo: each replica trains alone, data parallel over its own dp_shard x cp ranks at most
    # (grad_mesh_names leaves dp_replicate out); the replicas meet in kiln/parallel/diloco.py.
    if dims.grad_mesh_names:
        apply_data_parallel(model, dims, cfg, device)
    if cfg.train.compile and scope == "model":
        apply_compile(model, "model", cfg.train.cuda_graphs, autotune=cfg.train.autotune)
    return model


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig, device: torch.device,
                        mesh_names: tuple[str, ...] | None = None) -> None:
    """The last stage: ddp/zero1 replicate (zero1's optimizer side is in data_parallel.py);
    zero2/fsdp/hsdp shard with FSDP2 (over `mesh_names` when given: DiLoCo's dp_shard alone)."""
    if dims.dp_mode in ("ddp", "zero1"):
        if dims.pp == 1:  # under pp: DDP per stage chunk, wrapped once materialized (Pipeline, replicate_stage)
            apply_ddp(model, dims, cfg.train.grad_accum)
        return
    # Mixed precision: compute in bf16 on GPUs when train.dtype=bf16 (autocast does it on CPU).
    param_dtype = torch.bfloat16 if (cfg.train.dtype == "bf16" and device.type == "cuda") else None
    reduce_dtype = dims.grad_wire_dtype or torch.float32
    for root in getattr(model, "chunks", [model]):  # under pp: FSDP per stage (what the schedule calls)
        apply_fsdp(root, dims, param_dtype, cpu_offload=cfg.parallel.cpu_offload or device.type == "cpu",
                   reduce_dtype=reduce_dtype, mesh_names=mesh_names,
                   reshard_after_forward=dims.dp_mode != "zero2" and (cfg.parallel.fsdp_reshard_to or True))
