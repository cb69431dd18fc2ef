"""Tensor parallel + sequence parallel + loss parallel for kiln's transformer (Megatron-LM style).

Everything here is torch's DTensor API (`parallelize_module` with ColwiseParallel /
RowwiseParallel / SequenceParallel / PrepareModuleInput, and `loss_parallel`); kiln's own code is
the plan (which module gets which style, following torchtitan's Llama plan) and, in
kiln/parallel/functional.py (what the model itself calls), the autograd wrapper that keeps the
loss's backward inside `loss_parallel` without the caller knowing (`parallel_lm_loss`) and the
local view of a replicated parameter whose gradient is a partial sum (`local_with_partial_grad`).

Layout of the residual stream: sharded on the sequence (Shard(1)) between the blocks, as plain
local tensors. Norms and dropout run on the local sequence shard (SP); attention and the MLP
gather the sequence (PrepareModuleInput -> Replicate), shard heads / hidden units over the tp
ranks (q/k/v and w1/w3 column-wise, wo and w2 row-wise, biases included; QK-norm gains
replicated over the local heads), and reduce-scatter back to the sequence shard. The token embedding is row-wise (vocab-sharded table, output
reduce-scattered to Shard(1)); learned positions are row-wise too, with their output sharded on
dim 0 of the (seq, dim) lookup, which is exactly the local sequence shard of the tokens. RoPE
tables stay replicated: attention sees the whole sequence. The LM head is column-wise: logits
stay sharded on the vocabulary (a DTensor) and the cross-entropy runs under `loss_parallel`, so no
rank ever holds the full (tokens x vocab) logits. With train.loss='chunked' the head's weight shard
goes to kiln/model/loss.py's vocab-parallel chunked loss instead (functional.py `parallel_chunked_lm_loss`), so no
rank holds more than one chunk of tokens' logits slice either.

Mixture-of-experts blocks (kiln/model/moe.py) get `MoETensorParallel` instead of the dense MLP's
styles ("expert tensor parallel", as torchtitan shards GroupedExperts): the sequence is gathered
so every tp rank routes every token (router replicated; capacity and aux/z losses exactly one
process's, the tokens being the same), each expert's w1/w3 are sharded on their hidden dim
(Shard(2), column-wise) and w2 on its hidden dim (Shard(1), row-wise), and the partial output is
reduce-scattered back to the sequence shard. The tokens and gates the experts read are replicated
while their weights are sharded, so their gradients are partial sums, and stay so: the router
weight's is summed over tp once a step (`local_with_partial_grad`), the tokens' reduce-scattered
with the gathered input's gradient in backward; the aux and z-losses, alike on every rank, join
them with a 1/tp share (`grad_share_over_tp`).
Why not shard the experts whole over tp instead: that is expert parallelism (parallel.ep), which
composes with this style: ep then slices each tp shard's experts over the data-parallel ranks
(expert tensor parallel, kiln/parallel/expert_parallel.py). With parallel.etp=1 ep borrows tp
instead (`MoELocalSequence`): the MoE block keeps its input sequence-sharded, each tp rank routes
its own tokens (router replicated, its gradient summed over tp), and the experts stay whole for ep
to split over dp_shard x tp: no all-gather / reduce-scatter of the activations around the block,
and no expert computed twice over tp.

float8 (`train.float8`, kiln/parallel/parallelize.py converts the blocks' linears before TP): an
attention or MLP whose linears are all tensorwise float8 linears without bias gets torchao's float8
styles (`Float8ColwiseParallel`, `Float8RowwiseParallel`, `PrepareFloat8ModuleInput`, as torchtitan's
`enable_float8_tensorwise_tp`): its input is cast to float8 once and all-gathered in float8. Rowwise
float8 linears, biased ones, and a mix with unconverted linears get torch's styles above and cast
after a high-precision all-gather (see `_styles`; docs/parallel.md "float8 under tensor parallel").

Under pipeline parallelism the plan covers one pipeline rank's modules (`tp_plan` on a
`PipelineModel`); the stages pass the sequence-sharded residual stream between them unchanged.

Tied embeddings keep working: the embedding (row-wise) and the head (column-wise) both shard the
shared (vocab, dim) weight on dim 0 over the same mesh; `apply_tp` re-ties them into one DTensor
parameter before FSDP sees them, and `Transformer.to_empty` re-ties them after materialization.
"""

from __future__ import annotations

