"""fp16 (a grad scaler) under pipeline parallelism: the schedule's loss function scales the last
stage's loss, and every rank agrees on the found-inf flag, so all stages skip or step together
(kiln/train/pipeline_step.py `pipeline_train_step` uses both)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class ScaledLoss:
    """The schedule's loss_fn: kiln's LM loss on the last stage's output; while a step with a grad
    scaler runs (fp16), divided by the micro-batch count and multiplied by the scaler's scale, as
    Megatron-LM and DeepSpeed scale the last stage's loss inside their schedules: torch's schedules
    backpropagate what loss_fn returns, so every stage's gradients come out scaled. The division
    happens here, before the backward (the schedule's `scale_grads` is off for such a step), so the
    fp16 backward carries the magnitudes of `train_step`'s (loss / micro-batches x scale) and
    overflows at the same scale. `unscaled` keeps each micro-batch's loss as computed (the step's
    reported loss). The scaling itself is torch's (`GradScaler.scale`)."""

    def __init__(self, loss_fn, microbatches: int):
        self.loss_fn, self.microbatches, self.scaler = loss_fn, microbatches, None
        self.divide = False  # always divide by the micro-batch count (torch 2.6: no scale_grads)
        self.unscaled: list[torch.Tensor] = []

    def __call__(self, output, target):
        loss = self.loss_fn(output, target)
        self.unscaled.append(loss.detach())
        return self.scale(loss)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """What the backward of a term of a micro-batch's loss starts from (MoE aux losses too)."""
        if self.scaler is not None:
            return self.scaler.scale(loss / self.microbatches)
        return loss / self.microbatches if self.divide else loss


def agree_found_inf(scaler, optimizer, device: torch.device) -> None:
    """Make the grad scaler's found-inf flags (set by `GradScaler.unscale_` from this rank's own
    gradients) the MAX over all ranks, so every stage skips or steps together and every rank's
    scale update is the same. torch's DTensor handler already reduces the flag over the mesh of
    sharded (FSDP2, tp) gradients, but it reads the placements of the first gradient only, and no
    mesh spans the pipeline stages; one element all-reduced over the default group covers pp, tp,
    dp and ep at once. MAX, not SUM (torch's FSDP1 ShardedGradScaler sums): torch's fused
    optimizers skip only when found_inf == 1. GradScaler has no public hook for this: the flags are
    read from its per-optimizer state, where torch's ShardedGradScaler reduces them too."""
    flags = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device")
    if flags is None:
        raise RuntimeError("GradScaler.unscale_ recorded no found_inf_per_device for the optimizer "
                           "(torch's GradScaler internals changed?)")
    # Every rank takes part, even one that recorded no flag (a collective per rank, not per device).
    agreed = torch.stack([f.to(device) for f in flags.values()]).amax() if flags else torch.zeros((), device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for flag in flags.values():
        flag.copy_(agreed)
