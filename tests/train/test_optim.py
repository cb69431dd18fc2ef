import io
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import OptimConfig, ScheduleConfig
from kiln.errors import ConfigError, KilnError
from kiln.train.optim import build_optimizer, param_groups
from kiln.train.schedule import LRSchedule
from conftest import require_fsdp2_on_cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from ranks import run_ranks  # noqa: E402  (tests/parallel/ranks.py)

ALL = ["adamw", "adafactor", "lamb", "lion", "muon", "sgd"]


class TinyLM(nn.Module):
    """Embedding, a hidden block with bias and norm, and an LM head named `output` (tied or not)."""

    def __init__(self, vocab: int = 11, dim: int = 8, tie: bool = True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.proj(torch.relu(self.hidden(h)))
        return self.output(self.norm(h))


def ids(params) -> set[int]:
    return {id(p) for p in params}


def group(groups, name):
    return next(g for g in groups if g["name"] == name)


def test_param_groups_decay_only_matrices_by_default():
    model = TinyLM(tie=True)
    groups = param_groups(model, OptimConfig(weight_decay=0.1))
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    decay, no_decay = group(groups, "decay"), group(groups, "no_decay")
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert ids(decay["params"]) == ids([model.hidden.weight, model.proj.weight])
    assert ids(no_decay["params"]) == ids([model.tok_embeddings.weight, model.hidden.bias,
                                           model.norm.weight, model.norm.bias])
    # The tied embedding / head weight appears exactly once over all groups.
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len(ids(all_params)) == 6


def test_param_groups_switches_and_untied_head():
    model = TinyLM(tie=False)
    cfg = OptimConfig(decay_embeddings=True, decay_norms_and_biases=True)
    assert [g["name"] for g in param_groups(model, cfg)] == ["decay"]  # nothing left undecayed
    groups = param_groups(model, OptimConfig(decay_embeddings=True))
    assert id(model.tok_embeddings.weight) in ids(group(groups, "decay")["params"])
    assert id(model.output.weight) in ids(group(groups, "decay")["params"])  # an untied head is a matrix
    assert id(model.norm.weight) in ids(group(groups, "no_decay")["params"])
    frozen = TinyLM()
    frozen.norm.requires_grad_(False)
    assert not ids(frozen.norm.parameters()) & ids(p for g in param_groups(frozen, OptimConfig()) for p in g["params"])


def test_muon_groups_split_hidden_matrices_from_the_rest():
    model = TinyLM(tie=False)
    cfg = OptimConfig(name="muon", lr=0.02, muon_adam_lr=0.004, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    groups = opt.param_groups
    assert [g["name"] for g in groups] == ["muon", "adamw_decay", "adamw_no_decay"]
    assert ids(group(groups, "muon")["params"]) == ids([model.hidden.weight, model.proj.weight])
    assert ids(group(groups, "adamw_decay")["params"]) == ids([model.output.weight])
    assert id(model.tok_embeddings.weight) in ids(group(groups, "adamw_no_decay")["params"])
    # Peak lrs in torch's initial_lr; the schedule is the one writer of "lr" and keeps the AdamW
    # part on the same curve from its own peak.
    assert group(groups, "muon")["initial_lr"] == pytest.approx(0.02)
    assert group(groups, "adamw_decay")["initial_lr"] == pytest.approx(0.004)
    sched = LRSchedule(opt, ScheduleConfig(name="linear", warmup_steps=4, min_lr_ratio=0.0), 10)
    assert group(groups, "muon")["lr"] == pytest.approx(0.02 * 0.25)
    assert group(groups, "adamw_no_decay")["lr"] == pytest.approx(0.004 * 0.25)
    assert sched.lr == pytest.approx(0.005)


@pytest.mark.parametrize("impl,fused,foreach", [
    ("auto", True, False),  # fused wins on CPU (benchmarks/optimizer_step.py)
    ("fused", True, False),
    ("foreach", False, True),
    ("single", False, False),
])
def test_adamw_implementation(impl, fused, foreach):
    opt = build_optimizer(TinyLM(), OptimConfig(name="adamw", implementation=impl), "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    assert bool(opt.defaults["fused"]) is fused and bool(opt.defaults["foreach"]) is foreach


def test_adamw_fused_on_unsupported_device_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.implementation='fused'.*'lazy'"):
        build_optimizer(TinyLM(), OptimConfig(implementation="fused"), "lazy")
    auto = build_optimizer(TinyLM(), OptimConfig(implementation="auto"), "lazy")
    assert auto.defaults["foreach"] and not auto.defaults["fused"]


def test_optimizer_settings_reach_the_groups():
    cfg = OptimConfig(lr=0.01, betas=(0.8, 0.9), weight_decay=0.3, momentum=0.7)
    sgd = build_optimizer(TinyLM(), OptimConfig(name="sgd", lr=0.01, momentum=0.7, weight_decay=0.3))
    assert sgd.defaults["momentum"] == 0.7 and sgd.defaults["nesterov"]
    assert not build_optimizer(TinyLM(), OptimConfig(name="sgd", momentum=0.0)).defaults["nesterov"]
    for name in ALL:
        opt = build_optimizer(TinyLM(), OptimConfig(**{**cfg.__dict__, "name": name}))
        decay = opt.param_groups[0]
        assert decay["initial_lr"] == pytest.approx(0.01) and decay["weight_decay"] == 0.3
        assert opt.param_groups[-1]["weight_decay"] == 0.0
        if name in ("adamw", "lamb", "lion", "muon"):
            assert tuple(decay["betas"]) == (0.8, 0.9)


@pytest.mark.parametrize("key,value,match", [
    ("momentum", 1.0, "optim.momentum=1.0 must be in [0, 1)"),
    ("muon_adam_lr", 0.0, "optim.muon_adam_lr=0.0 must be > 0"),
    ("lr", -1.0, "optim.lr=-1.0 must be > 0"),
    ("lr", math.nan, "optim.lr=nan must be a finite number"),
    ("weight_decay", math.inf, "optim.weight_decay=inf must be a finite number"),
    ("name", "adam", "optim.name='adam' is not one of"),
])
def test_bad_settings_are_config_errors_at_the_config_boundary(key, value, match):
    # Checked once, by the config; build_optimizer trusts a validated config.
    with pytest.raises(ConfigError) as e:
        OptimConfig(**{"name": "muon", key: value}).validate()
    assert match in str(e.value)


def test_schedule_is_the_only_writer_of_lr():
    opt = build_optimizer(TinyLM(), OptimConfig(lr=0.01))
    assert all("lr_scale" not in g for g in opt.param_groups)
    sched = LRSchedule(opt, ScheduleConfig(name="linear", warmup_steps=4), 10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01 / 4] * len(opt.param_groups))
    assert sched.lr == pytest.approx(0.01 / 4)


def test_no_trainable_parameters_is_a_kiln_error():
    model = TinyLM().requires_grad_(False)
    with pytest.raises(KilnError, match="no trainable parameters"):
        build_optimizer(model, OptimConfig())


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1000 + step))


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: LRSchedule, steps: range) -> None:
    for step in steps:
        tokens = batch(step)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()


