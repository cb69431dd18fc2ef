"""Muon's Newton-Schulz over sharded matrices, each matrix orthogonalized on one rank.

Newton-Schulz needs a whole matrix. A matrix sharded over N ranks (FSDP2's dp_shard, tensor
parallel's tp: one mesh dimension cutting it) used to be gathered whole on every rank, so all N
ranks ran the same iteration: the optimizer's compute did not shrink with the ranks, and every rank
received (N-1)/N of every matrix. Here each matrix has one owner among the N ranks (the matrices
dealt out by cost, largest first, to the least loaded rank): one all-to-all brings every shard of a
matrix to its owner, the owner orthogonalizes it, and a second all-to-all returns each rank its
shard of the result. Per rank that is 1/N of the iterations and about 2/N of what the gathers
received (the distributed Muon of Moonlight, Liu et al. 2025; kiln's own over torch's
`all_to_all_single`).

What is split where:
- a matrix no placement cuts (Replicate only; an expert stack cut over its experts only) is
  orthogonalized where it is, with no exchange;
- one mesh dimension cutting it (`Shard`): split over that dimension's ranks as above; the ranks of
  the other dimensions (replicas) each run their own share alike;
- two mesh dimensions cutting one matrix (FSDP2 over tensor parallel: `_StridedShard` or a
  second `Shard`): gathered over all but the widest plain `Shard` dimension (DTensor's
  `redistribute`, the all-gathers FSDP's forward does), then split over that one as above, and
  the result cut back to the original placements (a local slice);
- anything else (a `Partial`, a layout this torch's DTensor cannot redistribute): gathered whole on
  every rank (`full_tensor`), as before;
- plain tensors that every rank of a `replicas` group holds alike (DDP's): each orthogonalized on
  one of them and broadcast from there (modded-nanogpt's distributed Muon).

`stacked`: each tensor is a stack (E, in, out) of per-expert matrices used as `x @ w[e]` (kiln's
GroupedExperts): each expert's matrix is orthogonalized on its own, and a cut over dim 0 (expert
parallelism, FSDP over experts) leaves whole matrices on each rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from kiln import torch_compat
from kiln.train.optimizers.newton_schulz import orthogonalize_matrix

# Whole matrices one rank orthogonalizes per exchange round (`_rounds`); fp32 bytes
ROUND_BYTES = 2**29


def orthogonalize_updates(updates: list[torch.Tensor], stacked: bool | list[bool] = False,
                          replicas=None) -> list[torch.Tensor]:
    """Each update orthogonalized whole (as `orthogonalize_matrix` of its full tensor), returned
    with the update's own type and sharding; sharded ones split over their ranks (module doc);
    plain ones dealt over `replicas` (a process group whose ranks hold them alike: DDP's) where
    given, each orthogonalized on one of them and broadcast from there. `stacked` per update (or
    one for all): Muon passes all its groups' updates in one call, so matrices and expert stacks
    are dealt out together (one exchange, one balance)."""
    flags = [stacked] * len(updates) if isinstance(stacked, bool) else list(stacked)
    out: list[torch.Tensor | None] = [None] * len(updates)
    work = list(updates)  # what is split: the update, or it gathered down to one cut
    splits: dict[tuple, list[int]] = {}
    plain = [i for i, u in enumerate(updates) if not isinstance(u, DTensor)]
    if plain and replicas is not None and dist.get_world_size(replicas) > 1:
        dealt = _deal_over_replicas([updates[i] for i in plain], [flags[i] for i in plain], replicas)
        for i, result in zip(plain, dealt):
            out[i] = result
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            if out[i] is None:
                out[i] = orthogonalize_matrix(u, flags[i])
            continue
        cut = _cut(u, flags[i])
        if cut == "gather" and (narrowed := _to_one_cut(u, flags[i])) is not None:
            work[i], cut = narrowed
        if cut is None:
            out[i] = _like(u, orthogonalize_matrix(u.to_local(), flags[i]))
        elif cut == "gather":
            full = orthogonalize_matrix(u.full_tensor(), flags[i])
            # src_data_rank=None: slice locally instead of scattering from rank 0 (where torch has it)
            out[i] = torch_compat.distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)
        else:
            # keyed by the process group, not the mesh: FSDP2 gives each module's parameters a mesh
            # object of its own over the same ranks (one exchange per module was 4x the calls)
            splits.setdefault((work[i].device_mesh.get_group(cut[0]), u.dtype), []).append(i)
    for (group, _), indices in splits.items():
        pieces = [_cut(work[i], flags[i]) for i in indices]
        results = _split_over_ranks([work[i] for i in indices], [dim for _, dim in pieces], group,
                                    [flags[i] for i in indices])
        for i, local in zip(indices, results):
            out[i] = _like(work[i], local)
            if work[i] is not updates[i]:  # back to the update's own cut: a local slice
                out[i] = out[i].redistribute(updates[i].device_mesh, updates[i].placements)
    return out


def _redistribute(u: DTensor, placements: list) -> DTensor:
    return u.redistribute(u.device_mesh, placements)


def _like(u: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local, u.device_mesh, u.placements, shape=u.shape, stride=u.stride())


def _cutting(u: DTensor, stacked: bool) -> list[tuple[int, object]] | None:
    """(mesh dim, placement) of each mesh dimension that cuts a matrix (a stack's experts are
    whole matrices: a cut of its dim 0 is none); None where a placement is not a shard (Partial)."""
    cuts = []
    for mesh_dim, p in enumerate(u.placements):
        if isinstance(p, Replicate) or u.device_mesh.size(mesh_dim) == 1:
            continue
        # FSDP2 over tp's `_StridedShard`: a Shard subclass up to torch 2.12, its own class since
        if not (isinstance(p, Shard) or hasattr(p, "split_factor")):
            return None
        if not (stacked and p.dim == 0):
            cuts.append((mesh_dim, p))
    return cuts


def _cut(u: DTensor, stacked: bool):
    """None (no placement cuts a matrix), (mesh dim, tensor dim) where exactly one plain `Shard`
    does, else "gather"."""
    cuts = _cutting(u, stacked)
    if cuts is None:
        return "gather"
    if not cuts:
        return None
    if len(cuts) == 1 and type(cuts[0][1]) is Shard:
        return cuts[0][0], cuts[0][1].dim
    return "gather"


def _to_one_cut(u: DTensor, stacked: bool):
    """(u gathered over every cutting mesh dim but the widest plain `Shard` one, its cut), or None
    where there is none or this torch's DTensor cannot redistribute so."""
    cuts = _cutting(u, stacked)
    plain = [(u.device_mesh.size(d), d) for d, p in cuts or () if type(p) is Shard]
    if not plain:
        return None
    keep = max(plain)[1]
    cutting = {d for d, _ in cuts}
    target = [Replicate() if d in cutting and d != keep else p for d, p in enumerate(u.placements)]
    try:
        narrowed = _redistribute(u, target)
    except (NotImplementedError, RuntimeError, ValueError, AssertionError):  # alike on every rank
        return None  # DTensor plans a redistribution before any collective: every rank gathers instead
    cut = _cut(narrowed, stacked)
    return (narrowed, cut) if isinstance(cut, tuple) else None


def chunk_sizes(length: int, parts: int) -> list[int]:
    """The sizes `Shard` gives `parts` ranks along a dimension of `length`: torch.chunk's
    (ceil(length / parts) each until it runs out), empty shards at the end."""
    step = -(-length // parts) if length else 0
    return [max(0, min(step, length - r * step)) for r in range(parts)]


def _split_over_ranks(updates: list[DTensor], dims: list[int], group, stacked: list[bool]) -> list[torch.Tensor]:
    """This rank's shard of each update orthogonalized whole, every matrix on its owner (the
    ranks of `group`, which cuts each update's tensor dim in `dims`)."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    # The matrices: per update its expert matrices (stacked: each expert one, dim 0 whole here)
    # or itself; each with the tensor dim the ranks cut (shifted into the expert's matrix).
    items = []  # (update index, expert index or None, cut dim within the item, item's global shape)
    for k, (u, dim, is_stack) in enumerate(zip(updates, dims, stacked)):
        local = u.to_local()
        full_len = u.shape[dim]
        sizes = chunk_sizes(full_len, ranks)
        if local.size(dim) != sizes[me]:  # torch's Shard has cut otherwise than torch.chunk does
            raise RuntimeError(f"Muon: a shard of {tuple(u.shape)} holds {local.size(dim)} of dim {dim} on rank "
                               f"{me} of {ranks}; expected {sizes[me]} (torch.chunk's sizes {sizes})")
        if is_stack:
            shape = list(u.shape[1:])
            items += [(k, e, dim - 1, shape) for e in range(local.size(0))]
        else:
            items.append((k, None, dim, list(u.shape)))
    owner = _deal(items, ranks)
    locals_ = [u.to_local() for u in updates]
    outs: list[torch.Tensor | None] = [None if is_stack else t for t, is_stack in zip(locals_, stacked)]
    for batch in _rounds(items, owner, ranks, locals_[0].element_size()):
        _exchange_round(batch, items, owner, locals_, outs, group, ranks, me)
    return outs


def _numel_on(item, rank: int, ranks: int) -> int:
    """Elements of `item`'s shard on `rank`."""
    _, _, dim, shape = item
    rest = 1
    for i, s in enumerate(shape):
        rest *= s if i != dim else 1
    return rest * chunk_sizes(shape[dim], ranks)[rank]


def _rounds(items: list, owner: list[int], ranks: int, itemsize: int) -> list[list[int]]:
    """The matrices in rounds, largest first, each holding at most ROUND_BYTES of whole matrices
    on any one owner (a larger matrix alone): what a rank holds at once stays bounded (its whole
    matrices, the shards sent and received, the results) instead of growing with the model."""
    order = sorted(range(len(items)), key=lambda n: (-_numel_on(items[n], 0, 1), n))
    rounds: list[list[int]] = [[]]
    load = [0] * ranks
    for n in order:
        size = _numel_on(items[n], 0, 1) * itemsize
        if rounds[-1] and load[owner[n]] + size > ROUND_BYTES:
            rounds.append([])
            load = [0] * ranks
        rounds[-1].append(n)
        load[owner[n]] += size
    return rounds


def _exchange_round(batch: list[int], items: list, owner: list[int], locals_: list[torch.Tensor],
                    outs: list, group, ranks: int, me: int) -> None:
    """One round: every shard of `batch`'s matrices to its owner, each orthogonalized there (an
    expert's matrix as a stack's, `items`' expert index set), each rank's shard of the results back
    into `outs`."""
    def piece_of(item) -> torch.Tensor:
        k, e, _, _ = item
        return locals_[k] if e is None else locals_[k][e]

    dtype, device = locals_[0].dtype, locals_[0].device
    batch = sorted(batch)  # the same order on every rank, sender and receiver alike
    # 1. every shard to its matrix's owner
    send = [[piece_of(items[n]).reshape(-1) for n in batch if owner[n] == r] for r in range(ranks)]
    mine = [n for n in batch if owner[n] == me]
    recv_sizes = [sum(_numel_on(items[n], s, ranks) for n in mine) for s in range(ranks)]
    received = _all_to_all(send, recv_sizes, group, dtype, device)
    results = {}
    offsets = [0] * ranks
    for n in mine:
        _, _, dim, shape = items[n]
        sizes = chunk_sizes(shape[dim], ranks)
        parts = []
        for s in range(ranks):
            size = _numel_on(items[n], s, ranks)
            part_shape = [sizes[s] if i == dim else x for i, x in enumerate(shape)]
            parts.append(received[s][offsets[s]:offsets[s] + size].view(part_shape))
            offsets[s] += size
        results[n] = orthogonalize_matrix(torch.cat(parts, dim=dim), items[n][1] is not None)
    del received
    # 2. each rank its shard of every result
    send = []
    for s in range(ranks):
        row = []
        for n in mine:
            _, _, dim, shape = items[n]
            sizes = chunk_sizes(shape[dim], ranks)
            row.append(results[n].narrow(dim, sum(sizes[:s]), sizes[s]).reshape(-1))
        send.append(row)
    recv_sizes = [sum(_numel_on(items[n], me, ranks) for n in batch if owner[n] == r) for r in range(ranks)]
    received = _all_to_all(send, recv_sizes, group, dtype, device)
    offsets = [0] * ranks
    for n in batch:
        k, e, _, _ = items[n]
        size = _numel_on(items[n], me, ranks)
        piece = received[owner[n]][offsets[owner[n]]:offsets[owner[n]] + size]
        offsets[owner[n]] += size
        if e is None:  # a whole local shard: a view of what arrived, no copy
            outs[k] = piece.view(locals_[k].shape)
        else:  # one expert of a stack whose experts came from several owners
            if outs[k] is None:
                outs[k] = torch.empty_like(locals_[k])
            outs[k][e].copy_(piece.view(outs[k][e].shape))


def _deal_over_replicas(tensors: list[torch.Tensor], stacked: list[bool], group) -> list[torch.Tensor]:
    """Whole tensors every rank of `group` holds alike (DDP's): each orthogonalized on one rank
    (dealt by cost, `_deal`), then one broadcast per owner and dtype hands the results to all
    (modded-nanogpt's distributed Muon, on torch's broadcast)."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    # a stack costs its experts' matrices together (it goes to one owner whole)
    owner = _deal_costs([_ns_cost(list(t.shape[1:])) * t.shape[0] if is_stack else _ns_cost(list(t.shape))
                         for t, is_stack in zip(tensors, stacked)], ranks)
    out: list[torch.Tensor | None] = [orthogonalize_matrix(t, is_stack) if o == me else None
                                      for t, o, is_stack in zip(tensors, owner, stacked)]
    for r in range(ranks):
        for dtype in sorted({t.dtype for t, o in zip(tensors, owner) if o == r}, key=str):
            mine = [k for k, (t, o) in enumerate(zip(tensors, owner)) if o == r and t.dtype == dtype]
            if r == me:
                buffer = torch.cat([out[k].reshape(-1) for k in mine])
            else:
                buffer = torch.empty(sum(tensors[k].numel() for k in mine), dtype=dtype, device=tensors[mine[0]].device)
            dist.broadcast(buffer, src=dist.get_global_rank(group, r), group=group)
            offset = 0
            for k in mine:
                out[k] = buffer[offset:offset + tensors[k].numel()].view(tensors[k].shape)
                offset += tensors[k].numel()
    return out


def _ns_cost(shape: list[int]) -> int:
    """Newton-Schulz's cost of one matrix, up to a constant: short side^2 x long side."""
    rows, cols = shape[0], 1
    for s in shape[1:]:
        cols *= s
    short, long_ = min(rows, cols), max(rows, cols)
    return short * short * long_


def _deal(items: list, ranks: int) -> list[int]:
    """Each matrix's owner (`_deal_costs` of their Newton-Schulz costs)."""
    return _deal_costs([_ns_cost(item[3]) for item in items], ranks)


def _deal_costs(costs: list[int], ranks: int) -> list[int]:
    """Owners: largest cost first to the least loaded rank (ties to the lowest rank), in an order
    every rank computes alike."""
    order = sorted(range(len(costs)), key=lambda n: (-costs[n], n))
    load, owner = [0] * ranks, [0] * len(costs)
    for n in order:
        r = min(range(ranks), key=lambda q: (load[q], q))
        owner[n] = r
        load[r] += costs[n]
    return owner


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], group, dtype, device) -> list[torch.Tensor]:
    """One `all_to_all_single`: `send[r]` (flat pieces) to rank r; returns what each rank sent here."""
    pieces = [t for row in send for t in row]
    inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_sizes,
                           input_split_sizes=[sum(t.numel() for t in row) for row in send], group=group)
    return list(out.split(recv_sizes))
