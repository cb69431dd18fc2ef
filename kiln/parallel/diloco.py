"""DiLoCo / local SGD for weakly connected clusters (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", algorithm 1).

The replicas are the `dp_replicate` ranks of the mesh. Each replica trains alone with its own inner
optimizer (kiln's configured one, AdamW in the paper) on its own slice of the data; inside a
replica the model may be split: FSDP2 over `dp_shard` (dp_mode fsdp/zero2, gradients reduced inside
the replica only, never HSDP) and tensor parallelism over `tp`. Every H =
`parallel.diloco_inner_steps` steps the replicas meet once:

    delta   = anchor - mean over replicas(params)        # the outer "pseudo-gradient"
    anchor  = outer Nesterov SGD step on anchor with gradient delta   (lr 0.7, momentum 0.9)
    params  = anchor                                      # every replica restarts from it

where `anchor` holds the parameters of the last sync. Every rank works on its own shards only (the
DTensor local tensors): it averages them with the ranks holding the same shard in the other
replicas (the dp_replicate group) and steps its shard of the anchor, so the anchor and the outer
momentum are sharded like the parameters, and nothing crosses replicas between outer steps (the
torchft `DiLoCo` layout: one replica per island, FSDP/TP inside). `outer_step` returns the bytes
this rank sends into the all-reduce (its payload; a ring moves about 2 (N-1)/N of that per link).

torch APIs: `torch.optim.SGD(nesterov=True)` is the outer optimizer, `torch.distributed.all_reduce`
(one flat buffer per sync) the averaging, `DTensor.to_local` / `DTensor.from_local` the shards; the
bookkeeping is kiln's. The inner optimizer state stays per replica, as in the paper.

Checkpoints. Between outer syncs every replica has its own parameters and inner optimizer state
(AdamW moments), so each replica saves its own: replica 0 under the usual `app` key (what eval,
generate and export read, and what a non-DiLoCo run continues from), replica r > 0 under
`diloco_rank<r>` (`replica_states`). The ranks of one replica save their shards under that key
(DCP writes each shard once), so this is one DCP checkpoint with one manifest, loaded through the
same safe reader. The anchor and the outer momentum (`diloco`) are equal across replicas, DTensors
sharded like the parameters, and stored once. A `diloco_layout_<R>x<S>x<T>` entry records the
replica count and the dp_shard x tp split inside each; a DiLoCo run continues only a checkpoint of
the same layout (`check_resume`, one line otherwise): a replica without its own state would train
on another's moments.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.errors import KilnError

APP_KEY = "app"  # the model + optimizer entry of kiln's checkpoint (kiln/train/trainer.py)
REPLICA_PREFIX = "diloco_rank"  # replica r > 0's own model + inner optimizer: diloco_rank<r>
LAYOUT_PREFIX = "diloco_layout_"  # diloco_layout_<replicas>x<dp_shard>x<tp>


def replica_key(replica: int) -> str:
    return APP_KEY if replica == 0 else f"{REPLICA_PREFIX}{replica}"


def layout_key(replicas: int, shards: int, tp: int) -> str:
    return f"{LAYOUT_PREFIX}{replicas}x{shards}x{tp}"


def replica_states(states: dict, replica: int) -> dict:
    """`states` (the trainer's Stateful dict) with this replica's model + inner optimizer under its
    own key, so every replica saves and loads its own (replica 0 keeps `app`)."""
    return {replica_key(replica) if name == APP_KEY else name: value for name, value in states.items()}


def check_resume(saved_names: set[str], replicas: int, where: str, shards: int = 1, tp: int = 1) -> None:
    """One line unless the checkpoint (its top-level state names) holds DiLoCo state for exactly
    `replicas` replicas, each split dp_shard=`shards` x tp=`tp` (a checkpoint without a layout entry
    was saved by whole replicas)."""
    if "diloco" not in saved_names:
        raise KilnError(f"{where} was saved without DiLoCo; a DiLoCo run (parallel.diloco_inner_steps > 0) "
                        f"continues only a DiLoCo checkpoint: set parallel.diloco_inner_steps=0 or start a "
                        f"new --run-dir")
    others = {int(n[len(REPLICA_PREFIX):]) for n in saved_names
              if n.startswith(REPLICA_PREFIX) and n[len(REPLICA_PREFIX):].isdigit()}
    saved = 1 + max(others, default=0)
    if saved != replicas or others != set(range(1, replicas)):
        raise KilnError(f"{where} holds {saved} DiLoCo replicas' state, this run has {replicas}; each replica "
                        f"resumes its own model and inner optimizer, so DiLoCo continues with {saved} "
                        f"replicas (or continue without DiLoCo from replica 0's state: "
                        f"parallel.diloco_inner_steps=0)")
    layouts = sorted(n for n in saved_names if n.startswith(LAYOUT_PREFIX))
    saved_layout = layouts[0] if layouts else layout_key(saved, 1, 1)
    if layouts[1:] or saved_layout != layout_key(replicas, shards, tp):
        split = saved_layout[len(LAYOUT_PREFIX):].split("x")
        inside = f"dp_shard={split[1]} x tp={split[2]}" if len(split) == 3 else saved_layout
        raise KilnError(f"{where} holds DiLoCo replicas split {inside}, this run's are dp_shard={shards} x "
                        f"tp={tp}; DiLoCo resumes each replica's shards on the same layout: set parallel."
                        f"dp_shard and parallel.tp as saved (or continue without DiLoCo from replica 0's "
                        f"state: parallel.diloco_inner_steps=0)")


class Layout:
    """Stateful: the replica layout, saved under its `layout_key` so `check_resume` reads it from
    the checkpoint's names before anything loads (the tensor double-checks it at load)."""

    def __init__(self, replicas: int, shards: int, tp: int):
        self.value = torch.tensor([replicas, shards, tp])

    def state_dict(self) -> dict:
        return {"replicas_shards_tp": self.value}

    def load_state_dict(self, state: dict) -> None:
        saved = state["replicas_shards_tp"]
        if not torch.equal(saved, self.value):
            raise KilnError(f"checkpoint DiLoCo layout (replicas, dp_shard, tp) = {saved.tolist()} differs from "
                            f"this run's {self.value.tolist()}")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself when it is not one)."""
    return t.to_local() if isinstance(t, DTensor) else t


class DiLoCo:
    """`group`: the ranks holding the same shard in the other replicas (the dp_replicate group);
    None = the default group when one is initialized (every rank a whole replica)."""

    def __init__(self, model: nn.Module, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group=None):
        if inner_steps < 1:
            raise ValueError(f"DiLoCo needs inner_steps >= 1, got {inner_steps}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_steps, self.group = inner_steps, group
        # The anchor is fp32 whatever the parameters' dtype (the outer step adds small deltas to it)
        # and holds this rank's shards only.
        with torch.no_grad():
            self.anchor = [local(p).detach().clone().float() for p in self.params]
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
        """Average the replicas (this rank's shards), take the outer Nesterov step, reset every
        replica to the result. Returns the bytes this rank contributed to the all-reduce."""
        flat = torch.cat([local(p).detach().float().reshape(-1) for p in self.params])
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
            local(p).copy_(anchor)
        self.outer_steps += 1
        return flat.numel() * flat.element_size() if world > 1 else 0

    def _like_param(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (this rank's shard) as a DTensor sharded like parameter `p`, sharing its storage, so
        DCP saves each shard once and loads into it in place."""
        if not isinstance(p, DTensor):
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    # Stateful, for the checkpoint: the anchor and the outer momentum (equal across replicas,
    # sharded like the parameters), as a flat dict of tensors that DCP saves and loads in place.
    def state_dict(self) -> dict:
        state = {f"anchor.{i}": self._like_param(a, p) for i, (a, p) in enumerate(zip(self.anchor, self.params))}
        state.update({f"momentum.{i}": self._like_param(self.outer.state[a]["momentum_buffer"], p)
                      for i, (a, p) in enumerate(zip(self.anchor, self.params))})
        state["outer_steps"] = torch.tensor(self.outer_steps)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for i, a in enumerate(self.anchor):
            a.copy_(local(state[f"anchor.{i}"]))
            self.outer.state[a]["momentum_buffer"].copy_(local(state[f"momentum.{i}"]))
        self.outer_steps = int(state["outer_steps"])