def fresh(name: str, impl: str = "auto", seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM(tie=False)
    cfg = OptimConfig(name=name, implementation=impl, lr=0.01, muon_adam_lr=0.005)
    opt = build_optimizer(model, cfg)
    sched = LRSchedule(opt, ScheduleConfig(name="cosine", warmup_steps=2), 8)
    return model, opt, sched


CASES = [(n, "auto") for n in ALL] + [("adamw", "foreach"), ("adamw", "single")]


@pytest.mark.parametrize("name,impl", CASES)
def test_resume_from_state_dict_continues_bitwise(name, impl):
    ref_model, ref_opt, ref_sched = fresh(name, impl)
    train(ref_model, ref_opt, ref_sched, range(0, 8))

    model, opt, sched = fresh(name, impl)
    train(model, opt, sched, range(0, 4))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)

    model, opt, sched = fresh(name, impl, seed=1)  # different init: everything must come from the state
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    train(model, opt, sched, range(4, 8))
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{name}: {n} differs after resume"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", ["lamb", "lion", "muon", "adamw"])
def test_distributed_checkpoint_round_trip(name, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref_model, ref_opt, ref_sched = fresh(name)
    train(ref_model, ref_opt, ref_sched, range(0, 8))

    model, opt, sched = fresh(name)
    train(model, opt, sched, range(0, 4))
    model_sd, optim_sd = get_state_dict(model, opt)
    assert set(optim_sd) == {"state", "param_groups"}
    assert "hidden.weight" in optim_sd["state"]  # keyed by parameter name, like torch optimizers
    dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}, checkpoint_id=tmp_path)

    model, opt, sched = fresh(name, seed=1)  # optimizer state not yet created: DCP initializes it
    model_sd, optim_sd = get_state_dict(model, opt)
    loaded = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
    dcp.load(loaded, checkpoint_id=tmp_path)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    sched.load_state_dict(loaded["sched"])
    assert [g["name"] for g in opt.param_groups] == [g["name"] for g in ref_opt.param_groups]
    train(model, opt, sched, range(4, 8))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ALL)