import sys

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln import torch_compat
from kiln.model.moe import MoE


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _takes_float8_styles(module: nn.Module) -> bool:
    """Whether `module` is torchao's float8 training linear with dynamic per-tensor scaling of its
    input, weight and output gradient, and no bias. torchao's float8 TP styles assume tensorwise
    scaling (they cast with one scale per tensor before the all-gather) but check only the scaling
    type. They also cast the output gradient to float8 before the bias's backward, so a bias
    gradient would be summed from e5m2 values instead of one process's high-precision ones
    (measured on GPT-2: grad norm 4e-4 off on the first step). torchao is an optional dependency:
    if it was never imported, there is no float8 linear."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if float8_linear is None or not isinstance(module, float8_linear.Float8Linear) or module.bias is not None:
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output,
             c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input,
             c.cast_config_grad_output_for_grad_weight)
    return all(cc.scaling_type is ScalingType.DYNAMIC and cc.scaling_granularity is ScalingGranularity.TENSORWISE
               for cc in casts)


def _styles(*linears: nn.Module) -> tuple[type, type, type]:
    """(input preparation, column-wise, row-wise) styles for one attention or MLP whose linears
    are `linears`. When all take float8 styles (tensorwise, no bias): torchao's
    (torchtitan's `enable_float8_tensorwise_tp`), so the sequence all-gather of the input moves
    float8 (cast once for q/k/v, once for w1/w3) and the row-wise outputs' gradients are
    all-gathered in float8. Otherwise torch's, and float8 linears cast after a high-precision
    all-gather, as torchtitan does for rowwise: other recipes, biases, or a linear left unconverted
    next to float8 ones (a float8 input cannot feed it)."""
    if all(_takes_float8_styles(m) for m in linears):
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                            PrepareFloat8ModuleInput)

        return PrepareFloat8ModuleInput, Float8ColwiseParallel, Float8RowwiseParallel
    return PrepareModuleInput, ColwiseParallel, RowwiseParallel


def tp_plan(model: nn.Module, shard_experts: bool = True) -> dict[str, object]:
    """Module FQN -> ParallelStyle for `parallelize_module`, for both architectures (rope or
    learned positions, RMSNorm or LayerNorm with bias, pre- or post-norm, gated or plain MLP).
    MoE blocks: `MoETensorParallel`, or `MoELocalSequence` when not `shard_experts` (parallel.etp=1).

    `model` is the whole `Transformer` or one pipeline rank's `PipelineModel`
    (kiln/parallel/pipeline.py), which holds only some layers (`layers` keyed by the layer index)
    and the embeddings / final norm and head only on the first / last stage: the plan covers the
    modules that are there, under their names."""
    plan: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "pos_embeddings", None) is not None:
        # positions (seq,) -> (seq, dim), sharded on seq like the token embeddings' Shard(1).
        plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if getattr(model, "output", None) is not None:
        # Logits stay a vocab-sharded DTensor for loss_parallel (use_local_output=False).
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if _has_params(model.norm):
            plan["norm"] = SequenceParallel(use_local_output=True)
    for key, block in model.layers.named_children():
        p = f"layers.{key}"
        for norm in ("attention_norm", "ffn_norm"):
            if _has_params(getattr(block, norm)):
                # Local outputs: post-norm blocks add them to plain residual tensors.
                plan[f"{p}.{norm}"] = SequenceParallel(use_local_output=True)
        # attention(x, rope, cache, start_pos): only x is a tensor to gather.
        prepare, colwise, rowwise = _styles(block.attention.wq, block.attention.wk, block.attention.wv,
                                            block.attention.wo)
        plan[f"{p}.attention"] = prepare(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None))
        for name in ("wq", "wk", "wv"):
            plan[f"{p}.attention.{name}"] = colwise()
        plan[f"{p}.attention.wo"] = rowwise(output_layouts=Shard(1))
        if block.attention.q_norm is not None:
            # QK-norm on (B, heads, T, head_dim): this rank's heads are Shard(1), the weight is
            # replicated and its gradient summed over the heads of every rank, as for the
            # sequence-sharded norms.
            for name in ("q_norm", "k_norm"):
                plan[f"{p}.attention.{name}"] = SequenceParallel(use_local_output=True)
        if isinstance(block.feed_forward, MoE):  # grouped experts stay high precision (not nn.Linear)
            plan[f"{p}.feed_forward"] = MoETensorParallel() if shard_experts else MoELocalSequence()
            shared = getattr(block, "shared_experts", None)
            if shared is not None:  # a dense MLP beside the experts (either etp), its gate per token
                _mlp_plan(plan, f"{p}.shared_experts.ffn", shared.ffn)
                if shared.gate is not None:  # sequence-sharded like the norms, its weight replicated
                    plan[f"{p}.shared_experts.gate"] = SequenceParallel(use_local_output=True)
            continue
        _mlp_plan(plan, f"{p}.feed_forward", block.feed_forward)
    return plan


def _mlp_plan(plan: dict, fqn: str, ffn: nn.Module) -> None:
    """Megatron's MLP: the sequence-sharded input gathered, w1 (w3) column-wise, w2 row-wise with
    its output reduce-scattered back to the sequence shard."""
    prepare, colwise, rowwise = _styles(*(m for m in (ffn.w1, ffn.w3, ffn.w2) if m is not None))
    plan[fqn] = prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan[f"{fqn}.w1"] = colwise()
    if ffn.w3 is not None:
        plan[f"{fqn}.w3"] = colwise()
    plan[f"{fqn}.w2"] = rowwise(output_layouts=Shard(1))


class MoETensorParallel(ParallelStyle):
    """TP style for an `MoE` block under sequence parallel: input Shard(1) -> gathered, router
    replicated, experts sharded on their hidden dim, output partial -> reduce-scattered to Shard(1).
    Parameters become DTensors on the tp mesh (so clipping, FSDP and DCP see one kind of
    parameter); the block computes on their local shards and, given `MoE.tp_mesh`, leaves its
    inputs' gradients partial: the router weight's summed once a step, the tokens' by the
    gather's backward, a reduce-scatter. torch's `distribute_module` does the hooks and the placing."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, MoE):
            module.tp_mesh = mesh
            return
        if isinstance(module, nn.Linear):  # the router
            layouts = {"weight": [Replicate()]}
        else:  # GroupedExperts: w1/w3 (E, dim, hidden), w2 (E, hidden, dim)
            layouts = {"w1": [Shard(2)], "w3": [Shard(2)], "w2": [Shard(1)]}
        for pname, param in list(module.named_parameters(recurse=False)):
            dt = torch_compat.distribute_tensor(param, mesh, layouts[pname], src_data_rank=getattr(self, "src_data_rank", 0))
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    @staticmethod
    def _gather_sequence(module, inputs, mesh):
        # Backward: the gathered input's gradient is partial (the experts see a slice of the hidden
        # units, and through the gates so does the router; the aux and z-losses' share is divided by
        # tp in moe.py), reduce-scattered back to the sequence shard: Megatron's sequence-parallel
        # "g", not an all-reduce and a slice.
        (x,) = inputs
        gathered = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
        return (gathered.to_local(grad_placements=[Partial()]),)

    @staticmethod
    def _reduce_scatter_sequence(module, output, mesh):
        return DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, input_fn=self._gather_sequence,
                                 output_fn=self._reduce_scatter_sequence)


