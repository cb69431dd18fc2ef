"""Loss-spike recovery, as PaLM did: restore the newest good checkpoint and skip the data around
the spike.

A step's loss is a spike when it lies more than `zscore` standard deviations above the mean of
the previous `window` finite losses. Recovery waits for any save in flight, loads the newest
checkpoint (CheckpointManager.restore: its in-memory replica when there is one, else the newest
checkpoint on storage that verifies; step R < spike step S), and moves the loader's
global position to where it stood after step S plus `skip_batches` more global micro-batches: the
batches of steps R+1..S (the ones that led into the spike) and those right after it are skipped,
never replayed. The guard itself is not checkpointed (restoring must not reset its recovery
count); after a process restart it starts afresh.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any


class SpikeGuard:
    def __init__(self, zscore: float, window: int = 50, max_recoveries: int = 3, skip_batches: int = 0):
        self.zscore, self.max_recoveries, self.skip_batches = zscore, max_recoveries, skip_batches
        self.recent: deque[float] = deque(maxlen=window)
        self.recoveries = 0

    def observe(self, loss: float) -> float | None:
        """The loss's z-score if it is a spike (it then stays out of the window), else None."""
        if self.zscore <= 0 or not math.isfinite(loss):
            return None
        if len(self.recent) == self.recent.maxlen:
            mean, std = statistics.fmean(self.recent), statistics.pstdev(self.recent)
            z = (loss - mean) / max(std, 1e-8)
            if z > self.zscore:
                return z
        self.recent.append(loss)
        return None

    def can_recover(self) -> bool:
        return self.recoveries < self.max_recoveries

    def recover(self, ckpt, stateful: dict[str, Any], loader, step: int, loss: float, z: float) -> tuple[int, dict]:
        """Restore and skip; returns (restored step, the event row). The caller logs ckpt.wait()'s
        results first, so a save in flight is complete before it is chosen to restore."""
        spike_epoch, spike_position = loader.epoch, loader.position
        restored, source, _ = ckpt.restore(stateful)  # host memory when a replica is as new as storage
        from_epoch, from_position = loader.epoch, loader.position
        to_position = spike_position + self.skip_batches * loader.global_batch
        loader.load_state_dict({"epoch": spike_epoch, "position": to_position, "seed": loader.seed})
        self.recoveries += 1
        skipped = {"from_epoch": from_epoch, "from_position": from_position,
                   "to_epoch": spike_epoch, "to_position": to_position}
        message = (f"loss spike at step {step} (loss {loss:.4f}, z {z:.1f} > {self.zscore:g}): restored step "
                   f"{restored} from {source}, skipped samples epoch {from_epoch} position {from_position} to epoch "
                   f"{spike_epoch} position {to_position} (recovery {self.recoveries}/{self.max_recoveries})")
        return restored, {"kind": "event", "step": step, "message": message, "spike_recovery": True,
                          "restored_step": restored, "restored_from": source, "skipped_samples": skipped}