def test_every_optimizer_lowers_the_loss(name):
    model, opt, _ = fresh(name)
    tokens = batch(0)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.1, losses


class ShardedLM(nn.Module):
    """TinyLM with its hidden part as `layers` of blocks, the unit FSDP2 shards."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.ReLU(), nn.Linear(3 * dim, dim, bias=False))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = h + block(h)
        return self.output(self.norm(h))


def _sharded(mesh, seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = ShardedLM()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_rank(rank: int, world: int, ckpt_dir: str, names: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        cfg = OptimConfig(name=name, lr=0.01, muon_adam_lr=0.005)
        sched_cfg = ScheduleConfig(name="cosine", warmup_steps=2)
        torch.manual_seed(0)
        ref = ShardedLM()  # every rank sees the same batches, so the mean gradient is this one's
        ref_opt = build_optimizer(ref, cfg)
        train(ref, ref_opt, LRSchedule(ref_opt, sched_cfg, 4), range(0, 4))

        model = _sharded(mesh, 0)
        opt = build_optimizer(model, cfg)
        sched = LRSchedule(opt, sched_cfg, 4)
        train(model, opt, sched, range(0, 2))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
                 checkpoint_id=f"{ckpt_dir}/{name}")

        model = _sharded(mesh, 1)
        opt = build_optimizer(model, cfg)
        sched = LRSchedule(opt, sched_cfg, 4)
        model_sd, optim_sd = get_state_dict(model, opt)
        loaded = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
        dcp.load(loaded, checkpoint_id=f"{ckpt_dir}/{name}")
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        sched.load_state_dict(loaded["sched"])
        train(model, opt, sched, range(2, 4))
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} {n}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_optimizers_on_fsdp2_sharded_params_with_checkpoint_resume(tmp_path):
    """Two gloo ranks, FSDP2-sharded params (DTensor): kiln's own optimizers match an unsharded run,
    muon's Newton-Schulz sees whole matrices, and a DCP save/load mid-run resumes exactly."""
    require_fsdp2_on_cpu()
    run_ranks(_fsdp_rank, 2, tmp_path, str(tmp_path / "ckpt"), ["adafactor", "lamb", "lion", "muon"], timeout=200)


def test_adamw_over_two_meshes_steps_each_tensor_where_torch_cannot_fuse_them(tmp_path, monkeypatch):
    """Parameters on two device meshes in one group (ep's experts and tp's shards): before torch
    2.9 fused AdamW cannot take them in one call. There `auto` steps one tensor at a time (and
    matches a plain run) and an explicit fused or foreach is one line; from 2.9 nothing changes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from kiln import torch_compat

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        plain, model = TinyLM(tie=False), TinyLM(tie=False)
        model.load_state_dict(plain.state_dict())
        meshes = [DeviceMesh("cpu", [0], mesh_dim_names=(name,)) for name in ("tp", "ep")]
        names = [n for n, _ in model.named_parameters()]
        for i, name in enumerate(names):  # alternate between two one-rank meshes, as ep and tp do
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            setattr(module, attr, nn.Parameter(distribute_tensor(getattr(module, attr).detach(), meshes[i % 2],
                                                                 [Replicate()])))
        monkeypatch.setattr(torch_compat, "fused_adam_across_meshes", lambda: False)
        for impl in ("fused", "foreach"):
            with pytest.raises(ConfigError, match=f"optim.implementation='{impl}' cannot step parameters on 2 device meshes"):
                build_optimizer(model, OptimConfig(implementation=impl), "cpu")
        opt = build_optimizer(model, OptimConfig(implementation="auto"), "cpu")
        assert not opt.defaults["fused"] and not opt.defaults["foreach"]
        ref = build_optimizer(plain, OptimConfig(implementation="auto"), "cpu")
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # the same gradients for both
            for p, q in zip(model.parameters(), plain.parameters()):
                q.grad = torch.randn(q.shape, generator=gen)
                p.grad = distribute_tensor(q.grad.clone(), p.device_mesh, [Replicate()])
            opt.step()
            ref.step()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-7, msg=name)
        monkeypatch.setattr(torch_compat, "fused_adam_across_meshes", lambda: True)
        assert build_optimizer(model, OptimConfig(implementation="auto"), "cpu").defaults["fused"]
    finally:
        dist.destroy_process_group()
