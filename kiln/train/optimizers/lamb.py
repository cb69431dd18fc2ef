"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2), applied per parameter tensor ("layer"):

    m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
    m_hat = m / (1 - beta1^t)                v_hat = v / (1 - beta2^t)
    r = m_hat / (sqrt(v_hat) + eps) + wd * w
    w = w - lr * (||w|| / ||r||) * r         (trust ratio 1 when either norm is 0)

phi is the identity. Moments and norms use torch's foreach ops; the trust ratio stays a tensor,
so a step never synchronizes with the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kiln.train.optimizers.adam_state import adam_state_lists


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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = adam_state_lists(self, group, "Lamb")
            if params:
                self._update_group(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss

    @staticmethod
    def _update_group(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                      steps: list[torch.Tensor]) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        # Steps can differ between tensors (a param that got no grad on some step), so the bias
        # corrections are per tensor; they are CPU scalars, read without a device sync.
        ts = [float(s) for s in steps]
        m_hats = torch._foreach_div(exp_avgs, [1.0 - beta1 ** t for t in ts])
        denoms = torch._foreach_div(exp_avg_sqs, [1.0 - beta2 ** t for t in ts])
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
        torch._foreach_add_(params, updates, alpha=-lr)
