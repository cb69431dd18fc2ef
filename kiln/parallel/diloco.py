"""DiLoCo / local SGD for weakly connected clusters (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", algorithm 1).

The replicas are the `dp_replicate` ranks of the mesh. Each replica trains alone with its own inner
optimizer (kiln's configured one, AdamW in the paper) on its own slice of the data; inside a
replica the model may be split any way kiln splits one: FSDP2 over `dp_shard` (dp_mode
fsdp/zero2) or DDP / ZeRO-1 over them (ddp/zero1), tensor parallelism over `tp`, pipeline stages over `pp`, context parallelism over
`cp` and expert parallelism carved out of the replica's own ranks (dims.py `diloco_layout`).
Gradients are reduced inside a replica only (`ParallelDims.grad_mesh_names` leaves dp_replicate
out: never HSDP; the expert mesh keeps the replicas apart as well). Every H =
`parallel.diloco_inner_steps` steps the replicas meet once:

    delta   = anchor - mean over replicas(params)        # the outer "pseudo-gradient"
    anchor  = outer Nesterov SGD step on anchor with gradient delta   (lr 0.7, momentum 0.9)
    params  = anchor                                      # every replica restarts from it

where `anchor` holds the parameters of the last sync. Every rank works on its own shards only (the
DTensor local tensors): it averages them with the ranks holding the same shard in the other
replicas (the dp_replicate group) and steps its shard of the anchor, so the anchor and the outer
momentum are sharded like the parameters, and nothing crosses replicas between outer steps (the
torchft `DiLoCo` layout: one replica per island, FSDP/TP inside). Where several ranks of a
replica hold the very same parameters (DDP / ZeRO-1 over its dp_shard x cp ranks, `inside`),
each keeps only its 1/S slice of the anchor and outer momentum (8/S bytes per parameter, not 8),
averages that slice across the replicas and steps it, and they all-gather the new anchor. Under pp a rank holds its
stages' parameters only, and averages those with the same stage's ranks in the other replicas;
a tied head copy (pipeline_tied.py) is averaged like the embedding it copies, from equal values in
every replica, so the two stay equal. Parameters replicated inside a replica (over cp, or dense
ones over ep) are equal on those ranks before the outer step and get the same average, so they
stay equal after it. `outer_step` returns the bytes
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
sharded like the parameters (split `inside` a replica: each rank saves its slice's boxes of
each parameter, kiln/parallel/zero1_shards.py, nothing gathered), and stored once; under pp they are keyed by parameter name (every
stage holds other parameters), else by position. A `diloco_layout_<R>x<S>x<T>[_pp<P>][_cp<C>]
[_ep<E>][_etp1]` entry records the replica count and the split inside each (dp_shard x tp, and
pp, cp, ep where > 1, etp1 where ep borrows tp); a DiLoCo run continues only a checkpoint of the
same layout (`check_resume`, one line otherwise): a replica without its own state would train on
another's moments, and the anchor's keys and shards follow the split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln import torch_compat
from kiln.errors import KilnError
from kiln.parallel import zero1_shards
from kiln.parallel.zero1_shards import is_sharded, largest_local_numel, param_boxes

APP_KEY = "app"  # the model + optimizer entry of kiln's checkpoint (kiln/train/trainer.py)
REPLICA_PREFIX = "diloco_rank"  # replica r > 0's own model + inner optimizer: diloco_rank<r>
LAYOUT_PREFIX = "diloco_layout_"  # diloco_layout_<replicas>x<dp_shard>x<tp>[_pp<P>][_cp<C>][_ep<E>][_etp1]
SPLITS = ("pp", "cp", "ep")  # the dimensions inside a replica beyond dp_shard x tp, in the key when > 1


def replica_key(replica: int) -> str:
    return APP_KEY if replica == 0 else f"{REPLICA_PREFIX}{replica}"


def layout_key(replicas: int, shards: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1,
               ep_borrows_tp: bool = False, replicated: bool = False) -> str:
    """A layout without pp, cp and ep keeps the key kiln wrote before those ran under DiLoCo.
    `replicated`: the `shards` ranks of a replica run DDP or ZeRO-1 (whole parameters) rather than
    FSDP (`_ddp`)."""
    extra = "".join(f"_{name}{size}" for name, size in zip(SPLITS, (pp, cp, ep)) if size > 1)
    return (f"{LAYOUT_PREFIX}{replicas}x{shards}x{tp}{extra}{'_etp1' if ep_borrows_tp else ''}"
            f"{'_ddp' if replicated else ''}")


def describe_layout(key: str) -> str:
    """'dp_shard=S x tp=T[ x pp=P ...]' of a layout key (the key itself when it is not kiln's)."""
    body = key[len(LAYOUT_PREFIX):].split("_")
    split = body[0].split("x")
    if len(split) != 3:
        return key
    parts = [f"dp_shard={split[1]}", f"tp={split[2]}"]
    for extra in body[1:]:
        if extra == "ddp":
            parts[0] += " (ddp/zero1)"
            continue
        name = next((n for n in (*SPLITS, "etp") if extra.startswith(n) and extra[len(n):].isdigit()), None)
        if name is None:
            return key
        parts.append(f"{name}={extra[len(name):]}")
    return " x ".join(parts)


def replica_states(states: dict, replica: int) -> dict:
    """`states` (the trainer's Stateful dict) with this replica's model + inner optimizer under its
    own key, so every replica saves and loads its own (replica 0 keeps `app`)."""
    return {replica_key(replica) if name == APP_KEY else name: value for name, value in states.items()}


def check_resume(saved_names: set[str], replicas: int, where: str, shards: int = 1, tp: int = 1,
                 **split) -> None:
    """One line unless the checkpoint (its top-level state names) holds DiLoCo state for exactly
    `replicas` replicas, each split dp_shard=`shards` x tp=`tp` x `split` (layout_key's pp, cp, ep,
    ep_borrows_tp, replicated; a checkpoint without a layout entry was saved by whole replicas)."""
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
    mine = layout_key(replicas, shards, tp, **split)
    if layouts[1:] or saved_layout != mine:
        raise KilnError(f"{where} holds DiLoCo replicas split {describe_layout(saved_layout)}, this run's are "
                        f"{describe_layout(mine)}; DiLoCo resumes each replica's shards on the same layout: set "
                        f"parallel.dp_mode, dp_shard, tp, pp, cp, ep and etp as saved (or continue without DiLoCo from "
                        f"replica 0's state: parallel.diloco_inner_steps=0)")


class Layout:
    """Stateful: the replica layout, saved under its `layout_key` so `check_resume` reads it from
    the checkpoint's names before anything loads (the tensor double-checks it at load)."""

    def __init__(self, replicas: int, shards: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1,
                 ep_borrows_tp: bool = False, replicated: bool = False):
        self.value = torch.tensor([replicas, shards, tp])
        # Only where a replica has more in it: the checkpoints of kiln before pp/cp/ep keep loading.
        more = [pp, cp, ep, int(ep_borrows_tp)]
        self.split = torch.tensor(more) if more != [1, 1, 1, 0] else None
        self.replicated = torch.tensor([1]) if replicated else None  # DDP / ZeRO-1 over the shards

    def state_dict(self) -> dict:
        state = {"replicas_shards_tp": self.value}
        if self.split is not None:
            state["pp_cp_ep_etp1"] = self.split
        if self.replicated is not None:
            state["ddp_inside"] = self.replicated
        return state

    def load_state_dict(self, state: dict) -> None:
        for name, mine in self.state_dict().items():
            if not torch.equal(state[name], mine):
                raise KilnError(f"checkpoint DiLoCo layout ({name.replace('_', ', ')}) = {state[name].tolist()} "
                                f"differs from this run's {mine.tolist()}")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself when it is not one)."""
    return t.to_local() if isinstance(t, DTensor) else t


def replicated_group(dims):
    """The ranks inside one replica that hold the very same parameters (DDP or ZeRO-1 over its
    dp_shard x cp ranks, without ep, whose experts differ between them), which split the outer
    average between them (`DiLoCo`'s `inside`); None where each rank of a replica holds its own."""
    if dims.dp_mode not in ("ddp", "zero1") or dims.grad_ranks == 1 or dims.ep > 1:
        return None
    from kiln.parallel.data_parallel import grad_mesh

    return grad_mesh(dims).get_group()


class DiLoCo:
    """`group`: the ranks holding the same shard in the other replicas (the dp_replicate group);
    None = the default group when one is initialized (every rank a whole replica). `inside`: the
    ranks of this rank's replica holding the very same parameters (`replicated_group`), or None:
    each of them keeps, averages (across the replicas) and steps 1/S of the flat anchor, and they
    all-gather the new anchor inside the replica (fast links), so the slow link between replicas
    carries each parameter once per replica, as under FSDP, not S times, and the outer state is
    split like ZeRO-1's. `by_name`: the checkpoint keys the
    anchor by parameter name, not position (pp: each stage's ranks hold other parameters, so
    position i names another tensor on every stage)."""

    def __init__(self, model: nn.Module, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group=None, by_name: bool = False, inside=None):
        if inner_steps < 1:
            raise ValueError(f"DiLoCo needs inner_steps >= 1, got {inner_steps}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # The names a checkpoint of the model uses: without the wrappers that activation
        # checkpointing and per-block compile put around blocks (as DCP's get_state_dict drops them).
        self.keys = [n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") if by_name else str(i)
                     for i, (n, _) in enumerate(named)]
        self.inner_steps, self.group = inner_steps, group
        self.inside = inside if inside is not None and dist.get_world_size(inside) > 1 else None
        # The anchor is fp32 whatever the parameters' dtype (the outer step adds small deltas to it).
        # It holds this rank's shards only, and with `inside` only this rank's 1/S slice of their
        # flat concatenation (padded to S equal slices), as does the outer momentum. In that flat
        # vector each parameter takes its largest tp shard's size (zero-padded where its shard is
        # smaller), so every tp coordinate slices alike and a checkpoint's boxes of a tensor
        # replicated over tp coincide (zero1_shards.largest_local_numel).
        sizes = [largest_local_numel(p) if self.inside is not None else local(p).numel() for p in self.params]
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        with torch.no_grad():
            if self.inside is None:
                self.anchor = [local(p).detach().clone().float() for p in self.params]
            else:
                zero1_shards.require("DiLoCo with parallel.dp_mode='ddp' or 'zero1' inside a replica")
                split, me = dist.get_world_size(self.inside), dist.get_rank(self.inside)
                self.slice = -(-self.numel // split)
                self.anchor = [self._flat().view(split, -1)[me].clone()]
                # per parameter: the runs of its local elements each rank's slice holds, and their boxes
                self._runs = [[(max(a, r * self.slice) - a, min(a + local(p).numel(), (r + 1) * self.slice) - a, r)
                               for r in range(split)
                               if max(a, r * self.slice) < min(a + local(p).numel(), (r + 1) * self.slice)]
                              for p, a in zip(self.params, self.starts)]
                self._boxes = [param_boxes(p, runs, self.inside) for p, runs in zip(self.params, self._runs)]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        # A zero momentum buffer steps exactly like torch's lazily created one (buf = g at the first
        # step) and exists before the first sync, so a checkpoint can load into it.
        for a in self.anchor:
            self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        self.outer_steps = 0

    def _flat(self) -> torch.Tensor:
        """This rank's parameter shards as one fp32 vector, zero-padded to S equal slices with `inside`."""
        if self.inside is None:
            return torch.cat([local(p).detach().float().reshape(-1) for p in self.params])
        padded = torch.zeros(self.slice * dist.get_world_size(self.inside), device=self.params[0].device)
        for p, start in zip(self.params, self.starts):
            values = local(p).detach().reshape(-1)
            padded[start:start + values.numel()] = values
        return padded

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole flat vector from every rank's slice `piece` (all-gather inside the replica)."""
        whole = piece.new_empty(self.slice * dist.get_world_size(self.inside))
        torch_compat.all_gather_single(whole, piece.contiguous(), group=self.inside)
        return whole

    def due(self, step: int) -> bool:
        """True after inner step `step` (1-based) when an outer step follows."""
        return step % self.inner_steps == 0

    @torch.no_grad()
    def outer_step(self) -> int:
        """Average the replicas (this rank's shards), take the outer Nesterov step, reset every
        replica to the result. With `inside`, each rank averages and steps its 1/S slice, and the
        replica's ranks all-gather the new anchor. Returns the bytes this rank contributed to the
        all-reduce across the replicas (the all-gather inside the replica not counted)."""
        flat = self._flat()
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.group)
        mine = flat if self.inside is None else flat.view(dist.get_world_size(self.inside), -1)[
            dist.get_rank(self.inside)].clone()
        if world > 1:
            dist.all_reduce(mine, group=self.group)  # gloo has no AVG: sum, then divide
            mine.div_(world)
        offset = 0
        for anchor in self.anchor:  # with `inside` one slice, its padding 0 on both sides
            n = anchor.numel()
            anchor.grad = anchor - mine[offset:offset + n].view_as(anchor)
            offset += n
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self._reset_params()
        self.outer_steps += 1
        return mine.numel() * mine.element_size() if world > 1 else 0

    def _reset_params(self) -> None:
        whole = self._full(self.anchor)
        for anchor, p in zip(whole, self.params):
            local(p).copy_(anchor)

    def _full(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter tensors (this rank's shards) of the anchor `tensors`: themselves, or with
        `inside` views of the slices all-gathered inside the replica."""
        if self.inside is None:
            return tensors
        whole = self._gather(tensors[0])
        return [whole[start:start + local(p).numel()].view_as(local(p)) for p, start in zip(self.params, self.starts)]

    def _own_runs(self, i: int, flat_slice: torch.Tensor) -> list[torch.Tensor]:
        """Views of parameter i's runs in this rank's slice `flat_slice` (of the anchor or momentum)."""
        base = dist.get_rank(self.inside) * self.slice - self.starts[i]
        return [flat_slice[a - base:b - base] for a, b, r in self._runs[i] if r == dist.get_rank(self.inside)]

    def _like_param(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (this rank's shard) as a DTensor sharded like parameter `p`, sharing its storage, so
        DCP saves each shard once and loads into it in place."""
        if not isinstance(p, DTensor):
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    # Stateful, for the checkpoint: the anchor and the outer momentum (equal across replicas,
    # sharded like the parameters), as a flat dict of tensors that DCP saves and loads in place.
    # With `inside` each rank gives its slice's boxes of each parameter (zero1_shards.py, views:
    # nothing gathered), only for the parameters its slice holds elements of.
    def state_dict(self) -> dict:
        momentum = [self.outer.state[a]["momentum_buffer"] for a in self.anchor]
        if self.inside is None:
            state = {f"anchor.{k}": self._like_param(a, p) for k, a, p in zip(self.keys, self.anchor, self.params)}
            state.update({f"momentum.{k}": self._like_param(m, p) for k, m, p in zip(self.keys, momentum, self.params)})
        else:
            state = {}
            for i, k in enumerate(self.keys):
                for name, flat_slice in (("anchor", self.anchor[0]), ("momentum", momentum[0])):
                    runs = self._own_runs(i, flat_slice)
                    if runs:
                        state[f"{name}.{k}"] = self._boxes[i].sharded(runs)
        state["outer_steps"] = torch.tensor(self.outer_steps)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, mine in (("anchor", self.anchor), ("momentum", [self.outer.state[a]["momentum_buffer"]
                                                                  for a in self.anchor])):
            if self.inside is None:
                for dst, k in zip(mine, self.keys):
                    dst.copy_(local(state[f"{name}.{k}"]))
                continue
            for i, k in enumerate(self.keys):  # this slice's runs: from the boxes DCP filled, or a whole tensor
                value = state.get(f"{name}.{k}")
                if value is None:
                    continue  # no element of it in this rank's slice
                own = [(a, b) for a, b, r in self._runs[i] if r == dist.get_rank(self.inside)]
                runs = (self._boxes[i].runs_of(value, f"{name}.{k}") if is_sharded(value)
                        else [local(value).reshape(-1)[a:b] for a, b in own])
                for dst, src in zip(self._own_runs(i, mine[0]), runs):
                    dst.copy_(src)
        self.outer_steps = int(state["outer_steps"])
