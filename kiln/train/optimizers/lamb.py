"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2), applied per parameter tensor ("layer"):

    m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
    m_hat = m / (1 - beta1^t)                v_hat = v / (1 - beta2^t)
    r = m_hat / (sqrt(v_hat) + eps) + wd * w
    w = w - lr * (||w|| / ||r||) * r         (trust ratio 1 when either norm is 0)

phi is the identity. Moments and norms use torch's foreach ops; the step counts, bias corrections
and trust ratios stay device tensors, so a step never synchronizes with the device (CPU step
counts are read on the host, which costs nothing there), and a non-finite step is skipped on the
device through `found_inf` (kiln/train/optimizers/skip.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kiln.train.optimizers.adam_state import adam_state_lists
from kiln.train.optimizers.foreach import by_layout
from kiln.train.optimizers.skip import skip_flag, supports_device_skip, unless_skipped, zero_if_skipped_


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Lamb: lr={lr} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas={betas} must be in [0, 1)")
        if eps < 0:
            raise ValueError(f"Lamb: eps={eps} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # honours found_inf (kiln/train/optimizers/skip.py), so train_step never syncs with it
        self._step_supports_amp_scaling = supports_device_skip(p for g in self.param_groups for p in g["params"])

    def updates_elementwise(self, group: dict) -> bool:
        """No: a trust ratio per tensor (ZeRO-1 keeps its tensors whole, kiln/parallel/zero1.py)."""
        return False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = skip_flag(self)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = adam_state_lists(self, group, "Lamb")
            if params:
                for lists in by_layout(params, grads, exp_avgs, exp_avg_sqs, steps):  # foreach: one layout
                    self._update_group(group, *lists, skip)
        return loss

    @staticmethod
    def _update_group(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                      steps: list[torch.Tensor], skip: torch.Tensor | None) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        zero_if_skipped_(skip, grads)  # a skipped step: zero gradients, identity factors
        if skip is None:
            torch._foreach_add_(steps, 1.0)
            next_steps = steps
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        else:
            # The bias corrections use the step count this step would reach, also when it is
            # skipped (then a count of 0 would divide by 0; the update is discarded anyway).
            next_steps = torch._foreach_add(steps, 1.0)
            # A list of flags: there is no foreach add of one tensor (it would be read as a number).
            torch._foreach_add_(steps, [(~skip).to(torch.float32)] * len(steps))
            weight = unless_skipped(skip, 1.0 - beta1, 0.0)
            for m, g in zip(exp_avgs, grads):  # torch 2.6-2.11: DTensor rules for the scalar-weight
                m.lerp_(g, weight)  # foreach lerp only, so a tensor weight goes tensor by tensor
        torch._foreach_mul_(exp_avg_sqs, unless_skipped(skip, beta2, 1.0))
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        m_hats, denoms = _bias_corrected(exp_avgs, exp_avg_sqs, next_steps, beta1, beta2,
                                         on_host=skip is None and next_steps[0].device.type == "cpu")
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        updates = torch._foreach_div(m_hats, denoms)
        if wd != 0:
            torch._foreach_add_(updates, params, alpha=wd)
        weight_norms = torch._foreach_norm(params)
        update_norms = torch._foreach_norm(updates)
        ratios = [
            torch.where((w > 0) & (r > 0), w / r, torch.ones_like(w))
            for w, r in zip(weight_norms, update_norms)
        ]
        torch._foreach_mul_(updates, ratios)
        zero_if_skipped_(skip, updates)
        torch._foreach_add_(params, updates, alpha=-lr)


def _bias_corrected(exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                    beta1: float, beta2: float, on_host: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(m / (1 - beta1^t), v / (1 - beta2^t)) per tensor: steps can differ between tensors (a param
    that got no grad on some step). `on_host` (CPU step counts, no found_inf: reading them costs
    nothing) computes the corrections in Python; else they stay on the device, a few small ops per
    tensor (~5% of a CPU step, hence the host path there). Both compute in float64 and divide by
    the float32 value: the same bits (tests/train/test_step.py). Per-tensor divisions (which is
    how CPU foreach ops run anyway): _foreach_div.ScalarList is not among the ops kiln's optimizers
    keep to for FSDP shards (DTensor rules since torch 2.6, tests/train/test_step.py)."""
    if on_host:
        ts = [float(t) for t in steps]
        return ([m / (1.0 - beta1 ** t) for m, t in zip(exp_avgs, ts)],
                [v / (1.0 - beta2 ** t) for v, t in zip(exp_avg_sqs, ts)])
    return ([m / _bias_correction(beta1, t) for m, t in zip(exp_avgs, steps)],
            [v / _bias_correction(beta2, t) for v, t in zip(exp_avg_sqs, steps)])


def _bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """1 - beta ** step as a 0-d float32 tensor on the step's device (float64 math; MPS has none)."""
    wide = torch.float32 if step.device.type == "mps" else torch.float64
    return (1.0 - torch.pow(beta, step.to(wide))).to(torch.float32)
