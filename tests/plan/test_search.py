import pytest

from kiln.config import ModelConfig, load_config
from kiln.errors import ConfigError, KilnError
from kiln.plan.cluster import load_cluster, preset_names
from kiln.plan.interval import interval_steps, young_daly_interval
from kiln.plan.memory import Layout, ModelShape
from kiln.plan.search import config_for_plan, enumerate_layouts, model_for_params, plan_toml, search
from kiln.plan.timing import all_reduce, bubble_fraction, step_time

LLAMA3_8B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=8192,
                        vocab_size=128256)


def test_presets_load_and_bad_names_say_what_exists(tmp_path):
    assert {"a100", "h100", "h200"} <= set(preset_names())
    assert load_cluster("h200", nodes=4).world_size == 32
    with pytest.raises(ConfigError, match="unknown cluster 'b300'; presets: a100"):
        load_cluster("b300")
    bad = tmp_path / "c.toml"
    bad.write_text('[device]\nmemory_gib = -1\n')
    with pytest.raises(ConfigError, match="device.memory_gib=-1"):
        load_cluster(str(bad))
    bad.write_text('[inter_node]\ntopology = "torus"\n')
    with pytest.raises(ConfigError, match="inter_node.topology='torus' is not one of"):
        load_cluster(str(bad))
    bad.write_text('gpus = 8\n')
    with pytest.raises(ConfigError, match="unknown key gpus"):
        load_cluster(str(bad))


def test_alpha_beta_collectives():
    c = load_cluster("h100", nodes=2)
    one_node = all_reduce(c, 8, 1e9)
    two_nodes = all_reduce(c, 16, 1e9)
    assert two_nodes > 5 * one_node  # 50 GB/s NICs against 450 GB/s NVLink
    c.inter_node.in_network_reduction = True
    assert all_reduce(c, 16, 1e9) < 0.6 * two_nodes  # SHARP moves each byte once
    assert bubble_fraction(Layout(pp=4, grad_accum=8)) == 3 / 8
    assert bubble_fraction(Layout(pp=4, grad_accum=8, schedule="interleaved_1f1b", virtual_stages=2)) == 3 / 16


def test_best_plan_fits_and_beats_every_other_valid_layout():
    c = load_cluster("h100", nodes=2)
    shape = ModelShape.from_config(LLAMA3_8B, 128256)
    plans = search(shape, c, 4096, 128)
    assert all(p.memory.total <= c.device.usable_bytes for p in plans)
    assert [p.time.total for p in plans] == sorted(p.time.total for p in plans)
    from kiln.plan.memory import rank_memory

    fitting = [step_time(shape, lay, 4096, c).total for lay in enumerate_layouts(shape, c, 4096, 128, "bf16")
               if rank_memory(shape, lay, 4096).total <= c.device.usable_bytes]
    assert plans[0].time.total <= min(fitting)  # the AC planner's finer settings can only help
    assert 0.2 < plans[0].time.mfu(c, "bf16", 16) < 0.7


def test_nothing_fits_says_what_would():
    c = load_cluster("a100", nodes=1)
    huge = ModelConfig(dim=16384, n_layers=126, n_heads=128, max_seq_len=4096, vocab_size=128256)
    with pytest.raises(KilnError, match=r"nothing fits: .* needs [\d,.]+ GiB per GPU.*try about \d+ GPUs \(--nodes \d+\)"):
        search(ModelShape.from_config(huge, 128256), c, 4096, 64)
    with pytest.raises(KilnError, match="no float8 tensor cores"):
        search(ModelShape.from_config(LLAMA3_8B, 128256), c, 4096, 64, precision="float8")


def test_written_plan_is_a_valid_train_config(tmp_path):
    cfg = load_config(None, ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "data.seq_len=64",
                             "model.max_seq_len=64"])
    c = load_cluster("cpu-local")
    c.gpus_per_node = 2
    plans = search(ModelShape.from_config(cfg.model, 4096), c, 64, 8, precision="fp32")
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(cfg, plans[0]))
    got = load_config(path)
    lay = plans[0].layout
    assert (got.parallel.dp_replicate * got.parallel.dp_shard * got.parallel.tp * got.parallel.pp * got.parallel.cp
            == 2)
    assert got.train.batch_size == lay.micro_batch and got.train.activation_checkpointing == lay.ac
    assert config_for_plan(cfg, Layout(precision="float8")).train.float8


