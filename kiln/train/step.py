"""The training step, and the device-side results of the steps not yet fetched.

`train_step` is pure compute: forward + loss (the model returns the loss when given targets, so a
whole-model compile covers the head and the loss), backward, clip, optimizer step. It never
waits for the device: the loss, the grad norm and the "skipped" flag stay device tensors, and a
non-finite step is skipped on the device by handing the optimizer a `found_inf` tensor, the
protocol torch's grad scaler uses with optimizers that set `_step_supports_amp_scaling`: torch's
fused Adam/AdamW/SGD (their kernels leave parameters, moments and step counts untouched when it is
non-zero) and kiln's Lion/LAMB/Muon (kiln/train/optimizers/skip.py). torch's non-fused optimizers
(foreach or single-tensor AdamW, non-fused SGD) and kiln's Adafactor have no such path and fall
back to one host check per step; the run row says which (`nonfinite_check`).

Parameters on the CPU take the host check too (`skips_on_device`): there the check waits for
nothing (CPU ops run synchronously), while the masked step costs extra passes over the gradients
(~20% of Lion's and LAMB's step on a 2-core x86 CPU; benchmarks/README.md, "Optimizer step").
Both paths give the same bits on CPU (tests/train/test_step.py); `force_device_skip` keeps the
masked path on CPU for the tests that cover it there.

`PendingSteps` collects those tensors and fetches them in one transfer every `metrics.log_every`
steps (and before evaluations, checkpoints and the end), so `metrics.jsonl` still gets one row
per step while the host never stalls the device in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor



FORCE_DEVICE_SKIP = "_kiln_force_device_skip"  # the optimizer attribute force_device_skip sets


def honours_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """True when `optimizer.step()` honours a `found_inf` tensor: torch sets the flag on its fused
    optimizers, kiln on its own (GradScaler reads the same flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when `train_step` hands this optimizer `found_inf` instead of checking on the host: it
    honours found_inf and not all of its parameters are on the CPU (there a host check costs
    nothing and the masked step does: see the module docstring), or `force_device_skip` asked."""
    if not honours_found_inf(optimizer):
        return False
    return getattr(optimizer, FORCE_DEVICE_SKIP, False) or any(
        p.device.type != "cpu" for group in optimizer.param_groups for p in group["params"])


def force_device_skip(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `train_step` skip non-finite steps on the device (found_inf) even when the parameters
    are on the CPU, where it would check on the host: an explicit override for tests that cover
    the masked path on CPU, and for timing it (benchmarks/optimizer_step.py). A no-op for an
    optimizer that does not honour found_inf. Returns the optimizer."""
    setattr(optimizer, FORCE_DEVICE_SKIP, True)
    return optimizer


def train_step(model, optimizer, micro_batches, *, autocast, scaler, clip: float):
    """Forward/backward over the micro-batches, clip, step.

    Returns device tensors (mean loss, grad norm, skipped): `skipped` is True when the loss or the
    gradient was not finite, in which case the parameters and optimizer state are unchanged.
    """
    total = torch.zeros((), device=micro_batches[0][0].device)
    loads = None  # MoE assignments per layer and expert, for balance_experts
    for i, (x, y, *doc_ids) in enumerate(micro_batches):  # doc_ids: packed_masked windows (kiln/data/loader.py)
        if len(micro_batches) > 1:  # DDP / HSDP reduce across replicas in the last backward only
            from kiln.parallel.data_parallel import sync_on_last_micro_batch

            sync_on_last_micro_batch(model, i == len(micro_batches) - 1)
        with autocast:
            loss = (model(x, y, doc_ids=doc_ids[0]) if doc_ids else model(x, y)) / len(micro_batches)
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
        if getattr(model, "moe_loads", None) is not None:
            loads = model.moe_loads.double() + (0 if loads is None else loads)
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = clip_grad_norm(params, clip)
    skipped = ~(torch.isfinite(total) & torch.isfinite(grad_norm))
    if scaler:  # the scaler skips non-finite steps itself and lowers its scale
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    else:
        step_unless(optimizer, skipped)
    if loads is not None:
        from kiln.model.moe import balance_experts, moe_layers

        model.moe_max_load = balance_experts(moe_layers(model), loads, skipped, model.cfg.moe_bias_update_rate,
                                             model.moe_load_group)
    return total, grad_norm, skipped


def settle_grad_placements(params: list[torch.Tensor]) -> None:
    """Every DTensor gradient in its parameter's placements, before clipping and the optimizer.
    The gradient of a replicated parameter fed by sequence-sharded activations (a norm weight under
    sequence parallelism) comes out of backward Partial, a pending sum. Left so, what the optimizer
    makes of it depends on the torch release: 2.13's ops all-reduce it at every read (the gradient
    norm, then AdamW: once fused, three times foreach); 2.11's do not reduce it in the update (it
    drifted from one process); on 2.11 and 2.14 an SGD momentum buffer cloned from it stays Partial,
    which DCP refuses to save. Settled here once per step: one redistribute (an all-reduce over the
    partial mesh dimensions) per such gradient, on every release, which is also fewer collectives
    than 2.13's reads. `clip_grad_norm` calls it."""
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
            p.grad = grad.redistribute(p.device_mesh, p.placements)


def clip_grad_norm(params: list[torch.Tensor], clip: float, norm_group=None) -> torch.Tensor:
    """torch's `clip_grad_norm_` (clip <= 0: the norm only), where the gradients may be DTensors
    on several meshes (expert parallelism keeps the experts on their own mesh, see
    kiln/parallel/expert_parallel.py): torch's `get_total_norm` per mesh, each made a plain
    tensor (`full_tensor`: the norm of the full gradient) and combined, then
    `clip_grads_with_norm_`, as torchtitan does for its expert-parallel parameters.
    norm_group: ranks holding the other parts of the model (pipeline stages), whose squared norms
    are summed in (every rank of the group must call this)."""
    settle_grad_placements(params)
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        grad_norm = torch.nn.utils.get_total_norm([])
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if norm_group is not None:
        squares = grad_norm.float() ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=norm_group)
        grad_norm = squares.sqrt()
    for group in by_mesh.values() if clip > 0 else ():  # one foreach call per mesh
        torch.nn.utils.clip_grads_with_norm_(group, clip, grad_norm, foreach=True)
    return grad_norm


