"""ZeRO-1's optimizer state goes through DCP's state-dict helpers like a plain optimizer's, in one
gloo process (the 2-rank save/load across layouts is in test_data_parallel.py)."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kiln.parallel.data_parallel import Zero1Optimizer, window_stats_over_ranks
from kiln.parallel.zero1_shards import is_sharded, local_tensors


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plain = torch.optim.SGD([{"params": list(model[0].parameters()), "lr": 0.1},
                             {"params": list(model[2].parameters()), "lr": 0.05}], momentum=0.9)
    return model, Zero1Optimizer(plain, dist.group.WORLD)


def train_step(model, opt, seed):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_state_dict_round_trip_keeps_momentum_and_continues_identically(group):
    model, opt = model_and_optimizer()
    for s in range(2):
        train_step(model, opt, s)
    momentum = [opt.dense.optim.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    model_sd, optim_sd = get_state_dict(model, opt)
    # Saving must not step: DCP runs a zero-gradient step on an optimizer whose `state` looks empty,
    # which would decay SGD's momentum.
    for p, m in zip(model.parameters(), momentum):
        torch.testing.assert_close(opt.dense.optim.state[p]["momentum_buffer"], m)
    assert set(optim_sd["state"]) == {name for name, _ in model.named_parameters()}  # FQN-keyed, full

    # As if read back from disk: fresh tensors (the live ones would be shared with `opt`).
    model_sd, optim_sd = copy.deepcopy(model_sd), copy.deepcopy(optim_sd)
    other, other_opt = model_and_optimizer(seed=1)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(other_opt.dense.optim.state[q]["momentum_buffer"], opt.dense.optim.state[p]["momentum_buffer"])
    assert [g["lr"] for g in other_opt.param_groups] == [0.1, 0.05]
    train_step(model, opt, 7)
    train_step(other, other_opt, 7)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(q, p)


def test_window_stats_in_one_process():
    stats = window_stats_over_ranks(0.25, 123.0, torch.device("cpu"))
    assert stats == {"window_s": 0.25, "memory_mb": 123.0, "memory_mb_min": 123.0}


# ZeRO-1 that cuts tensors (kiln/parallel/zero1_partition.py `partition`): 3 gloo ranks, a model whose
# embedding and head are each above a rank's even share of its 938 elements.
def _cut_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 50))


def _groups(model, muon=False):
    if muon:  # as kiln's: the hidden matrix orthogonalized, the embedding and head by AdamW
        rest = [p for p in model.parameters() if p is not model[1].weight]
        return [{"params": [model[1].weight], "use_muon": True, "weight_decay": 0.1},
                {"params": rest, "use_muon": False, "weight_decay": 0.0, "lr": 0.01}]
    matrices = [model[1].weight, model[3].weight]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _build(name, model):
    from kiln.train.optimizers import Lion, Muon

    if name == "adamw":
        return torch.optim.AdamW(_groups(model), lr=0.01)
    if name == "lion":
        return Lion(_groups(model), lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9, nesterov=True)
    return Muon(_groups(model, muon=True), lr=0.02)


def _loss(model, seed):
    tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(seed))
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())


def _steps(model, opt, seeds):
    for s in seeds:  # every rank the same batch: the gradients are the same everywhere, as after DDP
        _loss(model, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _apart(a, b) -> float:
    """Largest difference relative to the tensor's scale (0.0: bit for bit)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.dim() else abs(a - b).item()


def _state_apart(saved, full) -> float:
    """`_apart` of a saved state value from a plain optimizer's: a ZeRO-1 share box by box."""
    if not is_sharded(saved):
        return _apart(saved, full)
    return max(_apart(s.tensor, full[tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))])
               for s in saved.local_shards())


