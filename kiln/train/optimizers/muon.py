"""Muon (Keller Jordan 2024, "Muon: MomentumOrthogonalized by Newton-Schulz").

Hidden weight matrices get SGD-Nesterov momentum whose update is replaced by its nearest
semi-orthogonal matrix, approximated by a quintic Newton-Schulz iteration; everything else
(embeddings, the LM head, norms, biases) is updated by AdamW in the same optimizer object, so
one state_dict and one LR schedule cover the whole model. The AdamW part is torch's fused AdamW
kernel where torch has one (CPU, CUDA, ...): it skips a non-finite step on the device itself; the
Muon part skips through kiln/train/optimizers/skip.py.

Param groups carry `use_muon`: True for orthogonalized matrices, False for the AdamW ones.

Why kiln keeps its own rather than `torch.optim.Muon` (torch >= 2.9, checked against 2.13): torch's
Muon takes 2-D parameters only (it raises on the embeddings' companions: norms and biases), so a
model needs two optimizers, two state dicts and two schedules; it exists only from 2.9 while kiln
declares torch >= 2.6; and it orthogonalizes each local tensor as it finds it, which under FSDP2
would orthogonalize a row shard instead of the whole matrix. Here a sharded matrix (DTensor) is
orthogonalized whole, on one of the ranks that shard it, and each rank gets its shard of the
result (kiln/train/optimizers/muon_split.py: the ranks split the iterations instead of all
repeating them); AdamW steps the rest in the same object. Its Newton-Schulz iteration
(kiln/train/optimizers/newton_schulz.py) has torch's coefficients and step count.

A group with `stacked=True` holds expert stacks (E, in, out) used as `x @ w[e]` (kiln's
GroupedExperts): each expert's matrix is orthogonalized and scaled on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw as adamw_step

from kiln.train.optimizers.muon_split import orthogonalize_updates
from kiln.train.optimizers.adam_state import adam_state_lists, fused_adam_supported
from kiln.train.optimizers.skip import skip_flag, supports_device_skip, unless_skipped, zero_if_skipped_

def shape_lr_scale(shape: torch.Size, stacked: bool = False) -> float:
    """Keller Jordan's scale: sqrt(max(1, rows / cols)) for an (out, in) weight; for an expert
    stack (E, in, out) that of each expert's matrix."""
    rows, cols = (shape[-1], shape[-2]) if stacked else (shape[0], math.prod(shape[1:]))
    return max(1.0, rows / cols) ** 0.5


class Muon(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Muon: lr={lr} must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum={momentum} must be in [0, 1)")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, use_muon=True)
        super().__init__(params, defaults)
        # a process group whose ranks hold the plain (non-DTensor) parameters and gradients alike
        # (DDP's replicas): each of them orthogonalizes a share and broadcasts it (muon_split.py)
        self.replicas = None
        # honours found_inf (kiln/train/optimizers/skip.py; torch's fused AdamW kernel for the AdamW
        # groups), so train_step never syncs with it
        self._step_supports_amp_scaling = all(
            supports_device_skip(g["params"]) if g["use_muon"] else fused_adam_supported(g["params"])
            for g in self.param_groups)
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if group.get("stacked", False) and p.ndim != 3:
                        raise ValueError(f"Muon: a stacked group holds a tensor of shape {tuple(p.shape)}; "
                                         "stacks are (experts, in, out)")
                    if p.ndim < 2:
                        raise ValueError(
                            f"Muon: a use_muon group holds a tensor of shape {tuple(p.shape)}; "
                            "only matrices can be orthogonalized (put it in a use_muon=False group)"
                        )

    def updates_elementwise(self, group: dict) -> bool:
        """ZeRO-1 may cut a group into runs (kiln/parallel/zero1.py) only where it is element-wise:
        the AdamW groups, not the orthogonalized matrices."""
        return not group.get("use_muon", True)

    def share_over_replicas(self, group) -> None:
        """`group`'s ranks hold equal plain gradients (DDP's replicas): deal the Newton-Schulz
        iterations out over them (kiln/parallel/data_parallel.py `shard_optimizer_state`)."""
        self.replicas = group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = skip_flag(self)
        # every Muon group's updates in one call: matrices and expert stacks dealt out together
        prepared = [(group, *self._muon_updates(group, skip)) for group in self.param_groups if group["use_muon"]]
        flags = [group.get("stacked", False) for group, params, _ in prepared for _ in params]
        results = iter(orthogonalize_updates([u for _, _, updates in prepared for u in updates], flags, self.replicas))
        for group, params, _ in prepared:
            lr, wd, stacked = group["lr"], group["weight_decay"], group.get("stacked", False)
            decay = unless_skipped(skip, 1.0 - lr * wd, 1.0)
            for p in params:
                ortho = next(results)
                zero_if_skipped_(skip, [ortho])
                if wd != 0:
                    p.mul_(decay)
                p.add_(ortho, alpha=-lr * shape_lr_scale(p.shape, stacked))
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group, skip)
        return loss

    def _muon_updates(self, group: dict[str, Any], skip: torch.Tensor | None) -> tuple[list, list]:
        """(params, their Nesterov momentum updates) of a Muon group, the momentum buffers stepped."""
        beta = group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        zero_if_skipped_(skip, [p.grad for p in params])  # a skipped step: zero gradients, identity factors
        weight = unless_skipped(skip, 1.0 - beta, 0.0)
        updates = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, weight)  # buf = beta * buf + (1 - beta) * g
            # Nesterov: look ahead along the momentum: (1 - beta) * g + beta * buf, in the
            # gradient's storage (spent once the buffer has it), so the groups add no copy.
            updates.append(p.grad.lerp_(buf, beta) if group["nesterov"] else buf)
        return params, updates

    def _adamw_group(self, group: dict[str, Any], skip: torch.Tensor | None) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = adam_state_lists(self, group, "Muon's AdamW part")
        if not params:
            return
        beta1, beta2 = group["betas"]
        # torch's fused AdamW kernel takes found_inf itself (and has had a DTensor rule since 2.6);
        # where torch has no fused kernel, Muon does not claim to skip on the device (__init__).
        adamw_step(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
                   fused=fused_adam_supported(params) or None,
                   found_inf=None if skip is None else skip.to(torch.float32),
                   amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
