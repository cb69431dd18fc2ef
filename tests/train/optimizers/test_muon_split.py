"""Muon's Newton-Schulz over sharded matrices (kiln/train/optimizers/muon_split.py): each matrix
orthogonalized whole on one of the ranks that shard it, every rank getting its shard of the
result; expert stacks orthogonalized per expert."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import torch_compat
from kiln.train.optimizers import Muon
from kiln.train.optimizers.muon import shape_lr_scale
from kiln.train.optimizers.muon_split import chunk_sizes, orthogonalize_matrix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)


@pytest.mark.parametrize("length, parts", [(12, 4), (5, 4), (3, 4), (0, 2), (7, 3), (1, 1)])
def test_chunk_sizes_are_torch_chunks(length, parts):
    sizes = [len(c) for c in torch.arange(length).chunk(parts)] if length else []
    assert chunk_sizes(length, parts) == sizes + [0] * (parts - len(sizes))


def test_an_expert_stack_is_orthogonalized_and_scaled_per_expert():
    """A stacked group's (E, in, out) tensor steps as E separate (out, in) matrices would."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 4, 10, generator=gen)  # 3 experts, in 4, out 10: scale sqrt(10 / 4)
    stack = nn.Parameter(w0.clone())
    separate = [nn.Parameter(w0[e].T.clone()) for e in range(3)]  # nn.Linear's (out, in)
    opt = Muon([{"params": [stack], "stacked": True}], lr=0.05, momentum=0.9, weight_decay=0.1)
    ref = Muon(separate, lr=0.05, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(3, 4, 10, generator=gen)
        stack.grad = g.clone()
        for e, p in enumerate(separate):
            p.grad = g[e].T.clone()
        opt.step()
        ref.step()
    for e in range(3):
        torch.testing.assert_close(stack[e].detach(), separate[e].detach().T, rtol=1e-5, atol=1e-6)
    assert shape_lr_scale(stack.shape, stacked=True) == pytest.approx(math.sqrt(10 / 4))
    # not one (3, 40) matrix: that is a different update
    flat = orthogonalize_matrix(w0)
    assert not torch.allclose(flat, orthogonalize_matrix(w0, stacked=True), atol=1e-3)


def test_a_stacked_group_takes_only_stacks():
    with pytest.raises(ValueError, match="stacks are"):
        Muon([{"params": [nn.Parameter(torch.zeros(4, 4))], "stacked": True}])


# name -> (full shape, mesh "1d" (4 ranks) or "2d" (2 replicas x 2), placements, stacked,
#          how many matrices all 4 ranks orthogonalize together)
CASES = {
    "even rows": ((12, 8), "1d", ("S0",), False, 1),
    "uneven rows": ((5, 7), "1d", ("S0",), False, 1),
    "fewer rows than ranks": ((3, 9), "1d", ("S0",), False, 1),
    "columns (row-parallel tp)": ((6, 10), "1d", ("S1",), False, 1),
    "conv kernel": ((8, 4, 3, 3), "1d", ("S0",), False, 1),
    "hsdp": ((10, 6), "2d", ("R", "S0"), False, 2),  # each replica's own
    "replicated": ((6, 6), "1d", ("R",), False, 4),  # every rank: nothing to split
    "experts over ep": ((5, 4, 6), "1d", ("S0",), True, 5),  # whole experts where they live
    "experts over ep, hidden over tp": ((2, 4, 6), "2d", ("R", "S2"), True, 4),
    # gathered over the first mesh dim, split over the second
    "two mesh dims cut it": ((8, 6), "2d", ("S0", "S0"), False, 2),
    "two mesh dims, two tensor dims": ((8, 6), "2d", ("S0", "S1"), False, 2),
}


def split_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import kiln.train.optimizers.newton_schulz as newton_schulz
    from kiln.train.optimizers.muon_split import orthogonalize_updates

    meshes = {"1d": init_device_mesh("cpu", (world,)),
              "2d": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))}
    gen = torch.Generator().manual_seed(0)
    fulls, updates, stacks = {}, {}, {}
    for name, (shape, mesh, placements, stacked, _) in CASES.items():
        fulls[name] = torch.randn(shape, generator=gen)  # the same on every rank
        placed = [Replicate() if p == "R" else Shard(int(p[1])) for p in placements]
        updates[name] = distribute_tensor(fulls[name], meshes[mesh], placed)
        stacks[name] = stacked
    counted, real = {}, newton_schulz.orthogonalize

    def counting(x, *args, **kwargs):
        counted[current] = counted.get(current, 0) + math.prod(x.shape[:-2])
        return real(x, *args, **kwargs)

    out, differences = {}, {}
    newton_schulz.orthogonalize = counting
    try:
        for stacked in (False, True):  # as Muon calls it: one call per group
            names = [n for n in CASES if stacks[n] == stacked]
            current = "stacked" if stacked else "matrices"
            results = orthogonalize_updates([updates[n] for n in names], stacked)
            for n, r in zip(names, results):
                out[n] = r
        for n in CASES:  # one name at a time, for the per-case count
            current = n
            orthogonalize_updates([updates[n]], stacks[n])
    finally:
        newton_schulz.orthogonalize = real
    for n, r in out.items():
        assert r.placements == updates[n].placements and r.shape == updates[n].shape
        differences[n] = (r.full_tensor() - orthogonalize_matrix(fulls[n], stacks[n])).abs().max().item()
    fsdp_tp = fsdp_over_tp(meshes["2d"], newton_schulz) if torch_compat.fsdp_runs_on_cpu() else None
    return {"differences": differences, "counted": counted, "fsdp x tp": fsdp_tp,
            "rounds": in_rounds(updates, out), "ddp": over_replicas(newton_schulz),
            "fallback": fallback(updates, out, newton_schulz),
            "together": together(updates, stacks, out)}


