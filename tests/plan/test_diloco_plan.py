"""kiln plan with DiLoCo (kiln/plan/diloco.py): one replica per island, a replica's own layout
costed as any layout, plus the outer state and the outer step's share of each step."""

import dataclasses

import pytest

from kiln.cli import main
from kiln.config import JobConfig, load_config
from kiln.errors import ConfigError, KilnError
from kiln.plan.cluster import load_cluster
from kiln.plan.diloco import OUTER_STEP_BYTES, check_islands, outer_sync_seconds, replica_cluster
from kiln.plan.memory import Layout, ModelShape, rank_memory
from kiln.plan.timing import step_time

SHAPE = ModelShape(dim=1024, n_layers=8, n_heads=16, kv_dim=1024, ffn=2816, gated=True, vocab=32000, tied=False)


def _islands(islands=2, nodes=4, **kw):
    cluster = load_cluster("h100", nodes=nodes, islands=islands)
    return dataclasses.replace(cluster, **kw)


def test_a_diloco_layout_costs_one_replica_plus_the_outer_state_and_the_outer_step_share():
    cluster = _islands()  # 2 islands of 2 nodes x 8 GPUs
    layout = Layout(dp_replicate=2, dp_shard=8, pp=2, dp_mode="fsdp", micro_batch=4, grad_accum=4,
                    diloco_inner_steps=10)
    replica = layout.replica
    assert (replica.dp_replicate, replica.dp_shard, replica.pp, replica.world_size) == (1, 8, 2, 16)

    mem, alone = rank_memory(SHAPE, layout, 2048), rank_memory(SHAPE, replica, 2048)
    assert mem.outer_state == 2 * alone.parameters > 0  # the fp32 anchor and momentum, sharded like the weights
    assert mem.total == pytest.approx(alone.total + mem.outer_state)

    t = step_time(SHAPE, layout, 2048, cluster)
    island = dataclasses.replace(cluster, nodes=2, islands=1)
    inner = step_time(SHAPE, replica, 2048, island)
    shard = alone.parameters
    by_hand = (2 * (2 - 1) / 2 * max(shard / 50e9, shard * 16 / 1.25e9) + 2 * (2 - 1) * 10e-3
               + OUTER_STEP_BYTES * shard / 4 / 3350e9)
    assert t.outer_sync == pytest.approx(by_hand / 10)
    assert t.total == pytest.approx(inner.total + by_hand / 10)
    assert t.flops == pytest.approx(2 * inner.flops)  # both replicas' work, for MFU over all GPUs


def test_the_outer_share_falls_with_h_and_rises_with_a_slower_island_link():
    layout = Layout(dp_replicate=2, dp_shard=16, dp_mode="fsdp", micro_batch=4, diloco_inner_steps=10)
    base = step_time(SHAPE, layout, 2048, _islands()).outer_sync
    rarer = step_time(SHAPE, dataclasses.replace(layout, diloco_inner_steps=100), 2048, _islands()).outer_sync
    slower = step_time(SHAPE, layout, 2048, _islands(island_link_gbps=0.125)).outer_sync
    assert rarer == pytest.approx(base / 10)
    assert slower > 5 * base
    # four islands: each moves 2 (R-1)/R = 1.5 of its replica's bytes instead of 1
    four = _islands(islands=4, nodes=4)
    wide = Layout(dp_replicate=4, dp_shard=8, dp_mode="fsdp", micro_batch=4, diloco_inner_steps=10)
    assert step_time(SHAPE, wide, 2048, four).outer_sync > base