def test_model_for_params_hits_the_target():
    for n in (1e7, 1.2e8, 7e9, 7e10):
        m = model_for_params(n, 32000, 2048)
        got = ModelShape.from_config(m, 32000).params
        assert 0.8 < got / n < 1.25 and m.dim % m.n_heads == 0


def test_young_daly():
    assert young_daly_interval(60, 86400, method="young") == pytest.approx((2 * 60 * 86400) ** 0.5)
    daly = young_daly_interval(60, 86400)
    assert 0.95 * (2 * 60 * 86400) ** 0.5 < daly < (2 * 60 * 86400) ** 0.5 * 1.05
    assert young_daly_interval(100, 10) == 10  # saving takes longer than failures allow
    assert interval_steps(60, 86400, 2.0) == round(daly / 2.0)
    for bad in (0, -1, float("nan")):
        with pytest.raises(KilnError):
            young_daly_interval(bad, 86400)


def test_ac_planner_picks_the_least_recompute_that_fits():
    from kiln.plan.ac import plan_activation_checkpointing
    from kiln.plan.memory import rank_memory, recomputed_blocks

    shape = ModelShape.from_config(LLAMA3_8B, 128256)
    lay = Layout(dp_shard=8, dp_mode="fsdp", micro_batch=4, precision="bf16")
    none = rank_memory(shape, lay, 8192).total
    full = rank_memory(shape, Layout(**{**lay.__dict__, "ac": "full"}), 8192).total
    assert plan_activation_checkpointing(shape, lay, 8192, none)[0] == "none"
    budget = 0.75 * none + 0.25 * full  # every_k:2 (16 of 32 blocks) is too much; a larger K suffices
    ac, mem = plan_activation_checkpointing(shape, lay, 8192, budget)
    assert ac.startswith("every_k:") and mem.total <= budget
    k = int(ac.split(":")[1])
    fewer = next(j for j in range(k + 1, 33) if recomputed_blocks(f"every_k:{j}", 32) < recomputed_blocks(ac, 32))
    assert rank_memory(shape, Layout(**{**lay.__dict__, "ac": f"every_k:{fewer}"}), 8192).total > budget
    with pytest.raises(KilnError, match="even with every block recomputed"):
        plan_activation_checkpointing(shape, lay, 8192, full / 2)


def test_ac_planner_takes_op_checkpointing_where_it_fits_and_is_predicted_faster():
    """"op" (every block keeps its matmul and attention outputs) against the least every_k that
    fits, by the step-time model; never without one, or where it does not fit."""
    import dataclasses

    from kiln.plan.ac import plan_activation_checkpointing
    from kiln.plan.cluster import Cluster
    from kiln.plan.memory import rank_memory
    from kiln.plan.timing import step_time

    shape = ModelShape.from_config(LLAMA3_8B, 128256)
    lay = Layout(dp_shard=8, dp_mode="fsdp", micro_batch=2, precision="bf16")

    def seconds(ac):
        return step_time(shape, dataclasses.replace(lay, ac=ac), 8192, Cluster()).total

    def memory(ac):
        return rank_memory(shape, dataclasses.replace(lay, ac=ac), 8192).total

    assert memory("full") < memory("op") < memory("every_k:4") < memory("none")
    assert seconds("none") < seconds("op") < seconds("every_k:4") < seconds("full")  # cheap ops only, again
    budget = memory("every_k:4") * 1.01
    assert plan_activation_checkpointing(shape, lay, 8192, budget, step_seconds=seconds)[0] == "op"
    assert plan_activation_checkpointing(shape, lay, 8192, budget)[0].startswith("every_k:")  # no time model
    slower = plan_activation_checkpointing(shape, lay, 8192, budget, step_seconds=lambda ac: 2.0 if ac == "op" else 1.0)
    assert slower[0].startswith("every_k:")
    tight = memory("op") * 0.99  # op does not fit; recomputing more blocks does
    ac, mem = plan_activation_checkpointing(shape, lay, 8192, tight, step_seconds=seconds)
    assert ac != "op" and mem.total <= tight


