"""The training step under pipeline parallelism: `train_step`'s counterpart (kiln/train/step.py)
through a `torch.distributed.pipelining` schedule (kiln/parallel/pipeline.py `Pipeline`), with the
same return (device loss, grad norm, skipped), and the clipping that counts a tied embedding's
last-stage copy once (kiln/parallel/pipeline_tied.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from kiln import torch_compat
from kiln.parallel.pipeline import Pipeline
from kiln.parallel.pipeline_fp16 import agree_found_inf
from kiln.train.step import clip_grad_norm, step_unless


def pipeline_train_step(pipeline: Pipeline, optimizer, micro_batches, *, autocast, scaler, clip: float):
    """`kiln.train.step.train_step` under pp: same return (device loss, grad norm, skipped).

    The grad-accumulation micro-batches are one batch to the schedule, which splits it into
    parallel.pp_microbatches. The loss is the mean of the last stage's micro-batch losses,
    broadcast to every pp rank; the grad norm is over all stages (squares summed over pp ranks).
    Non-finite steps are skipped as in train_step (on the device where the optimizer allows).

    fp16 (`scaler`, a `torch.amp.GradScaler`): the last stage's loss_fn scales each micro-batch's
    loss (`ScaledLoss`), every rank unscales its own gradients, the found-inf flag is agreed over
    all ranks (`agree_found_inf`), then the scaler steps and updates exactly as in train_step.
    """
    if scaler is not None and not scaler.is_enabled():  # GradScaler(enabled=False): no scaling at all
        scaler = None
    x = torch.cat([m[0] for m in micro_batches])
    y = torch.cat([m[1] for m in micro_batches])
    model = pipeline.model
    model.moe_records.clear()
    model.moe_load_records.clear()
    pipeline.loss_fn.unscaled.clear()
    if scaler is not None:  # a rank without the last stage never scales a loss; its scaler still
        scaler.scale(torch.zeros((), device=x.device))  # needs its scale for unscale_ (lazily made)
    with autocast, contextlib.ExitStack() as no_sync:
        if scaler is not None:  # for this step, however it ends: ScaledLoss scales and divides by
            # the micro-batch count, before the backward, instead of the schedule after it
            if hasattr(pipeline.schedule, "scale_grads"):
                no_sync.callback(setattr, pipeline.schedule, "scale_grads", pipeline.schedule.scale_grads)
                pipeline.schedule.scale_grads = False
            no_sync.callback(setattr, pipeline.loss_fn, "scaler", None)
            pipeline.loss_fn.scaler = scaler
        # DDP stages (kiln/parallel/data_parallel.py replicate_stage): torch's schedule runs each
        # forward and all but the last backward under no_sync and re-arms DDP's reducer for the
        # last; but on the first step its shape inference calls the stage outside no_sync, which
        # arms the reducer: the first micro-batch's backward all-reduced too, and DDP's bucket
        # rebuild then failed at step 2 (torch 2.13: "rebuilt parameter indices size is not same
        # as original model parameters size"). Under an outer no_sync only the re-arming reduces.
        for stage in pipeline.stages:
            if isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel):
                no_sync.enter_context(stage.submod.no_sync())
        # train.loss = "chunked": the last stage takes the targets as a keyword (torch passes keywords to
        # every stage of this rank, split into micro-batches as the target; the others ignore it).
        keywords = {"targets": y} if pipeline.chunked_loss else {}
        # data.windows = "packed_masked": the documents' ids go to every stage the same way
        if len(micro_batches[0]) > 2:
            keywords["doc_ids"] = torch.cat([m[2] for m in micro_batches])
        if hasattr(pipeline.replicas, "after_backward_scale"):  # what the schedule divides by after it
            pipeline.replicas.after_backward_scale = (1.0 / pipeline.microbatches
                                                      if getattr(pipeline.schedule, "scale_grads", False) else 1.0)
        # the last stage keeps no merged outputs (the losses are the loss_fn's)
        no_outputs = torch_compat.step_without_outputs(pipeline.schedule)
        if pipeline.has_first and pipeline.has_last:
            pipeline.schedule.step(x, target=y, **no_outputs, **keywords)
        elif pipeline.has_first:
            pipeline.schedule.step(x, **no_outputs, **keywords)
        elif pipeline.has_last:
            pipeline.schedule.step(target=y, **no_outputs, **keywords)
        else:
            pipeline.schedule.step(**no_outputs, **keywords)
    if pipeline.replicas is not None:  # ddp/zero1 under a zero-bubble schedule or tp: once per step
        pipeline.replicas.average()
    if pipeline.tied is not None:  # before clipping: the tied weight's gradient is the sum of both copies'
        pipeline.tied.sum_grads()
    # The micro-batch losses before the scaler's factor: the last `microbatches` (on its first step
    # torch's last stage also calls loss_fn once to infer the backward's shapes).
    losses = pipeline.loss_fn.unscaled[-pipeline.microbatches:]
    loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=x.device)
    dist.broadcast(loss, src=pipeline.last_rank, group=pipeline.group)
    if model.cfg.moe_experts:  # (aux, z) summed over all stages' layers, averaged over micro-batches
        # Each stage's last `microbatches` forwards: on its first step torch's stage also runs one
        # forward on placeholder inputs first, to infer the shapes it sends.
        records = [r for per_stage in model.moe_records.values() for r in per_stage[-pipeline.microbatches:]]
        moe = torch.stack(records).sum(0) / pipeline.microbatches if records else torch.zeros(2, device=x.device)
        dist.all_reduce(moe, op=dist.ReduceOp.SUM, group=pipeline.group)
        model.moe_losses = moe
        loss = loss + model.cfg.moe_aux_loss_weight * moe[0] + model.cfg.moe_z_loss_weight * moe[1]
    if scaler is not None:  # before clipping: the norm and the clip are of the true gradients
        scaler.unscale_(optimizer)
        agree_found_inf(scaler, optimizer, x.device)
    params = [p for p in model.parameters() if p.grad is not None]
    # Over all stages (squares summed over pp ranks), per mesh (expert parallelism's experts are
    # on their own mesh).
    if pipeline.tied is not None:  # the tied weight counts once in the norm, as in one process
        grad_norm = clip_grad_norm_counting_once(params, pipeline.tied.copies(), clip, pipeline.group)
    else:
        grad_norm = clip_grad_norm(params, clip, norm_group=pipeline.group)
    skipped = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if scaler is not None:  # as train_step: the scaler skips non-finite steps itself, lowers its scale
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    else:
        step_unless(optimizer, skipped)
    if model.cfg.moe_experts:  # each stage's layers: the step's micro-batches (as the aux losses above)
        from kiln.model.moe import balance_experts

        stages = model.moe_load_records.values()
        max_load = torch.zeros((), device=x.device)  # a stage without MoE layers
        if stages:
            loads = torch.cat([torch.stack(per_mb[-pipeline.microbatches:]).double().sum(0) for _, per_mb in stages])
            max_load = balance_experts([m for moes, _ in stages for m in moes], loads, skipped,
                                       model.cfg.moe_bias_update_rate, model.moe_load_group)
        dist.all_reduce(max_load, op=dist.ReduceOp.MAX, group=pipeline.group)
        model.moe_max_load = max_load
    return loss, grad_norm, skipped


def clip_grad_norm_counting_once(params: list[torch.Tensor], copies: list[torch.Tensor], clip: float,
                                 norm_group) -> torch.Tensor:
    """kiln.train.step.clip_grad_norm over `params` without the copies (the tied weight counts
    once, as in one process); the copies are clipped with the same norm, hence the same factor."""
    grad_norm = clip_grad_norm([p for p in params if all(p is not c for c in copies)], clip,
                               norm_group=norm_group)
    with_grad = [c for c in copies if c.grad is not None]
    if clip > 0 and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, clip, grad_norm, foreach=True)
    return grad_norm