def test_streaming_diloco_splits_the_sync_into_fragments_and_hides_the_exchange_behind_inner_steps():
    # Streaming DiLoCo (kiln/parallel/diloco.py): P fragments each every H steps (one sync every H / P
    # steps of 1/P of the parameters), the outer gradient in bf16, each exchange under tau inner steps.
    cluster = _islands()
    layout = Layout(dp_replicate=2, dp_shard=8, pp=2, dp_mode="fsdp", micro_batch=4, grad_accum=4,
                    diloco_inner_steps=10)
    shard = rank_memory(SHAPE, layout.replica, 2048).parameters
    inner = step_time(SHAPE, layout.replica, 2048, dataclasses.replace(cluster, nodes=2, islands=1)).total

    def exchange(sent):  # one sync's all-reduce across the 2 islands, 16 ranks per island
        return 2 * (2 - 1) / 2 * max(sent / 50e9, sent * 16 / 1.25e9) + 2 * (2 - 1) * 10e-3

    def local(fragment):  # the outer step's memory traffic over one fragment
        return OUTER_STEP_BYTES * fragment / 4 / 3350e9

    streamed = dataclasses.replace(layout, diloco_fragments=2, diloco_wire_bytes=2)
    by_hand = 2 * (exchange(shard / 2 / 2) + local(shard / 2)) / 10  # 2 syncs per 10 steps, bf16 half the bytes
    assert step_time(SHAPE, streamed, 2048, cluster).outer_sync == pytest.approx(by_hand)
    assert by_hand < step_time(SHAPE, layout, 2048, cluster).outer_sync
    overlapped = dataclasses.replace(streamed, diloco_sync_delay=1)
    hidden = max(0.0, exchange(shard / 4) - inner)
    assert step_time(SHAPE, overlapped, 2048, cluster).outer_sync == pytest.approx(2 * (hidden + local(shard / 2)) / 10)
    slow = _islands(island_link_gbps=0.05)  # an exchange longer than an inner step: only the rest shows
    assert step_time(SHAPE, overlapped, 2048, slow).outer_sync < step_time(SHAPE, streamed, 2048, slow).outer_sync
    # memory: the exchange buffer of one fragment (bf16) lives on under the delay
    assert rank_memory(SHAPE, overlapped, 2048).outer_state == pytest.approx(2 * shard + shard / 2 / 2)
    assert rank_memory(SHAPE, streamed, 2048).outer_state == pytest.approx(2 * shard)
    assert "fragments=2 sync_delay=1 wire_bytes=2" in overlapped.describe()
    # float8: every replica's block-scaled bytes all-gathered (R - 1 payloads, R - 1 latency steps)
    fp8 = dataclasses.replace(streamed, diloco_wire_bytes=1)
    sent = shard / 2 * (1 + 4 / 256) / 4
    gathered = (2 - 1) * max(sent / 50e9, sent * 16 / 1.25e9) + (2 - 1) * 10e-3
    assert step_time(SHAPE, fp8, 2048, cluster).outer_sync == pytest.approx(2 * (gathered + local(shard / 2)) / 10)
    delayed_fp8 = dataclasses.replace(fp8, diloco_sync_delay=1)  # the gathered buffer: both replicas' bytes
    assert rank_memory(SHAPE, delayed_fp8, 2048).outer_state == pytest.approx(2 * shard + 2 * shard / 2 / 4)


def test_without_islands_the_replicas_sync_over_the_link_their_group_spans():
    cluster = load_cluster("h100", nodes=2)
    layout = Layout(dp_replicate=2, dp_shard=8, dp_mode="fsdp", micro_batch=4, diloco_inner_steps=4)
    assert replica_cluster(cluster, layout).nodes == 1  # a replica fills one node
    shard = rank_memory(SHAPE, layout, 2048).parameters
    step = OUTER_STEP_BYTES * shard / 4 / 3350e9
    # replicas of 8 ranks: each rank's pair is a node apart (InfiniBand); of 4 ranks: in one node (NVLink)
    assert outer_sync_seconds(cluster, layout, shard) == pytest.approx(shard / 50e9 + 2 * 8e-6 + step)
    in_one_node = dataclasses.replace(layout, dp_shard=4)
    assert outer_sync_seconds(cluster, in_one_node, shard) == pytest.approx(shard / 450e9 + 2 * 3e-6 + step)
    with pytest.raises(KilnError, match="one replica on each island"):
        replica_cluster(_islands(), dataclasses.replace(layout, dp_replicate=4, dp_shard=4))


