"""Pipeline parallelism: split kiln's transformer into stages and train through a
`torch.distributed.pipelining` schedule.

What is torch's: the stages (`PipelineStage`), the schedules (GPipe, 1F1B, interleaved 1F1B,
looped BFS, interleaved zero-bubble, ZBV zero-bubble, DualPipeV), micro-batch splitting and gradient scaling
by the micro-batch count (`scale_grads=True`), `get_total_norm` / `clip_grads_with_norm_`. What is
kiln's: the layer split, the stage modules, the global grad norm over the pipeline, the loss
broadcast from the last stage, the evaluation forward and the bubble fraction.

The split follows torchtitan's idea (keep only what a stage owns, under the original names), but
not its code: a rank's `PipelineModel` holds exactly the modules of its stages under the names of
the single-process `Transformer` (`tok_embeddings`, `layers.N...`, `norm`, `output`), with
`layers` a ModuleDict keyed by the layer index, so a DCP checkpoint of a pipeline rank loads into
the single-process model and back. Each stage is a `StageChunk` that references those modules.
Tied embeddings (GPT-2): the last stage holds its own copy of the weight as the head, initialized
alike and with its gradient summed with the embedding's every step, as Megatron-LM does
(kiln/parallel/pipeline_tied.py).

With tensor parallelism (applied to the `PipelineModel` after the split, kiln/parallel/
tensor_parallel.py) each tp rank runs its own pipeline over its `pp` group: stages exchange the
tp rank's sequence shard of the residual stream (sequence parallel's layout between blocks) and
the last stage's loss runs on vocab-sharded logits (train.loss = "chunked": on its vocab shard of
the head, chunk by chunk, in the stage's forward; `chunked_head_loss`). With context parallelism
the stages take the zig-zag slice's global positions from `PipelineModel.seq_positions`
(kiln/parallel/context_parallel.py).

The stage modules (`split_model`, `PipelineModel`, `StageChunk`, the MoE aux-loss injection and the
chunked head loss) are in kiln/parallel/pipeline_stages.py; the schedule and the evaluation forward
are here; the train step through the schedule is kiln/train/pipeline_step.py.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln import torch_compat
from kiln.config import JobConfig
from kiln.model.loss import IGNORE_INDEX, lm_loss
from kiln.parallel.pipeline_fp16 import ScaledLoss
from kiln.parallel.pipeline_layout import SCHEDULES, SINGLE_STAGE, ZERO_BUBBLE, bubble_fraction, n_microbatches, stages_of_rank
# split_model is re-exported: the tests and benchmarks call it as pipeline.split_model
from kiln.parallel.pipeline_stages import PipelineModel, split_model  # noqa: F401
from kiln.parallel.pipeline_tied import TiedEmbeddings

def keep_gathered_until_backward(chunks) -> None:
    """Zero-bubble schedules under FSDP (dp or cp > 1): no reshard after forward (FSDP2's
    `set_reshard_after_forward(False)`, all units of each stage). torch's split backward
    (pipelining/_backward.py) takes `stage.submod.parameters()` when the input pass starts and
    keeps only the parameters whose AccumulateGrad nodes are in the graph; a unit resharded after
    forward lists its sharded DTensors there, not the gathered parameters the forward used, so
    its weight pass computed nothing: the last stage's norm and head had no gradient (grad norm
    0.83 instead of 1.07 on the cp x pp test model). torchtitan by default does not reshard after
    forward under pp either (to save per-micro-batch all-gathers). Costs: parameters stay gathered
    from a stage's first forward to its post-backward at the end of the step."""
    from torch.distributed.fsdp import FSDPModule

    for chunk in chunks:
        if isinstance(chunk, FSDPModule):
            torch_compat.fsdp_set_reshard_after_forward(chunk, False)


