"""`[parallel]` -> degrees and data-parallel mode, bad layouts as one line, and one GPU per rank."""

import pytest
import torch

from kiln.config import ParallelConfig, load_config
from kiln.errors import ConfigError
from kiln.parallel.dims import ParallelDims, pick_device


def dims(world, **cfg):
    return ParallelDims.from_config(ParallelConfig(**cfg), world_size=world, rank=0, local_rank=0,
                                    local_world_size=world)


def layout(d):
    return d.dp_mode, d.dp_replicate, d.dp_shard


def test_dp_replicate_alone_means_ddp():
    assert layout(dims(2, dp_replicate=2)) == ("ddp", 2, 1)
    assert layout(dims(8, dp_replicate=8)) == ("ddp", 8, 1)


def test_default_shards_over_every_rank():
    assert layout(dims(4)) == ("fsdp", 1, 4)
    assert layout(dims(1)) == ("fsdp", 1, 1)


def test_replicate_and_shard_is_hsdp():
    assert layout(dims(4, dp_replicate=2)) == ("fsdp", 2, 2)
    assert layout(dims(8, dp_replicate=2, dp_shard=4, dp_mode="zero2")) == ("zero2", 2, 4)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicating_modes_take_every_rank_as_a_replica(mode):
    assert layout(dims(4, dp_mode=mode)) == (mode, 4, 1)
    assert layout(dims(4, dp_mode=mode, dp_shard=1, dp_replicate=4)) == (mode, 4, 1)


@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharding_modes(mode):
    assert layout(dims(2, dp_mode=mode)) == (mode, 1, 2)