def _cut_against_plain(rank, n, root):
    import torch.distributed.checkpoint as dcp

    out = {}
    for name in ("adamw", "lion", "sgd", "muon"):
        model, plain_model = _cut_model(), _cut_model()
        zero, plain = Zero1Optimizer(_build(name, model), dist.group.WORLD), _build(name, plain_model)
        _steps(model, zero, range(3))
        _steps(plain_model, plain, range(3))
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, zero))), checkpoint_id=str(root / name))
        saved, expected = copy.deepcopy(zero.state_dict()), copy.deepcopy(plain.state_dict())  # not the live tensors
        resumed_model = _cut_model(seed=5)
        resumed_model.load_state_dict(plain_model.state_dict())
        resumed = Zero1Optimizer(_build(name, resumed_model), dist.group.WORLD)
        resumed.load_state_dict(copy.deepcopy(expected))  # a plain optimizer's state, into the cut one
        bad = copy.deepcopy(expected)  # a state whose cut (50, 8) moment has another shape: refused in one line
        key, moment = next((k, m) for k, st in bad["state"].items() for m, v in st.items() if v.shape == (50, 8))
        bad["state"][key][moment] = torch.zeros(3, 8)
        try:
            Zero1Optimizer(_build(name, _cut_model()), dist.group.WORLD).load_state_dict(bad)
            refused = ""
        except ValueError as e:
            refused = str(e)
        from_shares_model = _cut_model(seed=6)  # this rank's share of the state, into the same partition
        from_shares_model.load_state_dict(plain_model.state_dict())
        from_shares = Zero1Optimizer(_build(name, from_shares_model), dist.group.WORLD)
        from_shares.load_state_dict(copy.deepcopy(saved))
        for m, opt in ((model, zero), (resumed_model, resumed), (from_shares_model, from_shares), (plain_model, plain)):
            _steps(m, opt, [3, 4])
        assert saved["param_groups"] == expected["param_groups"] and saved["state"].keys() <= expected["state"].keys()
        shares = [v for st in saved["state"].values() for v in st.values() if is_sharded(v)]
        out[name] = {
            "cut": [tuple(d.param.shape) for d in zero._dense if d.cut],
            "refused": refused,
            "held": sum(p.numel() for g in zero.dense.optim.param_groups for p in g["params"]),
            "params": max(_apart(p, q) for p, q in zip(model.parameters(), plain_model.parameters())),
            "resumed": max(_apart(p, q) for p, q in zip(resumed_model.parameters(), plain_model.parameters())),
            "from_shares": max(_apart(p, q) for p, q in zip(from_shares_model.parameters(), plain_model.parameters())),
            "state": max(_state_apart(v, expected["state"][k][key]) for k, st in saved["state"].items() for key, v in st.items()),
            "keys": sorted(k for k, st in saved["state"].items() if st),  # the parameters it steps any of
            "shared": sum(t.numel() for v in shares for t in local_tensors(v)),  # the moments' elements saved here
            "own": sum(v.numel() for st in zero.dense.optim.state.values() for v in st.values()  # the moments it steps
                       if isinstance(v, torch.Tensor) and v.dim() > 0),
        }
    return out


def _resume_on_two(rank, n, root):
    """The 3-rank checkpoints continued by ZeRO-1 over 2 ranks (other runs, other boxes: DCP reads
    each rank's from the saved ones by overlap), against one plain optimizer's 5 steps."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name in ("adamw", "lion", "sgd", "muon"):
        model, plain_model = _cut_model(seed=7), _cut_model()
        zero, plain = Zero1Optimizer(_build(name, model), dist.group.WORLD), _build(name, plain_model)
        state = dict(zip(("model", "optim"), get_state_dict(model, zero)))
        dcp.load(state, checkpoint_id=str(root / name))
        set_state_dict(model, zero, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _steps(model, zero, [3, 4])
        _steps(plain_model, plain, range(5))
        out[name] = max(_apart(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))
    return out


def test_cut_tensors_step_like_one_optimizer_and_save_its_state(tmp_path):
    """Each of 3 ranks holds a third of the elements (the embedding and head cut across ranks);
    the parameters after 5 steps, each rank's saved share of the state after 3 (its own third of
    each moment, nothing gathered), and resumes from a plain optimizer's state, from the shares and
    (through DCP) on 2 ranks, whose boxes lie elsewhere, are those of one plain optimizer: bit for bit for AdamW (torch's for-loop on the CPU),
    Lion and SGD with momentum; for Muon (its matrix whole, its AdamW tensors cut) within 1e-6 of
    each tensor's scale: torch's fused CPU AdamW computes the elements past a tensor's last whole
    vector apart from the others (an FMA apart), and a cut moves where those fall."""
    from ranks import run_ranks

    (tmp_path / "three").mkdir()
    results = run_ranks(_cut_against_plain, 3, tmp_path / "three", tmp_path, timeout=240)
    total = sum(p.numel() for p in _cut_model().parameters())
    for name in ("adamw", "lion", "sgd", "muon"):
        held = [r[name]["held"] for r in results]
        assert sum(held) == total, name
        assert max(held) - min(held) <= 1, (name, held)  # an even third: 313, 313, 312
        bound = 1e-6 if name == "muon" else 0.0
        # each rank's state_dict holds only its own third of each moment: nothing is gathered to save
        assert all(r[name]["shared"] == r[name]["own"] > 0 for r in results), name
        assert set().union(*(r[name]["keys"] for r in results)) == set(range(len(list(_cut_model().parameters())))), name
        for r in results:
            assert (50, 8) in r[name]["cut"], name
            assert "a tensor of shape (3, 8), expected (50, 8)" in r[name]["refused"] and "\n" not in r[name]["refused"]
            assert max(r[name][k] for k in ("params", "resumed", "from_shares", "state")) <= bound, (name, r[name])
    assert all((8, 8) not in r["muon"]["cut"] for r in results)
    # a whole state, as a user takes one out of the checkpoint: torch's dcp_to_torch_save assembles the boxes
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "adamw", tmp_path / "adamw.pt")
    whole = torch.load(tmp_path / "adamw.pt", weights_only=False)["optim"]["state"]
    plain_model = _cut_model()
    plain = _build("adamw", plain_model)
    _steps(plain_model, plain, range(3))
    for (name, p), key in itertools.product(plain_model.named_parameters(), ("exp_avg", "exp_avg_sq")):
        assert torch.equal(whole[name][key], plain.state[p][key]), (name, key)
    (tmp_path / "two").mkdir()
    for resumed in run_ranks(_resume_on_two, 2, tmp_path / "two", tmp_path, timeout=240):
        assert max(resumed[name] for name in ("adamw", "lion", "sgd")) == 0.0 and resumed["muon"] <= 1e-6, resumed


def _tensor_parallel_shares(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 48, bias=False), nn.Linear(48, 4, bias=False), nn.LayerNorm(4), nn.Linear(4, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    zero = Zero1Optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), mesh["dp"].get_group())
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    zero.step()
    held = sum(v.numel() for s in zero.state.values() for v in s.values() if v.dim() > 0) // 2  # exp_avg(_sq)
    return held, sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def test_tensor_parallel_shards_are_cut_by_their_local_size(tmp_path):
    """dp 2 x tp 2: each dp rank steps half of its tp rank's local elements (the shards' local
    sizes, not the DTensors' global ones, which count a sharded tensor tp times a replicated one)."""
    from ranks import run_ranks

    for held, local in run_ranks(_tensor_parallel_shares, 4, tmp_path, timeout=120):
        assert local == 384 // 2 + 192 // 2 + 8 + 40 and held == local // 2, (held, local)


def _rank_without_tensors(rank, n, root):
    """LAMB and Adafactor (whole tensors) over 2 tensors on 3 ranks: rank 2 steps none. Saving
    through DCP must not take it for never stepped (DCP would step it alone on zero gradients, a
    collective: a hang), and the checkpoint resumes into a fresh ZeRO-1 like one plain optimizer."""
    import torch.distributed.checkpoint as dcp

    from kiln.train.optimizers import Adafactor, Lamb

    out = {}
    for cls in (Lamb, Adafactor):
        def build(seed=0):
            torch.manual_seed(seed)
            model = nn.Linear(4, 3)
            return model, cls(model.parameters(), lr=0.01)

        model, opt = build()
        zero = Zero1Optimizer(opt, dist.group.WORLD)
        plain_model, plain = build()
        for s in range(2):
            for m, o in ((model, zero), (plain_model, plain)):
                m(torch.randn(5, 4, generator=torch.Generator().manual_seed(s))).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
        held = sum(p.numel() for g in zero.dense.optim.param_groups for p in g["params"])
        model_sd, optim_sd = get_state_dict(model, zero)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / cls.__name__))
        resumed_model, opt = build(seed=3)
        resumed = Zero1Optimizer(opt, dist.group.WORLD)
        state = dict(zip(("model", "optim"), get_state_dict(resumed_model, resumed)))
        dcp.load(state, checkpoint_id=str(root / cls.__name__))
        set_state_dict(resumed_model, resumed, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for m, o in ((resumed_model, resumed), (plain_model, plain)):
            m(torch.randn(5, 4, generator=torch.Generator().manual_seed(9))).square().mean().backward()
            o.step()
        out[cls.__name__] = held, max(_apart(p, q) for p, q in zip(resumed_model.parameters(), plain_model.parameters()))
    return out


def test_a_rank_that_steps_no_tensor_saves_and_resumes(tmp_path):
    from ranks import run_ranks

    (tmp_path / "work").mkdir()
    results = run_ranks(_rank_without_tensors, 3, tmp_path / "work", tmp_path, timeout=120)
    for name in ("Lamb", "Adafactor"):
        assert sorted(r[name][0] for r in results) == [0, 3, 12], name
        assert all(r[name][1] == 0.0 for r in results), (name, results)


def _uneven_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 47, bias=False), nn.Linear(47, 4, bias=False), nn.LayerNorm(4), nn.Linear(4, 8))


def _uneven_step(model, opt):
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _uneven_tp_save(rank, n, root):
    """dp 2 x tp 2 with tp shards of 24 and 23 rows: each tp coordinate's ZeRO-1 cuts the tensors
    replicated over tp (the LayerNorm, the last Linear) alike, so DCP's save (which refuses
    overlapping boxes) goes through."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _uneven_model()  # the first Linear's output gathered (torch's rowwise takes even shards only)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})
    zero = Zero1Optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), mesh["dp"].get_group())
    for _ in range(2):
        _uneven_step(model, zero)
    dcp.save({"optim": get_state_dict(model, zero)[1]}, checkpoint_id=str(root / "ckpt"))
    return [tuple(d.param.to_local().shape) for d in zero._dense if hasattr(d.param, "to_local")]


def test_uneven_tensor_parallel_shards_save_once_and_load_whole(tmp_path):
    """The checkpoint loads into one process's plain AdamW with that optimizer's own moments."""
    import torch.distributed.checkpoint as dcp

    from ranks import run_ranks

    (tmp_path / "work").mkdir()
    shards = run_ranks(_uneven_tp_save, 4, tmp_path / "work", tmp_path, timeout=120)
    assert sorted({s for r in shards for s in r}) == [(23, 8), (24, 8)]  # uneven shards were saved
    model = _uneven_model()
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        _uneven_step(model, plain)
    loaded_model = _uneven_model()
    loaded = torch.optim.AdamW(loaded_model.parameters(), lr=0.01)
    _uneven_step(loaded_model, loaded)  # state to load into
    state = {"optim": get_state_dict(loaded_model, loaded)[1]}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    expected = get_state_dict(model, plain)[1]["state"]
    for name, moments in state["optim"]["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(value, expected[name][key], rtol=1e-5, atol=1e-7)


def test_a_torch_without_sharded_tensor_refuses_zero1_in_one_line(group, monkeypatch):
    from kiln.errors import ConfigError
    from kiln.parallel import zero1_shards

    monkeypatch.setattr(zero1_shards, "MISSING", "torch 9.9 has no ShardedTensor (No module named 'x')")
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"^parallel\.dp_mode='zero1' saves .*torch 9\.9 has no ShardedTensor.*"
                                          r"use parallel\.dp_mode='fsdp' or 'zero2'"):
        Zero1Optimizer(torch.optim.AdamW(model.parameters()), group)
