"""When to checkpoint: every N steps, or `every = "auto"`, the Young/Daly interval.

Young (1974) / Daly (2006): with a blocking cost C per checkpoint and a mean time between failures
M, the interval that minimizes expected waste is about T = sqrt(2 C M); a failure then loses T/2
of work on average, and checkpointing costs C/T of the time. C is measured: the first checkpoint
is taken after `PROBE_STEPS` steps, and every save updates C (an exponential average of the
loop's blocking time) and the step time, so the interval follows the cost (an async save that
blocks 0.1 s is taken far more often than a synchronous one of 3 s). The interval is kept in steps
and recomputed only right after a save, from values all ranks agree on (max over ranks), so every
rank decides to save at the same step without a collective per step.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

PROBE_STEPS = 10  # steps before the first ("auto") checkpoint, which measures the blocking cost
_EMA = 0.5  # weight of the newest save's blocking time


def young_daly_seconds(block_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * block_s * mtbf_s)


class CheckpointInterval:
    def __init__(self, every: int | str, mtbf_hours: float = 24.0, start_step: int = 0):
        self.auto = every == "auto"
        self.every = PROBE_STEPS if self.auto else int(every)
        self.mtbf_s = mtbf_hours * 3600.0
        self.cost_s: float | None = None
        self._last_step, self._last_time = start_step, time.perf_counter()
        self._logged = False

    def due(self, step: int) -> bool:
        if self.every <= 0:
            return False
        if self.auto:
            return step - self._last_step >= self.every
        return step % self.every == 0

    def restart_from(self, step: int) -> None:
        """Training went back to `step` (a loss-spike restore): count the interval from there."""
        self._last_step, self._last_time = step, time.perf_counter()

    def saved(self, step: int, block_s: float) -> str | None:
        """Record a save's blocking time; for "auto", recompute the interval and return the line
        to log (None when nothing changed or the interval is fixed)."""
        now = time.perf_counter()
        steps = step - self._last_step
        train_s = max(now - self._last_time - block_s, 1e-9)
        self._last_step, self._last_time = step, now
        if not self.auto or steps <= 0:
            return None
        cost = block_s if self.cost_s is None else _EMA * block_s + (1 - _EMA) * self.cost_s
        step_s = train_s / steps
        cost, step_s = _max_over_ranks(cost, step_s)
        self.cost_s = cost
        interval_s = young_daly_seconds(cost, self.mtbf_s)
        previous, self.every = self.every, max(1, round(interval_s / step_s))
        if self._logged and abs(self.every - previous) <= 0.1 * previous:
            return None  # log the plan when it is made and when it moves by more than 10%
        self._logged = True
        return (f"checkpoint interval (Young/Daly): every {self.every} steps (~{interval_s:.0f} s) from a "
                f"blocking cost of {cost:.3f} s, {step_s * 1000:.1f} ms/step and MTBF {self.mtbf_s / 3600:g} h; "
                f"expected lost work per failure ~{interval_s / 2:.0f} s, checkpoint overhead "
                f"{100 * cost / interval_s:.2f}%")


def _max_over_ranks(*values: float) -> tuple[float, ...]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())
