"""DiLoCo / local SGD for weakly connected clusters (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", algorithm 1).

Every data-parallel rank is a replica that trains alone (no gradient all-reduce) with its own
inner optimizer (kiln's configured one, AdamW in the paper) on its own slice of the data. Every
H = `parallel.diloco_inner_steps` steps the replicas meet once:

    delta   = anchor - mean over replicas(params)        # the outer "pseudo-gradient"
    anchor  = outer Nesterov SGD step on anchor with gradient delta   (lr 0.7, momentum 0.9)
    params  = anchor                                      # every replica restarts from it

where `anchor` holds the parameters of the last sync. One all-reduce of the parameters per H steps
replaces H gradient all-reduces; `outer_step` returns the bytes this rank sends into it (the
payload; a ring all-reduce moves about 2 (N-1)/N of that over each link).

torch APIs: `torch.optim.SGD(nesterov=True)` is the outer optimizer and `torch.distributed.
all_reduce` (one flat buffer per sync) the averaging; the bookkeeping is kiln's. The inner
optimizer state stays per replica, as in the paper.

Checkpoints. Between outer syncs every replica has its own parameters and inner optimizer state
(AdamW moments), so each rank saves its own: rank 0 under the usual `app` key (what eval, generate
and export read, and what a non-DiLoCo run continues from), rank r > 0 under `diloco_rank<r>`
(`replica_states`). DCP writes keys that only one rank holds from that rank, so this is one DCP
checkpoint with one manifest, loaded through the same safe reader. The anchor and the outer
momentum (`diloco`) are equal on every rank and stored once. A DiLoCo run continues only a
checkpoint of as many DiLoCo replicas (`check_resume`, one line otherwise): a replica without its
own state would train on another's moments.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import KilnError

APP_KEY = "app"  # the model + optimizer entry of kiln's checkpoint (kiln/train/trainer.py)
REPLICA_PREFIX = "diloco_rank"  # rank r > 0's own model + inner optimizer: diloco_rank<r>


def replica_key(rank: int) -> str:
    return APP_KEY if rank == 0 else f"{REPLICA_PREFIX}{rank}"


def replica_states(states: dict, rank: int) -> dict:
    """`states` (the trainer's Stateful dict) with this rank's model + inner optimizer under its
    own key, so every replica saves and loads its own (rank 0 keeps `app`)."""
    return {replica_key(rank) if name == APP_KEY else name: value for name, value in states.items()}


def check_resume(saved_names: set[str], world: int, where: str) -> None:
    """One line unless the checkpoint (its top-level state names) holds DiLoCo state for exactly
    `world` replicas."""
    if "diloco" not in saved_names:
        raise KilnError(f"{where} was saved without DiLoCo; a DiLoCo run (parallel.diloco_inner_steps > 0) "
                        f"continues only a DiLoCo checkpoint: set parallel.diloco_inner_steps=0 or start a "
                        f"new --run-dir")
    others = {int(n[len(REPLICA_PREFIX):]) for n in saved_names
              if n.startswith(REPLICA_PREFIX) and n[len(REPLICA_PREFIX):].isdigit()}
    saved = 1 + max(others, default=0)
    if saved != world or others != set(range(1, world)):
        raise KilnError(f"{where} holds {saved} DiLoCo replicas' state, this run has {world}; each replica "
                        f"resumes its own model and inner optimizer, so DiLoCo continues with {saved} "
                        f"processes (or continue without DiLoCo from replica 0's state: "
                        f"parallel.diloco_inner_steps=0)")


class DiLoCo:
    def __init__(self, model: nn.Module, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group=None):
        if inner_steps < 1:
            raise ValueError(f"DiLoCo needs inner_steps >= 1, got {inner_steps}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_steps, self.group = inner_steps, group
        # The anchor is fp32 whatever the parameters' dtype: the outer step adds small deltas to it.
        self.anchor = [p.detach().clone().float() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        # A zero momentum buffer steps exactly like torch's lazily created one (buf = g at the first
        # step) and exists before the first sync, so a checkpoint can load into it.
        for a in self.anchor:
            self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        self.outer_steps = 0

    def due(self, step: int) -> bool:
        """True after inner step `step` (1-based) when an outer step follows."""
        return step % self.inner_steps == 0

    @torch.no_grad()
    def outer_step(self) -> int:
        """Average the replicas, take the outer Nesterov step, reset every replica to the result.
        Returns the bytes this rank contributed to the all-reduce."""
        flat = torch.cat([p.detach().float().reshape(-1) for p in self.params])
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.group)
            if world > 1:
                dist.all_reduce(flat, group=self.group)  # gloo has no AVG: sum, then divide
        flat.div_(world)
        offset = 0
        for anchor in self.anchor:
            n = anchor.numel()
            anchor.grad = anchor - flat[offset:offset + n].view_as(anchor)
            offset += n
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for anchor, p in zip(self.anchor, self.params):
            p.copy_(anchor)
        self.outer_steps += 1
        return flat.numel() * flat.element_size() if world > 1 else 0

    # Stateful, for the checkpoint: the anchor and the outer momentum (equal on every replica),
    # as a flat dict of tensors that DCP saves and loads in place.
    def state_dict(self) -> dict:
        state = {f"anchor.{i}": a for i, a in enumerate(self.anchor)}
        state.update({f"momentum.{i}": self.outer.state[a]["momentum_buffer"] for i, a in enumerate(self.anchor)})
        state["outer_steps"] = torch.tensor(self.outer_steps)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for i, a in enumerate(self.anchor):
            a.copy_(state[f"anchor.{i}"])
            self.outer.state[a]["momentum_buffer"].copy_(state[f"momentum.{i}"])
        self.outer_steps = int(state["outer_steps"])
