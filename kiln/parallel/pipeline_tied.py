"""Tied embeddings under pipeline parallelism, the Megatron-LM way.

The token embedding lives on the first stage and the LM head, which shares its weight in one
process, on the last. As Megatron-LM does (a copy of the word embeddings on the last stage, the
all-reduce of the two gradients over its "embedding group" in `finalize_model_grads`, and the copy
marked shared so the grad norm skips it), the last stage holds its own copy of the weight as the
head:

- init: the copy gets the values the embedding gets, from the same generator draw
  (`PipelineModel.init_weights`), so both start bit-identical to the one-process tied weight;
- every step, after the schedule's backward and before clipping and the optimizer, the two
  gradients are summed (`TiedEmbeddings.sum_grads`): one process's tied weight receives the head's
  and the embedding's gradient in one tensor. Over a 2-rank process group (first stage's rank,
  last stage's rank) per pipeline, that is per data-parallel replica / shard, cp and tp
  coordinate, since every other mesh dimension is the same for both ranks of a pair; where one
  rank holds both stages (ZBV puts stage 0 and the last stage on pp rank 0) the sum is local.
  Under FSDP (fsdp/zero2) both copies are sharded the same way over the same data-parallel
  coordinates, so each pair sums matching shards of the already dp-reduced gradient; under
  ddp/zero1 each copy's gradient is already the dp average; under tp both are Shard(0) over
  the vocabulary, so each tp coordinate's pair sums its vocab shard. Both copies then take the
  same optimizer update and stay identical;
- clipping counts the weight once (kiln/train/pipeline_step.py `clip_grad_norm_counting_once`):
  the copy is left out of the
  norm and clipped with the coefficient of the rest, as its gradient equals the embedding's.

Checkpoints (kiln/checkpoint/manager.py `ModelOptimizerState`): the model state holds the weight
under both names, `tok_embeddings.weight` (first stage) and `output.weight` (the copy, last stage),
exactly as one process's tied model does; the optimizer state, which one process keeps under
`tok_embeddings.weight` only, is saved under that name by both stages (the same values: DCP writes
them once) and the copy takes it back from there on load (`optimizer_state_aliases`). So a pp
checkpoint loads into one process and back.

What is torch's: the process groups (`new_subgroups_by_enumeration`), the all-reduce, DTensor's
local shards, `clip_grads_with_norm_`. What is kiln's: which ranks pair up, the copy and its init.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


def head_copy(full: nn.Module) -> nn.Linear:
    """The last stage's own head for a tied model: a new Linear (on the whole model's device,
    meta), not the whole model's `output`, which stays tied (so counting the whole model's
    parameters counts the weight once)."""
    w = full.output.weight
    return nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds (a DTensor's shard; under no_grad, no copy)."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


def _grad_laid_out_as_param(p: torch.Tensor) -> torch.Tensor:
    """p.grad with p's placements: under tp the embedding's gradient comes back Replicate (the
    whole table on every tp rank) while its weight is Shard(0) like the head copy's; DTensor's
    redistribute keeps this rank's rows (no communication), so both copies add matching shards."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)
    return p.grad


def _pair_groups(dims, last_pp_rank: int):
    """This rank's (first stage, last stage) process group, or None. Every rank must call this
    (new_group is collective), in the same order: one pair per pipeline, from the mesh."""
    mesh = dims.mesh
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, dims.pp)
    pairs = [[int(row[0]), int(row[last_pp_rank])] for row in ranks]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


class TiedEmbeddings:
    """The tie between the first stage's embedding and the last stage's head copy, on one rank."""

    def __init__(self, model, dims, last_pp_rank: int):
        self.model = model
        self.group = _pair_groups(dims, last_pp_rank) if last_pp_rank != 0 else None

    def _embedding(self):
        return self.model.tok_embeddings.weight if self.model.has_first else None

    def copies(self) -> list[torch.Tensor]:
        """The parameters that repeat another one (the head copy, on the last stage's rank)."""
        return self.model.tied_embedding_copies()

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each copy's gradient becomes the sum of both (see the module docstring)."""
        held = [p for p in (self._embedding(), *self.copies()) if p is not None]
        if any(p.grad is None for p in held):
            raise RuntimeError(f"pipeline stages {self.model.stage_ids}: the tied embedding got no gradient")
        grads = [_local(_grad_laid_out_as_param(p)) for p in held]
        if len(grads) == 2:  # both on this rank (ZBV's rank 0)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:  # one of the two: summed with the pair's other rank (a middle stage holds neither)
            dist.all_reduce(grads[0], op=dist.ReduceOp.SUM, group=self.group)


def optimizer_state_for_save(optim_sd: dict, aliases: dict[str, str]) -> dict:
    """DCP's FQN-keyed optimizer state with each copy's entry under the name of the parameter it
    copies (the name one process saves); dropped where that parameter is on this rank too."""
    if not aliases or not isinstance(optim_sd.get("state"), dict):
        return optim_sd
    state = dict(optim_sd["state"])
    for own, saved in aliases.items():
        if own in state:
            value = state.pop(own)
            state.setdefault(saved, value)
    groups = [{**g, "params": list(dict.fromkeys(aliases.get(n, n) for n in g["params"]))}
              if isinstance(g, dict) and isinstance(g.get("params"), list) else g
              for g in optim_sd.get("param_groups", [])]
    return {**optim_sd, "state": state, "param_groups": groups}


def optimizer_state_for_load(optim_sd: dict, aliases: dict[str, str]) -> dict:
    """The inverse of optimizer_state_for_save on a loaded state: each copy takes (a copy of) the
    saved entry of the parameter it copies. The param groups' names are the caller's business
    (ModelOptimizerState puts this rank's own names there)."""
    state = optim_sd.get("state")
    if not aliases or not isinstance(state, dict):
        return optim_sd
    state = dict(state)
    for own, saved in aliases.items():
        if saved in state and isinstance(state[saved], dict):
            # a copy per parameter: two parameters must never step the same moment tensors
            state[own] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[saved].items()}
    return {**optim_sd, "state": state}