def test_search_weighs_op_checkpointing_only_where_allowed():
    """kiln plan passes op_checkpointing=False for a model with dropout (kiln refuses op there):
    the same search then writes every_k instead; allowed, some layouts take op."""
    shape = ModelShape.from_config(LLAMA3_8B, 128256)
    cluster = load_cluster("h100")
    allowed = {p.layout.ac for p in search(shape, cluster, 8192, 64)}
    refused = {p.layout.ac for p in search(shape, cluster, 8192, 64, op_checkpointing=False)}
    assert "op" in allowed and "op" not in refused


def test_collective_counts_follow_what_each_mode_issues():
    """DDP: one all-reduce per 25 MiB bucket (kiln sets bucket_cap_mb, so torch's 1 MiB first
    bucket does not apply); ZeRO-1: those plus a broadcast per parameter tensor; FSDP2: per block
    and root an all-gather forward, again backward for fsdp (not the last block), and a
    reduce-scatter, and the gradient norm's all-reduce. tests/plan/test_collective_counts.py counts
    them on real gloo runs."""
    import torch

    from kiln.model.transformer import Transformer
    from kiln.plan.timing import ddp_buckets

    cfg = ModelConfig(dim=64, n_layers=3, n_heads=2, vocab_size=256, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(cfg)
    shape = ModelShape.from_config(cfg, 256)
    assert shape.param_tensors() == len(list(model.parameters()))
    assert ddp_buckets(2**20) == 1 and ddp_buckets(25 * 2**20 + 1) == 2 and ddp_buckets(50 * 2**20 + 1) == 3
    c = load_cluster("cpu-local")
    grad_bytes = 4 * (shape.embedding_params + 3 * shape.layer_params)

    def calls(mode, n=2):
        lay = Layout(dp_replicate=1 if mode in ("zero2", "fsdp") else n, dp_shard=n if mode in ("zero2", "fsdp") else 1,
                     dp_mode=mode, micro_batch=2, precision="fp32")
        return step_time(shape, lay, 32, c).collectives

    assert calls("ddp") == ddp_buckets(grad_bytes)
    assert calls("zero1") == ddp_buckets(grad_bytes) + shape.param_tensors() + 1  # a tensor cut between the 2 ranks
    assert calls("zero2") == 4 + 4 + 1  # 3 blocks + root: gathered once, reduce-scattered once; the grad norm
    assert calls("fsdp") == 4 + 2 + 4 + 1  # blocks 0 and 1 gathered again for backward (the root stays gathered)


def test_processes_beyond_the_cores_share_them():
    c = load_cluster("cpu-local")
    shape = ModelShape.from_config(ModelConfig(dim=128, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=64), 256)
    lay4 = Layout(dp_replicate=4, micro_batch=2, precision="fp32")
    alone = step_time(shape, lay4, 64, c)
    c.cores_per_node = 2.0
    shared = step_time(shape, lay4, 64, c)
    assert shared.compute == pytest.approx(2 * alone.compute)
    assert shared.optimizer == pytest.approx(2 * alone.optimizer)
    assert shared.comm_total == pytest.approx(alone.comm_total)  # the timed collectives already include it
    assert step_time(shape, Layout(dp_replicate=2, micro_batch=2, precision="fp32"), 64, c).compute == \
        pytest.approx(alone.compute)  # two processes, two cores: a core each


def test_layouts_kiln_train_refuses_are_named_and_the_rest_accepted():
    from kiln.plan.search import kiln_refusal

    cfg = load_config(None, ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "data.seq_len=64",
                             "model.max_seq_len=64", "model.tie_embeddings=false"])
    assert kiln_refusal(cfg, Layout(dp_replicate=8, dp_mode="ddp"), 8) is None
    assert kiln_refusal(cfg, Layout(tp=2, pp=2, dp_shard=2, dp_mode="fsdp", grad_accum=4), 8) is None
    # pp x tp x cp together runs under fsdp (tests/parallel/test_pipeline_tensor_context_parallel.py;
    # `auto` picks fsdp there) and under ddp (kiln's replicas of the stage chunks' tp shards,
    # tests/parallel/test_data_tensor_pipeline_parallel.py), and pp with tied embeddings
    # (tests/parallel/test_pipeline_tied.py); a bad one is refused in kiln's own words
    assert kiln_refusal(cfg, Layout(tp=2, pp=2, cp=2, grad_accum=4, dp_mode="fsdp"), 8) is None
    assert kiln_refusal(cfg, Layout(tp=2, pp=2, cp=2, grad_accum=4, dp_mode="ddp"), 8) is None
    assert "parallel.tp=8 must divide model.n_heads" in kiln_refusal(cfg, Layout(tp=8, grad_accum=4), 8)
    tied = load_config(None, ["model.dim=64", "model.n_layers=4", "model.n_heads=4"])
    assert kiln_refusal(tied, Layout(pp=2, dp_shard=4, dp_mode="fsdp", grad_accum=4), 8) is None
    assert "parallel.pp=8" in kiln_refusal(tied, Layout(pp=8, grad_accum=8), 8)  # 8 stages, 4 layers
    # the written config carries the pipeline schedule: grad_accum micro-batches per schedule step
    run = config_for_plan(cfg, Layout(pp=2, dp_shard=4, dp_mode="fsdp", schedule="interleaved_1f1b",
                                      virtual_stages=2, micro_batch=1, grad_accum=4))
    assert (run.parallel.pp_schedule, run.parallel.pp_virtual_stages, run.parallel.pp_microbatches) == \
        ("interleaved_1f1b", 2, 4)
    assert run.train.global_batch_size == 0  # the config named no global batch: neither does the plan's
    # a config that names its global batch gets the plan's there, which derives the plan's grad_accum
    fixed = load_config(None, ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "train.batch_size=2",
                               "train.global_batch_size=64"])
    run = config_for_plan(fixed, Layout(dp_shard=4, dp_mode="fsdp", micro_batch=4, grad_accum=2))
    assert (run.train.batch_size, run.train.global_batch_size, run.train.accumulation(4)) == (4, 32, 2)


