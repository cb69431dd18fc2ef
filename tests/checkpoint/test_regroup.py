"""A checkpoint whose optimizer param groups differ from the resuming optimizer's (kiln's Muon
split MoE experts into their own "muon_experts" group on 29 Nov): the per-parameter state loads by
name and each group takes the hyper-parameters of the saved group it came from."""

import torch

from kiln.checkpoint.manager import CheckpointManager, ModelOptimizerState
from kiln.config import load_config
from kiln.model.transformer import Transformer
from kiln.train.optim import build_optimizer
from kiln.train.optimizers import Muon

OVERRIDES = ["model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.vocab_size=40", "model.max_seq_len=16",
             "data.seq_len=16", "model.moe_experts=4", "model.moe_top_k=2", "optim.name='muon'"]


def _model(seed):
    cfg = load_config(None, OVERRIDES)
    model = Transformer(cfg.model)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model, cfg


def _step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def test_a_checkpoint_from_before_the_experts_group_resumes(tmp_path):
    model, cfg = _model(0)
    groups = [dict(g) for g in build_optimizer(model, cfg.optim).param_groups]
    experts = next(g for g in groups if g["name"] == "muon_experts")
    muon = next(g for g in groups if g["name"] == "muon")
    muon["params"] = muon["params"] + experts["params"]  # as kiln grouped them before
    old = Muon([g for g in groups if g is not experts])
    for g in old.param_groups:
        g["lr"] = 0.5 if g["name"] == "muon" else 0.01
    for seed in range(2):
        _step(model, old, seed)
    mgr = CheckpointManager(tmp_path / "ck", async_save=False)
    assert all(r.ok for r in mgr.save(2, {"app": ModelOptimizerState(model, old)}))

    resumed, _ = _model(1)
    new = build_optimizer(resumed, cfg.optim)
    assert [g["name"] for g in new.param_groups] == ["muon", "muon_experts", "adamw_no_decay"]
    assert mgr.load({"app": ModelOptimizerState(resumed, new)}) == 2
    names = {id(p): n for n, p in model.named_parameters()}
    saved = {names[id(p)]: s for p, s in old.state.items()}
    for n, p in resumed.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n])
        for key, value in saved[n].items():
            assert torch.equal(torch.as_tensor(new.state[p][key]), torch.as_tensor(value)), (n, key)
    by_name = {g["name"]: g for g in new.param_groups}
    assert by_name["muon_experts"]["lr"] == 0.5 and by_name["muon_experts"]["stacked"] is True
    assert by_name["muon"]["lr"] == 0.5 and by_name["adamw_no_decay"]["lr"] == 0.01
    assert {id(p) for p in by_name["muon_experts"]["params"]} == {id(p) for p in experts_of(resumed)}


def experts_of(model):
    from kiln.model.moe import GroupedExperts

    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)]


def test_saved_groups_are_read_from_metadata_keys_only_when_they_make_a_list():
    from types import SimpleNamespace

    from kiln.checkpoint.manager import saved_param_groups

    def meta(*keys):
        return SimpleNamespace(state_dict_metadata=dict.fromkeys(keys))

    p = "app.optim.param_groups."
    assert saved_param_groups(meta(p + "0.name", p + "0.lr", p + "1.name", "app.model.w"), p) == [
        {"name", "lr"}, {"name"}]
    assert saved_param_groups(meta(p + "0.name", p + "2.name"), p) is None  # a gap: not a list of groups
    assert saved_param_groups(meta(p + "x.name", p + "0.betas.0"), p) is None  # no index / a nested key only
    assert saved_param_groups(meta("app.model.w"), p) is None


def test_damaged_saved_groups_fall_back_to_the_optimizers_own():
    from kiln.checkpoint.manager import _regroup

    current = [{"name": "muon", "params": ["a"], "lr": 0.1, "stacked": False},
               {"name": "muon_experts", "params": ["b"], "lr": 0.1, "stacked": True}]
    saved = [{"name": ["not", "a", "name"], "params": 7, "lr": 9.0}, {"params": [3, None, "b"], "lr": 0.5}]
    out = _regroup(saved, current)
    assert out[0] == current[0]  # nothing usable names it or holds its parameter
    assert out[1] == {**current[1], "lr": 0.5}  # the saved group holding "b"
