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