def test_moe_layouts_with_ep_and_etp_are_the_ones_kiln_train_runs():
    """A MoE model's search adds ep (and, under tp, etp = 1: ep borrowing the tp ranks); every such
    layout passes kiln train's own checks (ParallelDims.from_config through kiln_refusal), and the
    written config carries parallel.etp."""
    from kiln.plan.search import kiln_refusal

    cfg = load_config(None, ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "data.seq_len=128",
                             "model.max_seq_len=128", "model.moe_experts=8", "parallel.dp_mode=fsdp"])
    shape = ModelShape.from_config(cfg.model, cfg.model.vocab_size)
    cluster = load_cluster("h100")
    layouts = list(enumerate_layouts(shape, cluster, 128, 64, "bf16", ac_choices=("none",), max_pp=1, max_cp=1))
    experts = {(l.tp, l.ep, l.etp, l.dp_mode, l.dp_replicate, l.dp_shard): l for l in layouts if l.ep > 1}
    borrowing = [l for l in experts.values() if l.ep_borrows_tp]
    assert borrowing and all(l.dp_mode in ("fsdp", "zero2") and l.ep % l.tp == 0 for l in borrowing)
    assert any(l.tp > 1 and not l.ep_borrows_tp for l in experts.values())  # etp = tp as well
    from kiln import torch_compat

    for lay in experts.values():
        why = kiln_refusal(cfg, lay, 8)
        if why and "which this torch's FSDP2 cannot shard again" in why and not torch_compat.fsdp_shards_2d_dtensors():
            continue  # torch 2.8 cannot run this layout; the cluster's torch may (kiln train says so there)
        assert why is None, lay.describe()
    lay = next(l for l in borrowing if l.tp == 2 and l.ep == 4)
    assert "etp=1" in lay.describe() and config_for_plan(cfg, lay).parallel.etp == 1
    # ddp / zero1 over tp: proposed by the search; kiln train refuses them only while
    # ParallelDims.from_config does (the refusal the planner then passes on)
    dense = ModelShape.from_config(load_config(None, ["model.dim=128", "model.n_heads=4"]).model, 1000)
    ddp_tp = [l for l in enumerate_layouts(dense, cluster, 128, 64, "bf16", ac_choices=("none",), max_pp=1,
                                           max_cp=1) if l.tp > 1 and l.dp_mode in ("ddp", "zero1") and l.dp > 1]
    assert {l.dp_mode for l in ddp_tp} == {"ddp", "zero1"}
    why = kiln_refusal(cfg, ddp_tp[0], 8)
    assert why is None or "cannot combine with parallel.tp" in why


