"""The stage modules of a pipeline rank: `split_model` cuts kiln's `Transformer` into this rank's
`PipelineModel` (the modules of its stages, under the single-process names, so DCP checkpoints
move between layouts) and one `StageChunk` per stage (the forward a `PipelineStage` runs). What is
torch's: nothing here but nn.Module / autograd.Function; the split, the chunks' forwards, the MoE
aux-loss injection (`_AddToBackward`, Megatron-LM's idea) and the last stage's chunked head loss are
kiln's. The schedule around them is kiln/parallel/pipeline.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config import JobConfig
from kiln.model.loss import chunked_lm_loss
from kiln.model.moe import MoE
from kiln.model.transformer import Transformer, attention_window, layer_masks
from kiln.parallel.pipeline_layout import check_pipeline_config, stage_layer_ranges, stages_of_rank
from kiln.parallel.pipeline_tied import EMBEDDING, HEAD, head_copy

class _AddToBackward(torch.autograd.Function):
    """Identity on `h` whose backward also differentiates the scalar `extra` (d loss / d extra = 1):
    a loss term computed inside a pipeline stage (the MoE aux losses), which torch's schedules
    would not see, since only the last stage's loss_fn output is backpropagated. The same device
    as Megatron-LM's MoEAuxLossAutoScaler; written here (torch has none)."""

    @staticmethod
    def forward(ctx, h, extra):
        ctx.save_for_backward(extra)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        (extra,) = ctx.saved_tensors
        return grad, torch.ones_like(extra)


def add_moe_losses(h: torch.Tensor, layers, records: dict, aux_weight: float, z_weight: float,
                   loads: dict | None = None, scale=None) -> torch.Tensor:
    """Training forward of a stage with MoE layers: their weighted load-balancing and z-losses
    join the backward at the stage output (`_AddToBackward`), so each micro-batch's gradient is
    that of (its LM loss + the weighted aux losses of every stage), as in one process; the
    unweighted values go to `records` (per stage) for the step's reported loss. scale: what the
    schedule's loss_fn does to the LM loss (`ScaledLoss.scale`, fp16), done to this term alike.
    loads: per stage, its MoE layers and each forward's assignments per layer and expert, for
    the step's load metric and bias update (kiln/model/moe.py balance_experts)."""
    moes = [layer.feed_forward for layer in layers if isinstance(getattr(layer, "feed_forward", None), MoE)]
    if not moes or not torch.is_grad_enabled():
        return h
    aux = torch.stack([m.last_aux_loss for m in moes]).sum()
    z = torch.stack([m.last_z_loss for m in moes]).sum()
    records.setdefault(id(layers), []).append(torch.stack([aux, z]).detach())
    if loads is not None:
        loads.setdefault(id(layers), (moes, []))[1].append(torch.stack([m.last_load for m in moes]))
    extra = aux_weight * aux + z_weight * z
    return _AddToBackward.apply(h, extra if scale is None else scale(extra))