@pytest.mark.parametrize("world, cfg, names", [
    (3, {"dp_replicate": 2}, "parallel.dp_replicate"),
    (4, {"dp_shard": 3}, "parallel.dp_shard"),
    (4, {"dp_replicate": 2, "dp_shard": 4}, "parallel.dp_shard"),
    (4, {"dp_mode": "ddp", "dp_replicate": 3}, "parallel.dp_shard"),
    (3, {"tp": 2}, "parallel.cp*tp*pp"),
])
def test_impossible_layout_is_one_line_naming_the_key(world, cfg, names):
    with pytest.raises(ConfigError) as e:
        dims(world, **cfg)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_bad_mode_values_are_config_errors():
    with pytest.raises(ConfigError, match="parallel.dp_mode='zero3' is not one of"):
        load_config(overrides=["parallel.dp_mode=zero3"])
    with pytest.raises(ConfigError, match="set parallel.dp_shard=1"):
        load_config(overrides=["parallel.dp_mode=ddp", "parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match="cpu_offload=true needs a sharded dp_mode"):
        load_config(overrides=["parallel.dp_mode=zero1", "parallel.cpu_offload=true"])
    with pytest.raises(ConfigError, match="parallel.reduce_dtype"):
        load_config(overrides=["parallel.reduce_dtype=fp16"])


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_on_a_node_than_gpus_is_one_line_not_a_cuda_crash(monkeypatch, device):
    # The one-GPU machine that gave rank 1 `cuda:1` (CUDA error: invalid device ordinal).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    d = ParallelDims.from_config(ParallelConfig(), world_size=2, rank=1, local_rank=1, local_world_size=2)
    with pytest.raises(ConfigError, match=r"2 processes on this node but 1 visible GPU\(s\).*"
                                          r"--nproc-per-node=1.*train.device=cpu"):
        pick_device(device, d, device_count=1)


def test_rank_zero_of_too_many_also_refuses():
    # Rank 0 would fit, but the job cannot: every rank must fail the same way, before any work.
    d = ParallelDims.from_config(ParallelConfig(), world_size=4, rank=0, local_rank=0, local_world_size=4)
    with pytest.raises(ConfigError, match="4 processes on this node but 2 visible"):
        pick_device("cuda", d, device_count=2)


def test_one_named_gpu_for_several_ranks_and_no_gpu():
    d = ParallelDims.from_config(ParallelConfig(), world_size=2, rank=0, local_rank=0, local_world_size=2)
    with pytest.raises(ConfigError, match="names one GPU for all 2 processes"):
        pick_device("cuda:0", d, device_count=2)
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        pick_device("cuda", d, device_count=0)


def test_cpu_is_the_explicit_fallback():
    d = ParallelDims.from_config(ParallelConfig(), world_size=2, rank=1, local_rank=1, local_world_size=2)
    assert pick_device("cpu", d).type == "cpu"


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicating_modes_take_tensor_and_expert_tensor_parallelism(mode):
    d = dims(4, dp_mode=mode, tp=2)
    assert layout(d) + (d.tp,) == (mode, 2, 1, 2)
    d = dims(8, dp_mode=mode, tp=2, ep=2)  # ep carved out of the 4 replicas, experts' hidden units over tp
    assert layout(d) + (d.tp, d.ep, d.etp) == (mode, 4, 1, 2, 2, 2)
    assert layout(dims(8, dp_mode=mode, tp=2, cp=2)) == (mode, 2, 1)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_replicating_modes_take_tp_and_pp_together(mode):
    d = dims(8, dp_mode=mode, tp=2, pp=2)  # kiln's replicas of the stage chunks' local shards (pipeline.py)
    assert layout(d) + (d.tp, d.pp) == (mode, 2, 1, 2, 2)
    d = dims(8, dp_mode=mode, tp=2, pp=2, ep=2)  # experts over the 2 replicas, their hidden units over tp
    assert layout(d) + (d.tp, d.pp, d.ep, d.etp) == (mode, 2, 1, 2, 2, 2, 2)


@pytest.mark.parametrize("optimizer", ["lamb", "muon", "adafactor"])
def test_zero1_with_tp_takes_an_optimizer_that_is_not_elementwise(optimizer):
    # ZeRO-1 steps such a tp shard as its DTensor (kiln/parallel/zero1.py; tests/parallel/test_zero1_tp.py)
    cfg = load_config(None, ["model.dim=32", "model.n_heads=4", "data.seq_len=32", f"optim.name='{optimizer}'"])
    for mode in ("zero1", "ddp"):
        dims(4, dp_mode=mode, tp=2).check_model(cfg)


def test_compile_with_cp_is_refused_where_dynamo_cannot_compile_ring_attention(monkeypatch):
    from kiln import torch_compat

    cfg = load_config(None, ["model.dim=32", "model.n_heads=4", "data.seq_len=32", "train.compile=true"])
    monkeypatch.setattr(torch_compat, "dynamo_traces_ring_objects", lambda: False)
    with pytest.raises(ConfigError, match=r"train.compile=true with parallel.cp=2 needs a torch whose dynamo "
                                          r"compiles context-parallel attention .*set train.compile=false"):
        dims(2, dp_mode="ddp", cp=2).check_model(cfg)
    dims(2, dp_mode="ddp", tp=2).check_model(cfg)  # compile without cp is not concerned
    cfg.train.compile = False
    dims(2, dp_mode="ddp", cp=2).check_model(cfg)
    monkeypatch.setattr(torch_compat, "dynamo_traces_ring_objects", lambda: True)
    cfg.train.compile = True
    dims(2, dp_mode="ddp", cp=2).check_model(cfg)


def test_compile_with_ep_is_refused_where_dynamo_cannot_compile_the_experts_gradient_hook(monkeypatch):
    from kiln import torch_compat

    cfg = load_config(None, ["model.moe_experts=4", "train.compile=true"])
    monkeypatch.setattr(torch_compat, "dynamo_traces_data_dependent_splits", lambda: True)
    monkeypatch.setattr(torch_compat, "dynamo_traces_intermediate_hooks", lambda: False)
    with pytest.raises(ConfigError, match=r"train.compile=true with parallel.ep=2 needs a torch whose dynamo compiles "
                                          r"a gradient hook .*set train.compile=false or parallel.ep=1"):
        dims(2, dp_mode="ddp", ep=2).check_model(cfg)
    dims(2, dp_mode="ddp").check_model(cfg)  # compiled MoE without ep is not concerned
    cfg.train.compile = False
    dims(2, dp_mode="ddp", ep=2).check_model(cfg)
    monkeypatch.setattr(torch_compat, "dynamo_traces_intermediate_hooks", lambda: True)
    cfg.train.compile = True
    dims(2, dp_mode="ddp", ep=2).check_model(cfg)


def test_the_hook_probe_says_what_dynamo_does():
    """kiln's MoE registers its gradient hook inside the compiled block under ep (moe.py `_local`):
    where the probe says dynamo can, compiling such a hook works; where not, it is refused."""
    import torch

    from kiln import torch_compat

    def hooked(w):
        local = w * 1
        local.register_hook(lambda grad: grad * 3)
        return (local * 2).sum()

    w = torch.ones(3, requires_grad=True)
    if torch_compat.dynamo_traces_intermediate_hooks():
        torch.compile(hooked, fullgraph=True, backend="eager")(w).backward()
        assert w.grad.tolist() == [6.0] * 3  # the hook ran on the intermediate's gradient
    else:
        with pytest.raises(Exception, match="intermediate hooks"):
            torch.compile(hooked, fullgraph=True, backend="eager")(w)


def test_compile_with_moe_is_refused_where_dynamo_cannot_compile_the_expert_loop(monkeypatch):
    from kiln import torch_compat

    cfg = load_config(None, ["model.moe_experts=4", "train.compile=true"])
    monkeypatch.setattr(torch_compat, "dynamo_traces_data_dependent_splits", lambda: False)
    with pytest.raises(ConfigError, match=r"train.compile=true with model.moe_experts=4 needs a torch whose "
                                          r"dynamo compiles the per-expert loop .*set train.compile=false"):
        dims(1).check_model(cfg)
    cfg.train.compile = False
    dims(1).check_model(cfg)


def test_fsdp_over_experts_split_on_ep_and_tp_is_refused_where_fsdp2_takes_1d_dtensors_only(monkeypatch):
    from kiln import torch_compat

    cfg = load_config(None, ["model.moe_experts=4", "model.n_heads=4"])
    monkeypatch.setattr(torch_compat, "fsdp_shards_2d_dtensors", lambda: False)
    for mode in ("fsdp", "zero2"):
        with pytest.raises(ConfigError, match=rf"parallel.ep=2 with parallel.tp=2 under parallel.dp_mode='{mode}' "
                                              r"shards each expert over ep and tp, which this torch's FSDP2 cannot "
                                              r"shard again .*set parallel.etp=1"):
            dims(4, dp_mode=mode, ep=2, tp=2).check_model(cfg)
    dims(4, dp_mode="fsdp", ep=2, tp=2, etp=1).check_model(cfg)  # whole experts, ep borrowing tp: 1-D
    dims(4, dp_mode="ddp", ep=2, tp=2).check_model(cfg)  # no FSDP over the experts
    dims(4, dp_mode="fsdp", ep=2).check_model(cfg)  # no tp
    monkeypatch.setattr(torch_compat, "fsdp_shards_2d_dtensors", lambda: True)
    dims(4, dp_mode="fsdp", ep=2, tp=2).check_model(cfg)


def test_float8_with_tp_is_refused_where_dtensor_cannot_take_float8_scales(monkeypatch):
    from kiln import torch_compat

    cfg = load_config(None, ["model.n_heads=4", "train.float8=true"])
    monkeypatch.setattr(torch_compat, "dtensor_takes_float8_scales", lambda: False)
    with pytest.raises(ConfigError, match=r"^train.float8=true with parallel.tp=2 needs torch >= 2.7 .*set "
                                          r"parallel.tp=1 or train.float8=false$"):
        dims(2, tp=2).check_model(cfg)
    dims(2).check_model(cfg)  # no tp: float8 alone is not this check's
    monkeypatch.setattr(torch_compat, "dtensor_takes_float8_scales", lambda: True)
    dims(2, tp=2).check_model(cfg)


@pytest.mark.parametrize("world, cfg", [
    (4, {"fsdp_reshard_to": 2}),  # backward gathers over 2 of the 4 shard ranks
    (8, {"fsdp_reshard_to": 2, "dp_replicate": 2}),  # HSDP: within each replica's 4 shard ranks
    (8, {"fsdp_reshard_to": 4, "cp": 2}),  # FSDP shards over dp_shard x cp = 4 x 2
    (4, {"fsdp_reshard_to": 4}),  # all of them: plain ZeRO-3
])
def test_fsdp_reshard_to_divides_the_shard_ranks(world, cfg):
    assert dims(world, **cfg).dp_mode == "fsdp"


@pytest.mark.parametrize("world, cfg, expected", [
    (4, {"fsdp_reshard_to": 3}, "parallel.fsdp_reshard_to=3 must divide dp_shard x cp = 4 (the ranks FSDP shards "
                                "over) and be at least 2"),
    (4, {"fsdp_reshard_to": 1}, "parallel.fsdp_reshard_to=1 must divide dp_shard x cp = 4"),
    (8, {"fsdp_reshard_to": 4, "dp_replicate": 4}, "parallel.fsdp_reshard_to=4 must divide dp_shard x cp = 2"),
    (4, {"fsdp_reshard_to": 2, "dp_mode": "zero2"}, "parallel.fsdp_reshard_to=2 reshards FSDP's parameters after "
                                                    "forward, which parallel.dp_mode='zero2' does not"),
    (4, {"fsdp_reshard_to": 2, "dp_replicate": 4}, "which parallel.dp_mode='ddp' does not"),  # auto -> ddp
    (8, {"fsdp_reshard_to": 2, "pp": 2, "pp_schedule": "zbv_zero_bubble", "pp_virtual_stages": 2},
     "parallel.fsdp_reshard_to=2 has no effect with parallel.pp_schedule='zbv_zero_bubble'"),
    # FSDP's mesh one of several: torch's FSDP2 would hang creating its resharding groups
    (8, {"fsdp_reshard_to": 2, "tp": 2}, "parallel.fsdp_reshard_to=2 with parallel.tp=2 is not supported: torch's "
                                         "FSDP2 creates its resharding groups among the ranks of one FSDP mesh"),
    (8, {"fsdp_reshard_to": 2, "pp": 2}, "parallel.fsdp_reshard_to=2 with parallel.pp=2 is not supported"),
    (8, {"fsdp_reshard_to": 2, "dp_replicate": 2, "diloco_inner_steps": 4, "dp_mode": "fsdp"},
     "parallel.fsdp_reshard_to=2 with parallel.diloco_inner_steps=4 with dp_replicate=2 is not supported"),
])
def test_fsdp_reshard_to_that_cannot_apply_is_one_line(world, cfg, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
        dims(world, **cfg)
    assert "\n" not in str(e.value)


def test_node_crossings_name_tp_and_ulysses_groups_that_span_nodes():
    """Advice lines (the layout still runs) where tp's or Ulysses' groups, laid out consecutively
    (tp innermost, then cp), cross nodes of LOCAL_WORLD_SIZE ranks."""
    def dims(local, **parallel):
        return ParallelDims.from_config(ParallelConfig(**parallel), world_size=32, rank=0, local_rank=0,
                                        local_world_size=local, seq_len=4096)

    assert dims(8, tp=8).node_crossings(32) == [] and dims(32, tp=16).node_crossings(32) == []
    (line,) = dims(8, tp=16).node_crossings(32)
    assert line.startswith("parallel.tp=16 spans nodes of 8 ranks (LOCAL_WORLD_SIZE)")
    assert dims(8, tp=2, cp=4, cp_mode="ulysses").node_crossings(32) == []  # 4 x 2 ranks: one node
    (line,) = dims(8, tp=2, cp=8, cp_mode="ulysses").node_crossings(32)
    assert line == ("parallel.cp_mode='ulysses' over 8 cp ranks x parallel.tp=2 spans nodes of 8 ranks "
                    "(LOCAL_WORLD_SIZE): its all-to-alls, four a layer, cross the link between nodes; "
                    "parallel.ulysses_degree=4 keeps them inside a node (the ring across)")
    assert dims(8, tp=2, cp=8, cp_mode="ulysses", ulysses_degree=4).node_crossings(32) == []
    (line,) = dims(4, tp=4, cp=8, cp_mode="ulysses").node_crossings(32)  # no degree fits a node beside tp 4
    assert line.endswith("parallel.cp_mode='ring' passes K/V between neighbours instead")
    assert dims(8, tp=2, cp=8).node_crossings(32) == []  # the ring: point to point between neighbours
    (line,) = dims(8, tp=2, cp=8, cp_mode="ulysses").node_crossings(20)  # 10 heads a tp rank: 4 does not divide
    assert line.endswith("parallel.ulysses_degree=2 keeps them inside a node (the ring across)")