def step_unless(optimizer: torch.optim.Optimizer, skipped: torch.Tensor) -> None:
    """optimizer.step() unless `skipped` (a device bool): on the device where `skips_on_device`
    (found_inf), else after one host check; then zero the gradients."""
    if skips_on_device(optimizer):
        optimizer.found_inf, optimizer.grad_scale = skipped.float(), None
        optimizer.step()
        optimizer.found_inf = None
    elif not bool(skipped):  # host sync: this optimizer cannot skip on the device
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    skipped: bool
    lr: float
    data_wait_s: float
    tokens: int
    extras: dict[str, float] | None = None  # e.g. MoE aux losses, DiLoCo bytes; averaged over ranks


class PendingSteps:
    """Device results of the steps since the last fetch; `fetch` moves them to the host at once.

    The loss and the `extras` are averaged over all ranks (one all-reduce per fetch, not per step);
    a step counts as skipped if any rank skipped it. Ranks that share a gradient agree anyway, but
    DiLoCo's replicas step apart between outer steps: one replica's non-finite step must count on
    every rank, or only its ranks stop at train.max_nonfinite_steps and the others hang.
    """

    def __init__(self):
        self._steps: list[tuple[int, float, float, int, tuple[str, ...]]] = []  # (step, lr, wait s, tokens, extra names)
        self._values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor,
            *, lr: float, data_wait_s: float, tokens: int, extras: dict[str, torch.Tensor] | None = None) -> None:
        extras = extras or {}
        self._steps.append((step, lr, data_wait_s, tokens, tuple(extras)))
        # Under FSDP the grad norm (and so `skipped`) are replicated DTensors: their plain value, so
        # the row stays a plain tensor for the all-reduce in fetch (no communication for Replicate).
        row = [t.full_tensor() if isinstance(t, DTensor) else t
               for t in (loss, grad_norm, skipped, *extras.values())]
        self._values.append(torch.stack([t.float().to(loss.device) for t in row]))

    def fetch(self) -> list[StepResult]:
        if not self._steps:
            return []
        # Every step of a run has the same extras (or none): pad to the widest row to be safe.
        width = max(v.numel() for v in self._values)
        values = torch.stack([torch.cat([v, v.new_zeros(width - v.numel())]) for v in self._values])
        if dist.is_available() and dist.is_initialized():
            summed = torch.cat([values[:, :1], values[:, 2:]], dim=1).contiguous()  # all but the grad norm
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # gloo has no AVG
            values[:, 0], values[:, 3:] = summed[:, 0] / dist.get_world_size(), summed[:, 2:] / dist.get_world_size()
            values[:, 2] = (summed[:, 1] > 0).float()  # skipped on any rank
        host = values.cpu().tolist()
        out = [StepResult(step, row[0], row[1], bool(row[2]), lr, wait, tokens,
                          dict(zip(names, row[3:])) if names else None)
               for (step, lr, wait, tokens, names), row in zip(self._steps, host)]
        self._steps, self._values = [], []
        return out
