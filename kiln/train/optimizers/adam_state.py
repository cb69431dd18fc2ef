"""The Adam-style state both LAMB and Muon's AdamW part keep, laid out like torch.optim.AdamW."""

from __future__ import annotations

from typing import Any

import torch


def adam_state_lists(optimizer: torch.optim.Optimizer, group: dict[str, Any], who: str):
    """(params, grads, exp_avgs, exp_avg_sqs, steps) of a group's params that have gradients.

    State is created on first use: `step` a CPU float tensor like torch's Adam, so DCP checkpoints
    it as state, and the two moments zeros like the parameter.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{who} does not support sparse gradients")
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps
