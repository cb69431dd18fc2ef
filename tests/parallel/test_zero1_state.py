"""ZeRO-1's optimizer state goes through DCP's state-dict helpers like a plain optimizer's, in one
gloo process (the 2-rank save/load across layouts is in test_data_parallel.py)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kiln.parallel.data_parallel import ZeroRedundancyState, window_stats_over_ranks


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
    opt = ZeroRedundancyState([{"params": list(model[0].parameters()), "lr": 0.1},
                               {"params": list(model[2].parameters()), "lr": 0.05}],
                              optimizer_class=torch.optim.SGD, momentum=0.9)
    return model, opt


def train_step(model, opt, seed):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_state_dict_round_trip_keeps_momentum_and_continues_identically(group):
    model, opt = model_and_optimizer()
    for s in range(2):
        train_step(model, opt, s)
    momentum = [opt.optim.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    model_sd, optim_sd = get_state_dict(model, opt)
    # Saving must not step: DCP runs a zero-gradient step on an optimizer whose `state` looks empty,
    # which would decay SGD's momentum.
    for p, m in zip(model.parameters(), momentum):
        torch.testing.assert_close(opt.optim.state[p]["momentum_buffer"], m)
    assert set(optim_sd["state"]) == {name for name, _ in model.named_parameters()}  # FQN-keyed, full

    # As if read back from disk: fresh tensors (the live ones would be shared with `opt`).
    model_sd, optim_sd = copy.deepcopy(model_sd), copy.deepcopy(optim_sd)
    other, other_opt = model_and_optimizer(seed=1)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(other_opt.optim.state[q]["momentum_buffer"], opt.optim.state[p]["momentum_buffer"])
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


def _cut_against_plain(rank, n):
    from kiln.parallel.zero1 import Zero1Optimizer

    out = {}
    for name in ("adamw", "lion", "sgd", "muon"):
        model, plain_model = _cut_model(), _cut_model()
        zero, plain = Zero1Optimizer(_build(name, model), dist.group.WORLD), _build(name, plain_model)
        _steps(model, zero, range(3))
        _steps(plain_model, plain, range(3))
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
        for m, opt in ((model, zero), (resumed_model, resumed), (plain_model, plain)):
            _steps(m, opt, [3, 4])
        assert saved["param_groups"] == expected["param_groups"] and saved["state"].keys() == expected["state"].keys()
        out[name] = {
            "cut": [tuple(d.param.shape) for d in zero._dense if d.cut],
            "refused": refused,
            "held": sum(p.numel() for g in zero.dense.optim.param_groups for p in g["params"]),
            "params": max(_apart(p, q) for p, q in zip(model.parameters(), plain_model.parameters())),
            "resumed": max(_apart(p, q) for p, q in zip(resumed_model.parameters(), plain_model.parameters())),
            "state": max(_apart(v, expected["state"][k][key]) for k, st in saved["state"].items() for key, v in st.items()),
        }
    return out


def test_cut_tensors_step_like_one_optimizer_and_save_its_state(tmp_path):
    """Each of 3 ranks holds a third of the elements (the embedding and head cut across ranks);
    the parameters after 5 steps, the joined state after 3 and a resume from a plain optimizer's
    state are those of one plain optimizer: bit for bit for AdamW (torch's for-loop on the CPU),
    Lion and SGD with momentum; for Muon (its matrix whole, its AdamW tensors cut) within 1e-6 of
    each tensor's scale: torch's fused CPU AdamW computes the elements past a tensor's last whole
    vector apart from the others (an FMA apart), and a cut moves where those fall."""
    from ranks import run_ranks

    results = run_ranks(_cut_against_plain, 3, tmp_path, timeout=240)
    total = sum(p.numel() for p in _cut_model().parameters())
    for name in ("adamw", "lion", "sgd", "muon"):
        held = [r[name]["held"] for r in results]
        assert sum(held) == total, name
        assert max(held) - min(held) <= 1, (name, held)  # an even third: 313, 313, 312
        bound = 1e-6 if name == "muon" else 0.0
        for r in results:
            assert (50, 8) in r[name]["cut"], name
            assert "a tensor of shape (3, 8), expected (50, 8)" in r[name]["refused"] and "\n" not in r[name]["refused"]
            assert max(r[name][k] for k in ("params", "resumed", "state")) <= bound, (name, r[name])
    assert all((8, 8) not in r["muon"]["cut"] for r in results)


def _tensor_parallel_shares(rank, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kiln.parallel.zero1 import Zero1Optimizer

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