class MoELocalSequence(ParallelStyle):
    """TP style for an `MoE` block whose experts ep splits over tp as well (parallel.etp=1): the
    input stays this rank's sequence shard (Shard(1), a plain tensor, as between blocks) and so does
    the output; the router weight becomes a replicated DTensor on the tp mesh and the experts stay
    plain whole tensors (kiln/parallel/expert_parallel.py slices them over ep). `MoE.sp_mesh` tells
    the block that each sequence is split over tp: its queue positions (capacity), balancing and
    z-losses are taken over the whole sequence, and its router's gradient is summed over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Not torch's distribute_module: it would replicate every parameter left plain (the experts).
        module.sp_mesh = device_mesh
        router = module.router
        router.weight = nn.Parameter(torch_compat.distribute_tensor(router.weight, device_mesh, [Replicate()],
                                                                    src_data_rank=getattr(self, "src_data_rank", 0)))
        return module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, shard_experts: bool = True) -> None:
    """Shard `model` (on the meta device, before materialization) over `tp_mesh` in place; MoE
    experts whole (for ep to split over tp, parallel.etp=1) unless `shard_experts`.

    Parameters shared by several modules (tied embeddings) stay one Parameter: each style
    distributes its own module's weight, so `parallelize_module` leaves the embedding and the
    head two DTensors, and FSDP2 applied next would then track two FSDPParams for what
    `Transformer.to_empty` re-ties into one. With an uneven FSDP shard each of them pads its own
    copy of the local shard and only one copy is what the optimizer updates (the other is
    all-gathered stale from step 2 on). Re-tying here, before FSDP, gives FSDP one parameter with
    its shared modules, as without tensor parallel."""
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    torch_compat.key_embedding_backward_by_vocab()
    parallelize_module(model, tp_mesh, tp_plan(model, shard_experts))
    for first, *others in (names for names in shared.values() if len(names) > 1):
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            other = getattr(module, attr)
            if isinstance(param, DTensor) != isinstance(other, DTensor) or (
                    isinstance(param, DTensor) and param.placements != other.placements):
                raise ValueError(f"tensor parallel shards the shared parameter {first} and {name} differently")
            setattr(module, attr, param)
