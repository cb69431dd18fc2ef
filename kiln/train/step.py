"""The training step, and the device-side results of the steps not yet fetched.

`train_step` is pure compute: forward + loss (the model returns the loss when given targets, so a
whole-model compile covers the head and the loss), backward, clip, optimizer step. It never
waits for the device: the loss, the grad norm and the "skipped" flag stay device tensors, and a
non-finite step is skipped on the device by handing the optimizer a `found_inf` tensor, the
mechanism torch's grad scaler uses with fused Adam/AdamW/SGD (their kernels leave parameters,
moments and step counts untouched when it is non-zero). Optimizers without that mechanism
(kiln's Lion/LAMB/Muon, foreach AdamW, Adafactor) fall back to one host check per step; the run
row says which (`nonfinite_check`).

`PendingSteps` collects those tensors and fetches them in one transfer every `metrics.log_every`
steps (and before evaluations, checkpoints and the end), so `metrics.jsonl` still gets one row
per step while the host never stalls the device in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when `optimizer.step()` honours a `found_inf` tensor (torch's fused kernels)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and all(
        g.get("fused") for g in optimizer.param_groups)


def train_step(model, optimizer, micro_batches, *, autocast, scaler, clip: float):
    """Forward/backward over the micro-batches, clip, step.

    Returns device tensors (mean loss, grad norm, skipped): `skipped` is True when the loss or the
    gradient was not finite, in which case the parameters and optimizer state are unchanged.
    """
    total = torch.zeros((), device=micro_batches[0][0].device)
    for x, y in micro_batches:
        with autocast:
            loss = model(x, y) / len(micro_batches)
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf, foreach=True)
    if isinstance(grad_norm, DTensor):  # sharded (FSDP/TP) parameters: the norm of the full gradient
        grad_norm = grad_norm.full_tensor()
    skipped = ~(torch.isfinite(total) & torch.isfinite(grad_norm))
    if scaler:  # the scaler skips non-finite steps itself and lowers its scale
        scaler.step(optimizer)
        scaler.update()
    elif skips_on_device(optimizer):
        optimizer.found_inf, optimizer.grad_scale = skipped.float(), None
        optimizer.step()
        optimizer.found_inf = None
    elif not bool(skipped):  # host sync: this optimizer cannot skip on the device
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, skipped


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    skipped: bool
    lr: float
    data_wait_s: float
    tokens: int


class PendingSteps:
    """Device results of the steps since the last fetch; `fetch` moves them to the host at once.

    The loss is averaged over all ranks (one all-reduce per fetch, not per step).
    """

    def __init__(self):
        self._steps: list[tuple[int, float, float, int]] = []  # (step, lr, data wait s, tokens)
        self._values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor,
            *, lr: float, data_wait_s: float, tokens: int) -> None:
        self._steps.append((step, lr, data_wait_s, tokens))
        self._values.append(torch.stack([loss.float(), grad_norm.float(), skipped.float()]))

    def fetch(self) -> list[StepResult]:
        if not self._steps:
            return []
        values = torch.stack(self._values)
        if dist.is_available() and dist.is_initialized():
            loss = values[:, 0].contiguous()
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # gloo has no AVG
            values[:, 0] = loss / dist.get_world_size()
        host = values.cpu().tolist()
        out = [StepResult(step, loss, gnorm, bool(skip), lr, wait, tokens)
               for (step, lr, wait, tokens), (loss, gnorm, skip) in zip(self._steps, host)]
        self._steps, self._values = [], []
        return out