def together(updates, stacks, out):
    """Matrices and expert stacks in one call (as Muon passes all its groups): (all-to-alls of the
    two calls per kind, of the one call, whether every result is bit-identical)."""
    from kiln.train.optimizers import muon_split

    calls, real = [0], muon_split._all_to_all

    def exchange(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    muon_split._all_to_all = exchange
    try:
        for stacked in (False, True):
            muon_split.orthogonalize_updates([updates[n] for n in CASES if stacks[n] == stacked], stacked)
        apart = calls[0]
        joint = muon_split.orthogonalize_updates([updates[n] for n in CASES], [stacks[n] for n in CASES])
    finally:
        muon_split._all_to_all = real
    return apart, calls[0] - apart, all(torch.equal(j.to_local(), out[n].to_local()) for n, j in zip(CASES, joint))


def fallback(updates, out, newton_schulz):
    """The matrices two mesh dims cut where DTensor cannot narrow them to one cut (a torch whose
    redistribute refuses): gathered whole on every rank, the same results. (Matrices this rank
    orthogonalized, whether they are bit-identical to the narrowed ones.)"""
    from kiln.train.optimizers import muon_split

    names = ["two mesh dims cut it", "two mesh dims, two tensor dims"]
    calls, real_orth, real_redistribute = [0], newton_schulz.orthogonalize, muon_split._redistribute

    def counting(x, *args, **kwargs):
        calls[0] += 1
        return real_orth(x, *args, **kwargs)

    def refusing(u, placements):
        raise NotImplementedError("redistribute refused (test)")

    newton_schulz.orthogonalize, muon_split._redistribute = counting, refusing
    try:
        again = muon_split.orthogonalize_updates([updates[n] for n in names])
    finally:
        newton_schulz.orthogonalize, muon_split._redistribute = real_orth, real_redistribute
    return calls[0], all(torch.equal(a.full_tensor(), out[n].full_tensor()) for n, a in zip(names, again))


def over_replicas(newton_schulz):
    """Whole matrices every rank holds alike (DDP), dealt over the 4 ranks and broadcast: (the
    largest difference to orthogonalizing each here, how many this rank orthogonalized)."""
    import torch.distributed as dist

    from kiln.train.optimizers.muon_split import orthogonalize_updates

    gen = torch.Generator().manual_seed(1)
    shapes = [(12, 8), (5, 7), (8, 4, 3, 3), (6, 6), (3, 9)]
    plain = [torch.randn(shape, generator=gen) for shape in shapes] + [torch.randn(4, 4, generator=gen).double()]
    stacks = [torch.randn(3, 4, 6, generator=gen), torch.randn(2, 6, 4, generator=gen)]
    calls, real = [0], newton_schulz.orthogonalize

    def counting(x, *args, **kwargs):
        calls[0] += math.prod(x.shape[:-2])
        return real(x, *args, **kwargs)

    newton_schulz.orthogonalize = counting
    try:
        got = orthogonalize_updates(plain, False, dist.group.WORLD) + orthogonalize_updates(stacks, True, dist.group.WORLD)
    finally:
        newton_schulz.orthogonalize = real
    want = [orthogonalize_matrix(t) for t in plain] + [orthogonalize_matrix(t, True) for t in stacks]
    assert all(g.dtype == w.dtype and g.shape == w.shape for g, w in zip(got, want))
    return max((g - w).abs().max().item() for g, w in zip(got, want)), calls[0]


def in_rounds(updates, out):
    """The plain matrices again with a round budget of one byte (each matrix its own round):
    (the all-to-alls issued, whether every result is bit-identical to one round's)."""
    from kiln.train.optimizers import muon_split

    names = [n for n in CASES if not CASES[n][3]]
    calls, real_budget, real_exchange = [0], muon_split.ROUND_BYTES, muon_split._all_to_all

    def exchange(*args, **kwargs):
        calls[0] += 1
        return real_exchange(*args, **kwargs)

    muon_split.ROUND_BYTES, muon_split._all_to_all = 1, exchange
    try:
        again = muon_split.orthogonalize_updates([updates[n] for n in names])
    finally:
        muon_split.ROUND_BYTES, muon_split._all_to_all = real_budget, real_exchange
    return calls[0], all(torch.equal(a.to_local(), out[n].to_local()) for n, a in zip(names, again))


def fsdp_over_tp(mesh, newton_schulz):
    """FSDP2 over tensor parallel's column- and row-parallel weights (`_StridedShard` x `Shard`,
    `Shard` x `Shard` of another dim): (largest difference to one process, matrices counted)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kiln.train.optimizers.muon_split import orthogonalize_updates

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=False))
    fulls = [p.detach().clone() for p in model.parameters()]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    updates = [p.detach() for p in model.parameters()]
    calls, real = [0], newton_schulz.orthogonalize

    def counting(x, *args, **kwargs):
        calls[0] += 1
        return real(x, *args, **kwargs)

    newton_schulz.orthogonalize = counting
    try:
        results = orthogonalize_updates(updates)
    finally:
        newton_schulz.orthogonalize = real
    assert all(r.placements == u.placements for r, u in zip(results, updates))
    return max((r.full_tensor() - orthogonalize_matrix(f)).abs().max().item() for r, f in zip(results, fulls)), calls[0]


@pytest.mark.timeout(180)
def test_each_sharded_matrix_is_orthogonalized_once_and_every_rank_gets_its_shard(tmp_path):
    ranks = run_ranks(split_rank, 4, tmp_path, timeout=150)
    for name in CASES:
        worst = max(r["differences"][name] for r in ranks)
        # the owner runs what one process runs on the whole matrix; an expert alone vs in a batch
        # of experts (the reference) differs in the last bits
        assert worst <= (1e-5 if CASES[name][3] else 0.0), (name, worst)
        # all 4 ranks together orthogonalize each matrix once per replica of it, not 4 times
        assert sum(r["counted"].get(name, 0) for r in ranks) == CASES[name][4], (name, [r["counted"] for r in ranks])
    # Muon's one call for the plain matrices: the 5 split over all 4 ranks dealt out (none twice),
    # hsdp's and the two cut twice once per replica, the replicated one on every rank:
    # 5 + 2 + 2 + 2 + 4; gathering all on every rank (as before) was 9 per rank
    per_rank = [r["counted"]["matrices"] for r in ranks]
    # (each process group deals its own matrices: the 1-D group's 5 and the 2-D tp groups' 3 can
    # land 2 + 2 on one rank)
    assert sum(per_rank) == 15 and max(per_rank) <= 5, per_rank
    # in rounds of one matrix: the 1-D group's 5 and the 2-D tp groups' 3 each exchanged alone
    # (two all-to-alls a round, instead of two per group), the same results
    assert all(r["rounds"] == (2 * (5 + 3), True) for r in ranks), [r["rounds"] for r in ranks]
    # DDP's whole matrices: each orthogonalized on one of the 4 ranks (6 plain, 3 + 2 experts),
    # every rank getting all results bit for bit
    assert max(r["ddp"][0] for r in ranks) == 0.0
    assert sum(r["ddp"][1] for r in ranks) == 6 + 5 and max(r["ddp"][1] for r in ranks) < 6 + 5
    # matrices and stacks together: the tp groups' hsdp, twice-cut and expert-hidden updates share
    # one exchange (2 all-to-alls) instead of one per kind; the same results
    assert all(r["together"] == (2 * 3, 2 * 2, True) for r in ranks), [r["together"] for r in ranks]
    # where DTensor cannot narrow: both gathered and orthogonalized on every rank, the same results
    assert all(r["fallback"] == (2, True) for r in ranks), [r["fallback"] for r in ranks]
    if ranks[0]["fsdp x tp"] is not None:  # FSDP2 runs on CPU (not torch 2.6)
        assert max(r["fsdp x tp"][0] for r in ranks) == 0.0
        assert sum(r["fsdp x tp"][1] for r in ranks) == 4  # 2 matrices, each once per dp index