def test_every_layout_the_search_proposes_passes_kilns_own_mesh_checks():
    """Legality has one place (kiln/parallel/dims.py ParallelDims.from_config): every proposed
    mesh, for a dense and a mixture-of-experts model on 4, 8 and 16 processes, passes it and
    resolves to the layout's own degrees; and a mesh it refuses is never proposed."""
    from kiln.config import JobConfig
    from kiln.parallel.dims import ParallelDims

    dense = ModelConfig(dim=256, n_layers=8, n_heads=8, vocab_size=1000, max_seq_len=512)
    moe = ModelConfig(dim=256, n_layers=4, n_heads=4, vocab_size=1000, max_seq_len=512, moe_experts=4, moe_top_k=2)
    seen = set()
    for model, world in ((dense, 4), (dense, 8), (moe, 8), (dense, 16)):
        cluster = load_cluster("h100", max(1, world // 8))
        cluster.gpus_per_node = min(world, 8)
        shape = ModelShape.from_config(model, 1000)
        cfg = JobConfig()
        cfg.model, cfg.data.seq_len = model, 512
        meshes = {(l.dp_mode, l.dp_replicate, l.dp_shard, l.tp, l.pp, l.cp, l.ep, l.etp)
                  for l in enumerate_layouts(shape, cluster, 512, 32, "bf16", ac_choices=("none",))}
        for mode, rep, shard, tp, pp, cp, ep, etp in meshes:
            p = cfg.parallel
            p.dp_mode, p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.ep, p.etp = mode, rep, shard, tp, pp, cp, ep, etp
            dims = ParallelDims.from_config(p, world_size=world, rank=0, local_rank=0, local_world_size=world,
                                            seq_len=512)
            assert (dims.dp_mode, dims.dp_replicate, dims.dp_shard) == (mode, rep, shard)
            seen.add((mode in ("ddp", "zero1") and rep > 1, tp > 1, pp > 1))
        # a mesh kiln refuses (dp 2 x tp 2 x pp 2 under ddp while kiln refuses it) follows kiln's answer
        p = cfg.parallel
        p.dp_mode, p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp, p.ep, p.etp = "ddp", 1, 1, 2, 2, 1, 1, -1
        try:
            ParallelDims.from_config(p, world_size=8, rank=0, local_rank=0, local_world_size=8, seq_len=512)
            accepted = True
        except ConfigError:
            accepted = False
        if world == 8 and model is dense:
            assert (("ddp", 2, 1, 2, 2, 1, 1, -1) in meshes) == accepted
    assert {(True, True, False), (False, True, True), (True, False, True)} <= seen  # the new mixes are searched



def test_the_search_counts_fused_projections_where_kiln_fuses_them():
    """model.fused_projections = "auto" fuses q/k/v and w1/w3 on GPUs unless FSDP shards the
    weights, never under tp (kiln/train/system.py, kiln/model/transformer.py): the memory model
    counts one autocast input cast per GEMM there (tests/plan/test_moe_activations.py)."""
    from kiln.plan.search import fuses_projections

    shape = ModelShape.from_config(ModelConfig(dim=512, n_layers=8, n_heads=8, vocab_size=32000, max_seq_len=1024), 32000)
    plans = search(shape, load_cluster("h100"), 1024, 16)
    seen = {p.layout.fused_projections for p in plans}
    assert seen == {True, False}
    for p in plans:
        sharded = p.layout.dp * p.layout.cp > 1 and p.layout.dp_mode in ("fsdp", "zero2")
        assert p.layout.fused_projections == (p.layout.tp == 1 and not sharded) == fuses_projections(p.layout)
    assert not any(p.layout.fused_projections for p in search(shape, load_cluster("cpu-local"), 1024, 16))


def test_the_search_weighs_ulysses_where_cp_divides_the_heads_and_kiln_accepts_it(tmp_path):
    """parallel.cp_mode: every cp layout comes as the ring, and as Ulysses where cp divides the
    heads of a tp rank (kiln/parallel/dims.py check_model takes exactly those); the written plan
    carries the mode. Ulysses runs its attention locally: no ring block temporaries (GPUs' matmul
    ring kernel), the K/V repeated where a tp rank's K/V heads are fewer than cp."""
    from kiln.parallel.dims import ParallelDims
    from kiln.plan.memory import rank_memory, ring_block_bytes, ulysses_kv_repeat

    model = ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=1000, max_seq_len=4096)
    shape = ModelShape.from_config(model, 1000)
    cluster = load_cluster("h100")
    layouts = list(enumerate_layouts(shape, cluster, 4096, 8, "bf16", ac_choices=("none",)))
    modes = {(l.tp, l.cp, l.cp_mode) for l in layouts if l.cp > 1}
    assert not any(l.ulysses_degree for l in layouts)  # cp x tp within the node: no ring across nodes
    assert {(1, 2, "ulysses"), (1, 4, "ulysses"), (2, 2, "ulysses"), (1, 8, "ring")} <= modes
    assert not {(tp, cp) for tp, cp, mode in modes if mode == "ulysses"} & {(1, 8), (2, 4), (4, 2)}
    cfg = load_config(None, ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
                             "data.seq_len=4096", "model.max_seq_len=4096"])
    # Ulysses in rounds where they divide the heads it leaves a rank: 4 heads / cp 2 = 2 at tp 1
    rounds = {(l.tp, l.cp, l.ulysses_rounds) for l in layouts if l.cp_mode == "ulysses"}
    assert rounds == {(1, 2, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1)}
    in_rounds = next(l for l in layouts if l.ulysses_rounds == 2)
    assert "ulysses_rounds=2" in in_rounds.describe()
    planned = config_for_plan(cfg, in_rounds)
    assert planned.parallel.ulysses_rounds == 2
    ParallelDims.from_config(planned.parallel, world_size=8, rank=0, local_rank=0, local_world_size=8,
                             seq_len=4096).check_model(planned)
    for tp, cp, mode in sorted(modes):
        layout = next(l for l in layouts if (l.tp, l.cp, l.cp_mode) == (tp, cp, mode))
        planned = config_for_plan(cfg, layout)
        assert planned.parallel.cp_mode == mode
        dims = ParallelDims.from_config(planned.parallel, world_size=8, rank=0, local_rank=0, local_world_size=8,
                                        seq_len=4096)
        dims.check_model(planned)  # refuses Ulysses where cp does not divide a tp rank's heads
    ring = Layout(dp_shard=4, cp=2, dp_mode="fsdp", micro_batch=1)
    ulysses = Layout(dp_shard=4, cp=2, cp_mode="ulysses", dp_mode="fsdp", micro_batch=1)
    assert ulysses_kv_repeat(shape, ulysses) == 1 and ulysses_kv_repeat(shape, Layout(tp=2, cp=2, cp_mode="ulysses")) == 2
    assert ulysses_kv_repeat(shape, Layout(tp=2, cp=2)) == 1  # the ring repeats nothing
    saved = rank_memory(shape, ring, 4096).total - rank_memory(shape, ulysses, 4096).total
    assert saved == pytest.approx(ring_block_bytes(shape, ring, 4096))
    assert "cp_mode=ulysses" in ulysses.describe() and "cp_mode" not in ring.describe()
    # cp beyond a node (2 nodes of 2 GPUs): Ulysses inside each node, the ring across (USP)
    nodes = load_cluster("h100", 2)
    nodes.gpus_per_node = 2
    hybrids = [l for l in enumerate_layouts(shape, nodes, 4096, 8, "bf16", ac_choices=("none",)) if l.ulysses_degree]
    assert {(l.tp, l.cp, l.ulysses_degree) for l in hybrids} == {(1, 4, 2)}
    planned = config_for_plan(cfg, hybrids[0])
    assert (planned.parallel.cp_mode, planned.parallel.ulysses_degree) == ("ulysses", 2)
    dims = ParallelDims.from_config(planned.parallel, world_size=4, rank=0, local_rank=0, local_world_size=2,
                                    seq_len=4096)
    dims.check_model(planned)
    assert "ulysses_degree=2" in hybrids[0].describe()
    assert (hybrids[0].ulysses_ranks, hybrids[0].ring_ranks) == (2, 2)