def test_replicas_sharing_a_cpu_node_share_its_cores():
    """4 CPU processes on 2 cores, 2 replicas of 2 ranks: each replica's ranks compute at half a
    core, as the whole layout's would (a replica's own world size alone would give them a core
    each: the first diloco_ddp x4 validation predicted its step 53% short)."""
    from kiln.plan.timing import compute_share

    cpu = load_cluster("cpu-local")
    cpu.cores_per_node, cpu.gpus_per_node = 2.0, 4
    two_of_two = Layout(dp_replicate=2, dp_shard=2, dp_mode="ddp", micro_batch=2, diloco_inner_steps=8)
    assert compute_share(replica_cluster(cpu, two_of_two), two_of_two.replica) == 0.5
    assert compute_share(cpu, dataclasses.replace(two_of_two, diloco_inner_steps=0)) == 0.5
    one_each = Layout(dp_replicate=2, dp_shard=1, dp_mode="ddp", micro_batch=2, diloco_inner_steps=8)
    assert compute_share(replica_cluster(cpu, one_each), one_each.replica) == 1.0  # 2 processes, 2 cores
    gpu = load_cluster("h100")  # devices, not shared cores: unchanged
    assert replica_cluster(gpu, two_of_two).cores_per_node == gpu.cores_per_node


def test_the_outer_state_is_what_kilns_diloco_keeps():
    import torch

    from kiln.model.transformer import Transformer
    from kiln.parallel.diloco import DiLoCo

    cfg = JobConfig()
    cfg.model.vocab_size, cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 64, 32, 2, 2
    model = Transformer(cfg.model)
    diloco = DiLoCo(model, inner_steps=3)
    kept = sum(t.numel() * t.element_size() for t in diloco.anchors() + diloco.momenta())
    layout = Layout(micro_batch=1, precision="fp32", diloco_inner_steps=3)
    assert rank_memory(ModelShape.from_config(cfg.model, 64), layout, 16).outer_state == kept
    assert all(a.dtype == torch.float32 for a in diloco.anchors())


def test_search_lays_out_one_replica_per_island_as_kiln_runs_it():
    from kiln.parallel.dims import ParallelDims
    from kiln.plan.search import config_for_plan, kiln_refusal, search

    cluster = _islands(nodes=2, gpus_per_node=4)  # 2 islands of 1 node x 4 GPUs
    plans = search(SHAPE, cluster, 2048, 64, diloco_inner_steps=16, max_cp=1)
    assert plans
    cfg = JobConfig()
    cfg.parallel.diloco_inner_steps = 16
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.vocab_size = 1024, 8, 16, 32000
    cfg.model.ffn_hidden, cfg.data.seq_len, cfg.model.max_seq_len = 2816, 2048, 2048
    for plan in plans:
        lay = plan.layout
        assert lay.diloco_inner_steps == 16 and lay.dp_replicate == 2 and lay.world_size == 8
        assert lay.dp_mode in ("ddp", "zero1", "zero2", "fsdp")  # inside a replica: never HSDP
        assert plan.memory.outer_state > 0 and plan.time.outer_sync > 0
        assert lay.micro_batch * lay.grad_accum * lay.replica.dp * 2 == 64  # the global batch over both replicas
    best = plans[0].layout
    assert kiln_refusal(cfg, best, 8) is None
    run = config_for_plan(cfg, best)
    dims = ParallelDims.from_config(run.parallel, world_size=8, rank=0, local_rank=0, local_world_size=4,
                                    seq_len=2048)
    assert dims.diloco and (dims.dp_replicate, dims.dp_shard) == (2, best.dp_shard)
    with pytest.raises(KilnError, match="cannot be split over 2 DiLoCo replicas"):
        search(SHAPE, cluster, 2048, 63, diloco_inner_steps=16)