class Pipeline:
    """The schedule over one rank's stages, plus what the trainer needs around it."""

    def __init__(self, model: PipelineModel, cfg: JobConfig, dims, device: torch.device):
        import torch.distributed.pipelining as pipelining
        from kiln.torch_compat import pipeline_stage_class

        self.model, self.device = model, device
        self.tp = dims.tp
        # pp x tp: every tp rank runs its own pipeline (the pp group of ranks with its tp coordinate).
        # Stages pass the residual stream as torchtitan does, sharded on the sequence (SP's layout
        # between blocks: each tp rank sends 1/tp of it to its peer, nothing is gathered); the last
        # stage's logits stay vocab-sharded for the loss (parallel_lm_loss, under loss_parallel).
        self.group = dims.mesh["pp"].get_group()
        self.pp = cfg.parallel.pp
        self.schedule_name, self.virtual = cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages
        self.n_stages = model.n_stages
        # The global rank of the pp rank holding the last stage (the loss comes from there).
        last_pp_rank = [r for r in range(self.pp) if self.n_stages - 1 in
                        stages_of_rank(cfg.parallel.pp_schedule, self.pp, cfg.parallel.pp_virtual_stages, r)][0]
        self.last_rank = dist.get_global_rank(self.group, last_pp_rank)
        self.has_last = self.n_stages - 1 in model.stage_ids
        self.has_first = 0 in model.stage_ids
        # tied embeddings: the (first stage, last stage) pairs that sum the two copies' gradients
        self.tied = TiedEmbeddings(model, dims, last_pp_rank) if cfg.model.tie_embeddings else None
        if cfg.parallel.pp_schedule in ZERO_BUBBLE:
            keep_gathered_until_backward(model.chunks)
        modules = model.chunks
        # ddp/zero1 with a zero-bubble schedule: torch's weight pass bypasses DDP's hooks, so the
        # replicas average after the step instead (pipeline_train_step; data_parallel.py).
        self.replicas = None
        if dims.dp_mode in ("ddp", "zero1") and dims.grad_mesh_names:  # (DiLoCo: inside a replica)
            from kiln.parallel.data_parallel import OverlappedStageReplicas, SplitBackwardReplicas, replicate_stage

            # tp > 1: torch's DDP cannot take tp's DTensors (data_parallel.OverlappedReplicas), so
            # kiln's replicas of the chunks' local shards, all-reducing in the backward of each
            # parameter's last micro-batch (after the step under a zero-bubble schedule).
            if cfg.parallel.pp_schedule in ZERO_BUBBLE:
                self.replicas = SplitBackwardReplicas(model.chunks, dims)
            elif dims.tp > 1:
                self.replicas = OverlappedStageReplicas(model.chunks, dims, n_microbatches(cfg))
            else:  # DDP per stage chunk
                modules = [replicate_stage(chunk, dims) for chunk in model.chunks]
        self.stages = [pipeline_stage_class()(module, s, self.n_stages, device, group=self.group)
                       for s, module in zip(model.stage_ids, modules)]
        cls = getattr(pipelining, SCHEDULES[cfg.parallel.pp_schedule])
        self.microbatches = n_microbatches(cfg)
        stages = self.stages[0] if cfg.parallel.pp_schedule in SINGLE_STAGE else self.stages
        # scale_grads: each micro-batch's mean loss is backpropagated, gradients divided by the
        # micro-batch count -> the gradient of the mean over the whole batch, as in one process.
        self.loss_fn = ScaledLoss(self._loss, self.microbatches)
        placement = {} if cfg.parallel.pp_schedule in SINGLE_STAGE else torch_compat.stage_placement_kwargs(
            cls, {s: r for r in range(self.pp) for s in stages_of_rank(
                cfg.parallel.pp_schedule, self.pp, cfg.parallel.pp_virtual_stages, r)})
        # where the schedule sums the micro-batches' gradients (torch 2.6; 2.8 and 2.10 under tp), the loss divides
        scaling = torch_compat.schedule_grad_scaling(cls, [p for st in self.stages for p in st.submod.parameters()])
        self.schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self.loss_fn, **scaling, **placement)
        self.loss_fn.divide = not scaling.get("scale_grads", False)
        for chunk in model.chunks:  # MoE aux losses join the backward inside the stages, scaled alike
            chunk.__dict__["loss_scale"] = self.loss_fn.scale
        self.bubble = bubble_fraction(cfg.parallel.pp_schedule, self.pp, self.microbatches,
                                      cfg.parallel.pp_virtual_stages)

    @property
    def chunked_loss(self) -> bool:
        """train.loss as the trainer resolved it for the model (`model.loss_impl`, kiln/train/
        system.py resolve_loss) is "chunked": the last stage computes the chunked head + loss in
        its forward. Read at each step, so the Pipeline never holds a stale choice."""
        return self.model.loss_impl == "chunked"

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn (inside `ScaledLoss`): under the chunked loss `output` is already
        the micro-batch's loss (the last stage took its targets as a keyword, `pipeline_train_step`;
        torch's schedule hands `target` to loss_fn all the same), else the full loss over the last
        stage's logits, vocab-sharded under tp."""
        if self.chunked_loss:
            return output
        if self.tp > 1:
            from kiln.parallel.functional import parallel_lm_loss

            return parallel_lm_loss(output, target)
        return lm_loss(output, target)

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The whole model's logits on every pp rank, through the stages in micro-batches with
        point-to-point sends (`_through_stages`; no schedule, any batch shape)."""
        if self.has_last:
            parts = []
            self._through_stages(tokens, on_logits=lambda i, logits: parts.append(logits), doc_ids=doc_ids)
            logits = torch.cat(parts)
            # contiguous: torch 2.11's full_tensor of an uneven vocab shard is a strided view, which
            # gloo's broadcast would send as its raw storage (the other stages then score garbage)
            logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float().contiguous()
        else:
            self._through_stages(tokens, on_logits=None, doc_ids=doc_ids)
            logits = torch.empty((*tokens.shape, self.model.cfg.vocab_size), device=self.device)
        dist.broadcast(logits, src=self.last_rank, group=self.group)
        return logits

    @torch.no_grad()
    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor, rows: int,
                     microbatches: int | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Evaluation's mean next-token loss over the first `rows` rows (the rest pad a rank's
        share, kiln/data/loader.py rank_batches), on every pp rank: computed on the last stage
        micro-batch by micro-batch (the mean over all counted tokens) and broadcast as one number,
        so the other stages never hold the logits (batch x seq x vocab in fp32: 16 GiB for 8 x 4096
        tokens of a 128k vocabulary, which forward_logits broadcasts) and the last stage holds one
        micro-batch's. Under tp the loss is vocab-parallel over the last stage's sharded logits
        (not gathered). `doc_ids`: packed documents, masked in every stage as in training."""
        if rows < targets.shape[0]:  # padding rows: not counted
            targets = targets.clone()
            targets[rows:] = IGNORE_INDEX
        parts = torch.tensor_split(targets, self._eval_microbatches(tokens, microbatches))
        total, counted = torch.zeros((), dtype=torch.float64, device=self.device), [0]

        def score(i: int, logits) -> None:  # the last stage, each micro-batch as its logits appear
            n = int((parts[i] != IGNORE_INDEX).sum())
            if not n:  # only padding rows: nothing to count (and no mean of nothing)
                return
            if isinstance(logits, DTensor):
                from kiln.parallel.functional import parallel_lm_loss

                mean = parallel_lm_loss(logits, parts[i])
            else:
                mean = lm_loss(logits, parts[i])
            total.add_(mean.double() * n)
            counted[0] += n

        self._through_stages(tokens, microbatches, on_logits=score, doc_ids=doc_ids)
        loss = (total / counted[0]).float() if self.has_last and counted[0] else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def _eval_microbatches(self, tokens: torch.Tensor, microbatches: int | None) -> int:
        """Evaluation's micro-batch count: `microbatches`, or the training step's, at most one per row."""
        return max(1, min(microbatches or self.microbatches, tokens.shape[0]))

    def _through_stages(self, tokens: torch.Tensor, microbatches: int | None = None, *, on_logits,
                        doc_ids: torch.Tensor | None = None) -> None:
        """The batch through the stages; on the last stage's rank `on_logits(i, logits)` takes each
        micro-batch's logits (vocab-sharded DTensors under tp) as they appear, so no more than one
        micro-batch's are held at once. The batch's rows split into `_eval_microbatches` and run
        GPipe's forward order: each rank takes its stages in order and, within one, the
        micro-batches in order, receiving each input from the previous stage's rank and sending on
        without waiting, so while one stage works on a micro-batch the next works on the one
        before (kiln's own loop, not torch's `schedule.eval()`: torch's schedules fix their
        micro-batch shapes at their first step, and evaluation batches have any shape)."""
        cfg = self.model.cfg
        batch, seqlen = tokens.shape
        if seqlen % self.tp:  # the stages rebuild the full length as tp x the local shard
            raise ValueError(f"evaluation sequence of {seqlen} tokens is not divisible by parallel.tp={self.tp}")
        chunks = torch.tensor_split(tokens, self._eval_microbatches(tokens, microbatches))
        doc_chunks = (torch.tensor_split(doc_ids, len(chunks)) if doc_ids is not None  # every stage masks
                      else [None] * len(chunks))
        sends, held = [], list(chunks)  # held: each micro-batch's input to this rank's next stage
        for s in sorted(self.model.stage_ids):
            chunk = self.model.chunks[self.model.stage_ids.index(s)]
            for i, mb in enumerate(chunks):
                if s > 0 and (s - 1) not in self.model.stage_ids:  # this rank's tp shard of the sequence
                    held[i] = torch.empty((mb.shape[0], seqlen // self.tp, cfg.dim), device=self.device)
                    dist.recv(held[i], group=self.group, group_src=self._owner_of(s - 1))
                h = chunk(held[i], doc_ids=doc_chunks[i])
                held[i] = None
                if s == self.n_stages - 1:  # the logits, left as the head made them
                    on_logits(i, h)
                    continue
                h = (h.full_tensor() if isinstance(h, DTensor) else h).float().contiguous()
                if (s + 1) in self.model.stage_ids:
                    held[i] = h
                else:
                    sends.append((dist.isend(h, group=self.group, group_dst=self._owner_of(s + 1)), h))
        for work, _ in sends:  # each send's tensor is held until it is through
            work.wait()

    def _owner_of(self, stage: int) -> int:
        for r in range(self.pp):
            if stage in stages_of_rank(self.schedule_name, self.pp, self.virtual, r):
                return r
        raise AssertionError(stage)


class PipelineEvalModel:
    """What kiln.eval.scoring.score_batches calls as `model(x)` under pp: logits through the
    pipeline, in `microbatches` (None: the training step's count; `Pipeline._through_stages`)."""

    def __init__(self, pipeline: Pipeline, microbatches: int | None = None):
        self.pipeline, self.microbatches = pipeline, microbatches

    @property
    def training(self) -> bool:
        return self.pipeline.model.training

    def train(self, mode: bool = True):
        self.pipeline.model.train(mode)
        for chunk in self.pipeline.model.chunks:
            chunk.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.pipeline.forward_logits(tokens, doc_ids)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, rows: int,
                  doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What score_batches uses instead of logits where a model offers it (Pipeline.forward_loss)."""
        return self.pipeline.forward_loss(tokens, targets, rows, self.microbatches, doc_ids)
