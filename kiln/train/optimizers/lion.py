"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    update = sign(beta1 * m + (1 - beta1) * g)
    w      = w * (1 - lr * wd) - lr * update          (decoupled weight decay)
    m      = beta2 * m + (1 - beta2) * g

One momentum buffer per parameter (half of Adam's state). Implemented with torch's foreach ops
over each group so a step is a handful of kernel launches, not one per tensor per op; only ops
with DTensor sharding rules across the declared torch range, so it steps FSDP-sharded
parameters too (the sign is per tensor: torch 2.11 has no rule for _foreach_sign).
A non-finite step is skipped on the device through `found_inf` (kiln/train/optimizers/skip.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kiln.train.optimizers.foreach import by_layout
from kiln.train.optimizers.skip import skip_flag, supports_device_skip, unless_skipped, zero_if_skipped_


class Lion(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Lion: lr={lr} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas={betas} must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        # honours found_inf (kiln/train/optimizers/skip.py), so train_step never syncs with it
        self._step_supports_amp_scaling = supports_device_skip(p for g in self.param_groups for p in g["params"])

    def updates_elementwise(self, group: dict) -> bool:
        """Each element's update reads only that element's state: ZeRO-1 may cut the parameters
        into runs (kiln/parallel/zero1.py)."""
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = skip_flag(self)
        for group in self.param_groups:
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if not params:
                continue
            for lists in by_layout(params, grads, exp_avgs):  # foreach takes one tensor layout
                self._update(group, *lists, skip)
        return loss

    @staticmethod
    def _update(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                skip: torch.Tensor | None) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        zero_if_skipped_(skip, grads)  # a skipped step: zero gradients, identity factors
        if wd != 0:
            torch._foreach_mul_(params, unless_skipped(skip, 1.0 - lr * wd, 1.0))
        # torch 2.11 has no DTensor sharding rule for the out-of-place _foreach_lerp nor for
        # _foreach_sign(_), so FSDP-sharded parameters could not step: mul + add, and a
        # per-tensor sign_ (a plain pointwise op, which DTensor supports everywhere).
        # beta1 * m + (1 - beta1) * g; skipped: 0 * m + 0 (zeroed g), whose sign 0 moves nothing
        updates = torch._foreach_mul(exp_avgs, unless_skipped(skip, beta1, 0.0))
        torch._foreach_add_(updates, grads, alpha=1.0 - beta1)
        for update in updates:
            update.sign_()
        torch._foreach_add_(params, updates, alpha=-lr)
        torch._foreach_mul_(exp_avgs, unless_skipped(skip, beta2, 1.0))  # m = beta2 * m + (1 - beta2) * g
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