def test_islands_and_diloco_go_together_or_are_refused_in_one_line():
    assert check_islands(load_cluster("h100"), 0) == 1 and check_islands(_islands(), 8) == 2
    with pytest.raises(KilnError, match=r"parallel.diloco_inner_steps=8: kiln plan puts one DiLoCo replica on each "
                                        r"island .* has one island; set `islands`"):
        check_islands(load_cluster("h100"), 8)
    with pytest.raises(KilnError, match=r"islands=2: kiln plan models training across islands only as DiLoCo"):
        check_islands(_islands(), 0)
    with pytest.raises(ConfigError, match=r"islands=3 must divide nodes=4"):
        load_cluster("h100", nodes=4, islands=3)
    with pytest.raises(ConfigError, match=r"--islands 0 must be >= 1"):
        load_cluster("h100", islands=0)


def test_a_cluster_file_with_a_bad_island_key_names_it(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("nodes = 4\nislands = 2\nisland_link_gbps = -1.0\n")
    with pytest.raises(ConfigError, match=r"c.toml: island_link_gbps=-1.0 must be > 0"):
        load_cluster(str(path))
    path.write_text("nodes = 3\nislands = 2\n")
    with pytest.raises(ConfigError, match=r"c.toml: islands=2 must divide nodes=3"):
        load_cluster(str(path))


def test_kiln_train_counts_the_outer_state_in_its_memory_check():
    from kiln.train.memory import estimate_train_bytes, layout_of

    cfg = JobConfig()
    plain = estimate_train_bytes(cfg)
    cfg.parallel.diloco_inner_steps = 4
    assert layout_of(cfg).diloco_inner_steps == 4
    params = rank_memory(ModelShape.from_config(cfg.model, cfg.data.vocab_size), layout_of(cfg), cfg.data.seq_len)
    assert estimate_train_bytes(cfg) == pytest.approx(plain + params.outer_state, abs=1)


def test_plan_command_writes_a_diloco_config_kiln_train_reads(tmp_path, capsys):
    cluster = tmp_path / "islands.toml"
    cluster.write_text('name = "two-sites"\nnodes = 2\ngpus_per_node = 4\nislands = 2\nisland_link_gbps = 2.5\n')
    out = tmp_path / "plan.toml"
    rc = main(["plan", "--cluster", str(cluster), "--set", "parallel.diloco_inner_steps=50", "--global-batch", "32",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "DiLoCo: 2 replicas, one per island of 1 nodes; every 50 steps" in text
    assert "bubble   outer" in text  # the outer step's share of each step has its own column
    cfg = load_config(out)
    assert cfg.parallel.diloco_inner_steps == 50 and cfg.parallel.dp_replicate == 2
    world = cfg.parallel.dp_replicate * cfg.parallel.dp_shard * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    assert world == 8

    rc = main(["plan", "--cluster", str(cluster), "--set", "parallel.diloco_inner_steps=50", "--global-batch", "32",
               "--set", "parallel.diloco_fragments=2", "--set", "parallel.diloco_sync_delay=2", "--set",
               "parallel.diloco_comm_dtype='bfloat16'", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "every 25 steps each rank exchanges" in text and "(1/2 of its bf16 outer gradient)" in text
    assert "under 2 inner steps" in text and "fragments=2 sync_delay=2 wire_bytes=2" in text
    assert load_config(out).parallel.diloco_fragments == 2  # the config keeps the user's streaming settings

    rc = main(["plan", "--cluster", str(cluster), "--islands", "1", "--set", "parallel.diloco_inner_steps=50",
               "--out", str(tmp_path / "p.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "has one island" in err[0] and not (tmp_path / "p.toml").exists()
    rc = main(["plan", "--cluster", str(cluster), "--out", str(tmp_path / "p.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "only as DiLoCo replicas" in err[0]


def test_calibrating_on_a_diloco_run_is_refused_in_one_line(tmp_path):
    from kiln.config import to_toml
    from kiln.plan.calibrate import measured_run

    cfg = JobConfig()
    cfg.parallel.diloco_inner_steps = 4
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    with pytest.raises(KilnError, match=r"a DiLoCo run \(parallel.diloco_inner_steps=4\) cannot calibrate"):
        measured_run(tmp_path)


def test_replicas_of_ddp_or_zero1_inside_are_searched_and_kiln_runs_their_configs():
    # A replica may be DDP or ZeRO-1 over its data-parallel ranks as well as FSDP (dims.diloco_layout);
    # every layout the search proposes is one kiln's dims resolve to the same degrees.
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims
    from kiln.plan.search import enumerate_layouts

    cluster = _islands(islands=2, nodes=2)
    layouts = list(enumerate_layouts(SHAPE, cluster, 1024, 64, "bf16", ac_choices=("none",), diloco_inner_steps=8))
    inside = {(lay.dp_mode, lay.dp_shard) for lay in layouts if lay.tp == lay.pp == lay.cp == 1}
    assert {("ddp", 8), ("zero1", 8), ("zero2", 8), ("fsdp", 8)} <= inside
    for lay in layouts:
        assert lay.dp_replicate == 2 and lay.diloco_inner_steps == 8
        cfg = ParallelConfig(dp_mode=lay.dp_mode, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp,
                             pp=lay.pp, cp=lay.cp, diloco_inner_steps=8)
        cfg.validate()
        dims = ParallelDims.from_config(cfg, world_size=cluster.world_size, rank=0)
        assert (dims.dp_replicate, dims.dp_shard, dims.dp_mode) == (2, lay.dp_shard, lay.dp_mode)
    # zero-bubble schedules are proposed under FSDP replicas only, not DDP / ZeRO-1 over several ranks
    assert not [lay for lay in layouts if lay.dp_mode in ("ddp", "zero1") and lay.dp_shard * lay.cp > 1
                and "zero_bubble" in lay.schedule]


def test_replicas_holding_the_same_parameters_split_the_outer_all_reduce():
    # ddp/zero1 inside a replica: its 8 ranks each send 1/8 across the islands, then all-gather the
    # average inside the island (kiln/parallel/diloco.py replicated_group); fsdp's shards are 1/8 already.
    from kiln.plan.comm_cost import all_gather
    from kiln.plan.diloco import replicated_ranks

    cluster = _islands(islands=2, nodes=2)  # 2 islands of 1 node x 8 GPUs
    ddp = Layout(dp_replicate=2, dp_shard=8, dp_mode="ddp", micro_batch=4, diloco_inner_steps=10)
    fsdp = dataclasses.replace(ddp, dp_mode="fsdp")
    assert replicated_ranks(ddp) == replicated_ranks(dataclasses.replace(ddp, dp_mode="zero1")) == 8
    assert replicated_ranks(fsdp) == replicated_ranks(dataclasses.replace(ddp, ep=2)) == 1
    whole = rank_memory(SHAPE, ddp.replica, 2048).parameters
    step = (16 + 32 / 8) * whole / 4 / 3350e9  # flatten and reset the whole; delta and SGD step on 1/8
    # each rank keeps 1/8 of the anchor and momentum (fsdp: of its 1/8 shard, all of it)
    assert rank_memory(SHAPE, ddp, 2048).outer_state == pytest.approx(2 * whole / 8)
    assert rank_memory(SHAPE, fsdp, 2048).outer_state == pytest.approx(2 * rank_memory(SHAPE, fsdp.replica,
                                                                                       2048).parameters)
    sent = whole / 8
    by_hand = (2 * (2 - 1) / 2 * max(sent / 50e9, sent * 8 / 1.25e9) + 2 * (2 - 1) * 10e-3
               + all_gather(cluster, 8, whole) + step)
    assert outer_sync_seconds(cluster, ddp, whole) == pytest.approx(by_hand)
    # across the island link the same bytes as fsdp's replica (each rank 1/8 of the parameters)
    fsdp_shard = rank_memory(SHAPE, fsdp.replica, 2048).parameters
    assert fsdp_shard == pytest.approx(sent)
