"""Activation-checkpoint planner: the least recompute that meets a memory budget.

Mimose-style (Liao et al. 2022): recompute is chosen per block from the memory model, not as
all-or-nothing. kiln's blocks are identical, so what matters is how many are recomputed; the
planner returns the `train.activation_checkpointing = "every_k:K"` with the largest K (fewest
recomputed blocks, ceil(L/K)) whose predicted peak fits, "none" when nothing needs recomputing.
Given a step-time model it also weighs "op" (every block keeps its matmul and attention outputs
and recomputes only its cheap ops, torchtitan's op-level selective checkpointing): taken when it
fits and is predicted faster than that every_k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kiln.errors import KilnError
from kiln.plan.memory import ZERO_BUBBLE, Layout, MemoryBreakdown, ModelShape, rank_memory, recomputed_blocks


def plan_activation_checkpointing(shape: ModelShape, layout: Layout, seq_len: int, budget_bytes: float,
                                  optimizer: str = "adamw", step_seconds: Callable[[str], float] | None = None,
                                  ) -> tuple[str, MemoryBreakdown]:
    """The cheapest activation-checkpointing setting for `layout` that fits `budget_bytes`:
    the fewest recomputed blocks, or "op" where `step_seconds` (the predicted step time of `layout`
    with a given setting) says it is faster."""
    layers = -(-shape.n_layers // layout.pp)
    mem = rank_memory(shape, dataclasses.replace(layout, ac="none"), seq_len, optimizer)
    if mem.total <= budget_bytes:
        return "none", mem
    seen = set()
    for k in range(layers, 0, -1):  # fewer recomputed blocks first
        n = recomputed_blocks(f"every_k:{k}", layers)
        if n in seen:
            continue
        seen.add(n)
        ac = "full" if k == 1 else f"every_k:{k}"
        mem = rank_memory(shape, dataclasses.replace(layout, ac=ac), seq_len, optimizer)
        if mem.total <= budget_bytes:
            if step_seconds is not None and not (layout.pp > 1 and layout.schedule in ZERO_BUBBLE):  # refused there
                op = rank_memory(shape, dataclasses.replace(layout, ac="op"), seq_len, optimizer)
                if op.total <= budget_bytes and step_seconds("op") < step_seconds(ac):
                    return "op", op
            return ac, mem
    raise KilnError(f"{layout.describe()} needs {mem.total / 2**30:,.2f} GiB even with every block recomputed; "
                    f"the budget is {budget_bytes / 2**30:,.2f} GiB")