class PipelineModel(nn.Module):
    """The modules of one rank's stages, named as in `Transformer` (checkpoint-compatible)."""

    def __init__(self, full: Transformer, layer_ranges: list[range], first: bool, last: bool):
        super().__init__()
        self.cfg = full.cfg
        if first:
            self.tok_embeddings, self.pos_embeddings, self.dropout = full.tok_embeddings, full.pos_embeddings, full.dropout
        self.layers = nn.ModuleDict({str(i): full.layers[i] for r in layer_ranges for i in r})
        if last:  # tied: the last stage's own copy of the embedding as its head (pipeline_tied.py)
            self.norm, self.output = full.norm, head_copy(full) if full.cfg.tie_embeddings else full.output
        self.has_first, self.has_last = first, last
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)
        # Set from train.loss by the trainer (kiln/train/system.py resolve_loss), read by the Pipeline
        # at each step: "chunked" makes the last stage compute the chunked LM head + loss itself.
        self.loss_impl = "full"
        # Context parallel: the global positions of this rank's zig-zag slice, set around a
        # training step by kiln/parallel/context_parallel.py (as on `Transformer`).
        self.seq_positions: torch.Tensor | None = None
        self.cp_whole_masks = False  # Ulysses: packed documents' masks of whole sequences (as on `Transformer`)
        # The whole model stays on meta, unregistered: init replays its generator draws (see init_weights).
        self.__dict__["_full"] = full
        # MoE: (aux, z) of each stage forward of this step, per stage (add_moe_losses); after
        # the step the mean over micro-batches, summed over all stages' layers (what the trainer logs).
        self.moe_records: dict[int, list[torch.Tensor]] = {}
        self.moe_losses: torch.Tensor | None = None
        # Per stage, (its MoE layers, each forward's assignments); the ranks the step sums them
        # over (set by the trainer, as on `Transformer`); the step's largest relative load, all stages.
        self.moe_load_records: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self.moe_load_group = None
        self.moe_max_load: torch.Tensor | None = None

    def replace_layers(self, wrap) -> None:
        """Replace each layer by wrap(global layer index, layer), here and in the stage chunk that
        runs it (activation checkpointing and per-block compile put a wrapper around a block; the
        schedule calls the chunks, the checkpoint reads this model, so both must hold the wrapper).
        The index is the layer's index in the whole model, so a rule such as every_k:K picks the
        same layers on any pipeline layout as in one process."""
        for key, layer in list(self.layers.items()):
            new = wrap(int(key), layer)
            self.layers[key] = new
            for chunk in self.chunks:
                for j, held in enumerate(chunk.layers):
                    if held is layer:
                        chunk.layers[j] = new

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The single-process init, bit for bit: kiln.model.init runs over the whole model, whose
        modules this rank does not own are still on meta; their draws go to a scratch tensor
        (kiln/model/init.py `_fill`), so the generator advances exactly as in one process."""
        from kiln.model.init import init_model
        from kiln.model.transformer import rope_tables

        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        copies = self.tied_embedding_copies()
        embedding = self._full.tok_embeddings
        if copies and not self.has_first:  # the embedding's draw fills the head copy instead of scratch
            meta_weight, embedding._parameters["weight"] = embedding.weight, copies[0]
        try:
            init_model(self._full, generator)
        finally:
            if copies and not self.has_first:
                embedding._parameters["weight"] = meta_weight
        if copies and self.has_first:  # both on this rank (ZBV): same placements, a local copy
            copies[0].copy_(self.tok_embeddings.weight)

    def to_empty(self, *, device, recurse: bool = True) -> "PipelineModel":
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings:  # re-tie the whole model (as Transformer.to_empty), whose
            # parameter count (the trainer's run row) then counts the weight once
            self._full.output.weight = self._full.tok_embeddings.weight
        return self

    def tied_embedding_copies(self) -> list[torch.Tensor]:
        """The last stage's head copy of a tied embedding (the optimizer groups it as the
        embedding, kiln/train/optim.py), or nothing."""
        return [self.output.weight] if self.cfg.tie_embeddings and self.has_last else []

    def tied_embedding_weights(self) -> list[torch.Tensor]:
        """This rank's tensors of a tied embedding whose optimizer state both end stages save under
        one name (the embedding, the head copy): ZeRO-1 cuts them alike on every stage, so DCP
        writes each box once (kiln/parallel/zero1.py `saved_alike`)."""
        if not self.cfg.tie_embeddings:
            return []
        return ([self.tok_embeddings.weight] if self.has_first else []) + self.tied_embedding_copies()

    def optimizer_state_aliases(self) -> dict[str, str]:
        """{own name: name saved in checkpoints} for optimizer state (kiln/checkpoint/manager.py)."""
        return {HEAD: EMBEDDING} if self.tied_embedding_copies() else {}


class StageChunk(nn.Module):
    """One pipeline stage: tokens or hidden states in, hidden states or (last stage) logits out,
    or with `targets` (train.loss = "chunked") the chunked LM head + loss of its hidden states."""

    def __init__(self, owner: PipelineModel, layers: range, first: bool, last: bool, seq_shards: int = 1):
        super().__init__()
        self.first, self.last = first, last
        # Under tensor (sequence) parallelism a stage after the first receives its tp rank's
        # shard of the sequence (Shard(1), a plain local tensor), 1/seq_shards of the positions.
        self.seq_shards = seq_shards
        if first:
            self.tok_embeddings, self.pos_embeddings, self.dropout = owner.tok_embeddings, owner.pos_embeddings, owner.dropout
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in layers)
        self.windows = [attention_window(owner.cfg, i) for i in layers]  # each layer's (by its global index)
        if last:
            self.norm, self.output = owner.norm, owner.output
        self.__dict__["_owner"] = owner  # for the RoPE tables (re-created by to_empty/init)
        self.__dict__["_moe"] = (owner.moe_records, owner.cfg.moe_aux_loss_weight, owner.cfg.moe_z_loss_weight,
                                 owner.moe_load_records)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`doc_ids`: the micro-batch's packed documents (data.windows = "packed_masked"), which
        torch's schedule hands every stage as a keyword, split like the inputs."""
        seqlen = h.shape[1] if self.first else h.shape[1] * self.seq_shards  # attention sees all of it
        positions = self._owner.seq_positions  # cp: not 0..seqlen-1 but the rank's zig-zag slice
        if self.first:
            tokens = h
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(seqlen, device=tokens.device) if positions is None
                                            else positions)
            h = self.dropout(h)
        if positions is None:
            rope = (self._owner.rope_cos[:seqlen], self._owner.rope_sin[:seqlen])
        else:
            rope = (self._owner.rope_cos[positions], self._owner.rope_sin[positions])
        masks = layer_masks(self.windows, doc_ids, ring=positions is not None and not self._owner.cp_whole_masks)
        for layer, mask in zip(self.layers, masks):
            h = layer(h, rope, None, 0, mask)
        h = add_moe_losses(h, self.layers, *self._moe, scale=self.__dict__.get("loss_scale"))
        if not self.last:
            return h
        if targets is None:
            return self.output(self.norm(h))
        return chunked_head_loss(self.norm(h), self.output.weight, targets)


def chunked_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's train.loss = "chunked": kiln/model/loss.py's chunked LM head + loss, the
    vocab-parallel one when tp shards the head (a DTensor weight), as `Transformer.forward` does.
    Inside the stage's forward, not in the schedule's loss_fn: FSDP (kiln's fsdp mode reshards
    even the stage's root unit after forward) holds the gathered head weight only during the
    forward, and a stage compiled whole (compile_scope = "model") takes the loss into its graph,
    as one process's whole-model compile does. The head weight is the tied copy's under tied
    embeddings (pipeline_tied.py)."""
    if isinstance(weight, DTensor):
        from kiln.parallel.functional import parallel_chunked_lm_loss

        return parallel_chunked_lm_loss(hidden, weight, targets)
    return chunked_lm_loss(hidden, weight, targets)


def split_model(full: Transformer, cfg: JobConfig, pp_rank: int) -> PipelineModel:
    """This rank's part of `full` (on meta). Its `chunks` become PipelineStages after materializing;
    tensor parallelism (if any) is applied to the returned model afterwards, in place, so the
    chunks, which reference its modules, run sharded too. The config is checked here too, not only
    by the trainer (a benchmark once skipped the trainer's check)."""
    check_pipeline_config(cfg)
    p = cfg.parallel
    n_stages = p.pp * p.pp_virtual_stages
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages, p.pp_split_points)
    mine = stages_of_rank(p.pp_schedule, p.pp, p.pp_virtual_stages, pp_rank)
    model = PipelineModel(full, [ranges[s] for s in mine], first=0 in mine, last=n_stages - 1 in mine)
    model.__dict__["stage_ids"] = mine
    model.__dict__["chunks"] = [StageChunk(model, ranges[s], s == 0, s == n_stages - 1, seq_shards=p.tp)
                                for s in mine]
    model.__dict__["n_stages"] = n_stages
    return model
