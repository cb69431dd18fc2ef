"""Context parallel (ring attention, zig-zag) on gloo: the attention itself against full causal
attention, and whole training runs against one process on the same global batch.

Tolerances: attention fp32 atol 1e-5 (cp_ring_worker.py); per-step training losses fp32 relative
1e-5, the data-parallel tests' bound (SGD, no clipping, so a wrongly scaled gradient shows).
"""

import json
import math

import pytest
import torch

from kiln.config import ParallelConfig
from kiln.errors import ConfigError
from kiln.parallel.context_parallel import check_cp_seq_len, zigzag_positions
from kiln.parallel.dims import ParallelDims
from ranks import run_ranks, train_runs
from test_data_parallel import GLOBAL_BATCH, STEPS, assert_same_losses, common, losses, sets


def test_zigzag_positions_cover_the_sequence_once_and_balance_causal_work():
    seq_len, cp = 16, 4
    parts = [zigzag_positions(seq_len, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[1].tolist() == [2, 3, 12, 13]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
    # Causal work of a rank = sum over its queries of (position + 1): equal on every rank.
    assert len({int((p + 1).sum()) for p in parts}) == 1


def test_cp_not_dividing_seq_len_fails_naming_the_values():
    with pytest.raises(ConfigError, match=r"data\.seq_len=30 is not divisible by 2\*parallel\.cp=4"):
        ParallelDims.from_config(ParallelConfig(cp=2), world_size=2, rank=0, local_rank=0, seq_len=30)
    check_cp_seq_len(2, 32)
    check_cp_seq_len(1, 31)  # no cp, no constraint
    dims = ParallelDims.from_config(ParallelConfig(cp=2), world_size=4, rank=0, local_rank=0, seq_len=32)
    assert (dims.cp, dims.dp_size) == (2, 2)


# Gradients are averaged over dp x cp: by DDP (cp=2 alone), and by FSDP2 sharding over the
# flattened dp_shard x cp mesh (torchtitan's dp_shard_cp) on 4 ranks.
CP_RUNS = {"cp2-ddp": (2, {"parallel.cp": 2, "parallel.dp_mode": "'ddp'", "train.batch_size": GLOBAL_BATCH}),
           "fsdp2xcp2": (4, {"parallel.cp": 2, "parallel.dp_mode": "'fsdp'", "train.batch_size": GLOBAL_BATCH // 2}),
           # op checkpointing keeps the ring's output (parallelize.compute_ops_kept): no second ring in backward
           "cp2-op": (2, {"parallel.cp": 2, "parallel.dp_mode": "'ddp'", "train.batch_size": GLOBAL_BATCH,
                          "train.activation_checkpointing": "'op'"}),
           # Ulysses (kiln/parallel/ulysses.py): all-to-alls around a local attention of whole sequences
           "cp2-ulysses": (2, {"parallel.cp": 2, "parallel.cp_mode": "'ulysses'", "parallel.dp_mode": "'ddp'",
                               "train.batch_size": GLOBAL_BATCH}),
           "fsdp2xcp2-ulysses": (4, {"parallel.cp": 2, "parallel.cp_mode": "'ulysses'", "parallel.dp_mode": "'fsdp'",
                                     "train.batch_size": GLOBAL_BATCH // 2})}
ULYSSES = {"parallel.cp_mode": "'ulysses'"}
# 4 heads over 2 K/V heads: under tp=2 each rank holds 2 and 1, so Ulysses over cp=2 repeats K/V
HEADS4 = {"model.n_heads": 4, "model.n_kv_heads": 2}


WINDOW = {"model.sliding_window": 12, "model.full_attention_every": 2}
DOCUMENTS = {"data.windows": "'packed_masked'", **WINDOW}  # a local and a global layer, both masked


def ring_check_then_train(rank, world, jobs):
    """The 2-rank launch: cp_ring_worker's attention checks, then kiln's trainer on `jobs`."""
    from cp_ring_worker import check_ring_attention, check_ulysses_attention

    result = [check_ring_attention(), check_ulysses_attention()]
    train_runs(rank, world, jobs)
    return result


def window_check_then_train(rank, world, jobs):
    """The 4-rank launch: cp_ring_worker's window and document checks on a 4-rank ring (windows
    that reach one neighbour each way: the neighbourhood exchange), then kiln's trainer on `jobs`."""
    from cp_ring_worker import check_ring_attention, check_ulysses_attention

    from cp_ring_worker import check_hybrid_attention

    result = [check_ring_attention(("window", "documents")), check_ulysses_attention(), check_hybrid_attention()]
    train_runs(rank, world, jobs)
    return result


@pytest.fixture(scope="module")
def launches(tmp_path_factory, text_file, short_docs_dir):
    """(what check_ring_attention returned on each of 2 ranks, {name: run directory}): the
    2-rank checks and cp2-ddp run in one launch, fsdp2xcp2 in a 4-rank one."""
    root = tmp_path_factory.mktemp("cp")
    runs = {name: root / name for name in CP_RUNS}
    jobs = {n: [(runs[name], common(text_file, **extra)) for name, (world, extra) in CP_RUNS.items() if world == n]
            for n in (2, 4)}
    runs["cp2-dropout"] = root / "cp2-dropout"  # attention (ring), residual and embedding dropout
    jobs[2].append((runs["cp2-dropout"], common(text_file, **{**CP_RUNS["cp2-ddp"][1], "model.dropout": 0.1})))
    runs["cp2-ulysses-dropout"] = root / "cp2-ulysses-dropout"  # each head group its own masks
    jobs[2].append((runs["cp2-ulysses-dropout"], common(text_file, **{**CP_RUNS["cp2-ulysses"][1],
                                                                      "model.dropout": 0.1})))
    # sliding-window layers (window 12 across the 8-token chunks: whole, partial and skipped blocks)
    # next to a global one, against one process with the same model (trained here, in this process)
    runs["cp2-window"] = root / "cp2-window"
    jobs[2].append((runs["cp2-window"], common(text_file, **{**CP_RUNS["cp2-ddp"][1], **WINDOW})))
    from kiln.config import load_config
    from kiln.train.trainer import train

    runs["window-reference"] = root / "window-reference"
    train(load_config(None, common(text_file, **{"train.batch_size": GLOBAL_BATCH, **WINDOW})), runs["window-reference"])
    # packed documents (data.windows = "packed_masked"): short documents, so every 32-token window
    # holds several; the ring masks from the whole sequences' document ids; the same model trained
    # here with and without the mask (the mask must change the losses for the check to fail)
    docs = short_docs_dir
    runs["cp2-documents"] = root / "cp2-documents"
    jobs[2].append((runs["cp2-documents"], common(docs, **{**CP_RUNS["cp2-ddp"][1], **DOCUMENTS})))
    runs["cp2-ulysses-documents"] = root / "cp2-ulysses-documents"  # the model's whole-sequence masks
    jobs[2].append((runs["cp2-ulysses-documents"], common(docs, **{**CP_RUNS["cp2-ulysses"][1], **DOCUMENTS})))
    runs["tp2-documents"] = root / "tp2-documents"  # the mask past tensor parallel's input plan
    jobs[2].append((runs["tp2-documents"], common(docs, **{"parallel.tp": 2, **DOCUMENTS,
                                                           "train.batch_size": GLOBAL_BATCH})))
    runs["pp2xcp2-ulysses-documents"] = root / "pp2xcp2-ulysses-documents"  # the pipeline stages' masks
    jobs[4].append((runs["pp2xcp2-ulysses-documents"], common(docs, **{
        "parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "'1f1b'", **ULYSSES, **DOCUMENTS,
        "train.batch_size": GLOBAL_BATCH})))
    for name, extra in (("documents-reference", DOCUMENTS), ("documents-unmasked", {})):
        runs[name] = root / name
        train(load_config(None, common(docs, **{"train.batch_size": GLOBAL_BATCH, **extra})), runs[name])
    # Ulysses under tp x cp with K/V repeated, against one process of the same 4-head model
    runs["tp2xcp2-ulysses"] = root / "tp2xcp2-ulysses"
    jobs[4].append((runs["tp2xcp2-ulysses"], common(text_file, **{"parallel.cp": 2, "parallel.tp": 2, **ULYSSES,
                                                                  **HEADS4, "train.batch_size": GLOBAL_BATCH})))
    # Ulysses over 2 consecutive ranks and the ring across the 2 groups (parallel.ulysses_degree)
    hybrid = {"parallel.cp": 4, **ULYSSES, "parallel.ulysses_degree": 2, "train.batch_size": GLOBAL_BATCH}
    runs["cp4-hybrid"] = root / "cp4-hybrid"
    jobs[4].append((runs["cp4-hybrid"], common(text_file, **hybrid)))
    runs["cp4-hybrid-documents"] = root / "cp4-hybrid-documents"  # the ring masks from the ids
    jobs[4].append((runs["cp4-hybrid-documents"], common(docs, **hybrid, **DOCUMENTS)))
    # Ulysses' heads in 2 rounds (parallel.ulysses_rounds): 1 query head a rank and round, K/V repeated
    runs["cp2-ulysses-rounds2"] = root / "cp2-ulysses-rounds2"
    jobs[2].append((runs["cp2-ulysses-rounds2"], common(text_file, **{"parallel.cp": 2, **ULYSSES, **HEADS4,
                                                                      "parallel.ulysses_rounds": 2,
                                                                      "train.batch_size": GLOBAL_BATCH})))
    runs["heads4-reference"] = root / "heads4-reference"
    train(load_config(None, common(text_file, **{"train.batch_size": GLOBAL_BATCH, **HEADS4})), runs["heads4-reference"])
    for n in (2, 4):
        (root / f"ranks{n}").mkdir()
    ring = run_ranks(ring_check_then_train, 2, root / "ranks2", jobs[2], timeout=400)
    ring += run_ranks(window_check_then_train, 4, root / "ranks4", jobs[4], timeout=400)
    return ring, runs


@pytest.mark.timeout(600)
def test_ring_and_ulysses_attention_match_full_attention_forward_and_backward(launches):
    # 2 ranks, then 4 (ring: windows and documents; Ulysses: all its checks; Ulysses over 2 x the ring over 2)
    assert launches[0] == ([[f"rank {r}: ok", f"rank {r}: ulysses ok"] for r in range(2)]
                           + [[f"rank {r}: ok", f"rank {r}: ulysses ok", f"rank {r}: hybrid ok"] for r in range(4)])


@pytest.fixture(scope="module")
def reference(dp_reference):
    return dp_reference  # one process, the global batch: test_data_parallel's, once per session (conftest)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CP_RUNS))
def test_context_parallel_run_matches_one_process(launches, reference, name):
    nproc, run = CP_RUNS[name][0], launches[1][name]
    run_row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert run_row["world_size"] == nproc and run_row["dp_replicate"] * run_row["dp_shard"] == nproc // 2
    assert run_row["cp"] == 2 and run_row["cp_mode"] == ("ulysses" if "ulysses" in name else "ring")
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run, reference, without", [
    ("cp2-window", "window-reference", "cp2-ddp"),  # sliding-window layers
    ("cp2-documents", "documents-reference", "documents-unmasked"),  # packed documents
    ("cp2-ulysses-documents", "documents-reference", "documents-unmasked"),  # packed documents, Ulysses
    ("pp2xcp2-ulysses-documents", "documents-reference", "documents-unmasked"),  # ... in pipeline stages
    ("tp2-documents", "documents-reference", "documents-unmasked"),  # ... under tensor parallel
    ("tp2xcp2-ulysses", "heads4-reference", "cp2-ulysses"),  # Ulysses x tp, K/V heads repeated
    ("cp2-ulysses-rounds2", "heads4-reference", "cp2-ulysses"),  # Ulysses' heads in 2 rounds
    ("cp4-hybrid-documents", "documents-reference", "documents-unmasked"),  # Ulysses x ring, documents
])
def test_context_parallel_matches_one_process_of_its_model(launches, run, reference, without):
    # `without`: another model's run (no mask, no window, other heads): the comparison can fail
    runs = launches[1]
    got = losses(runs[run])
    assert_same_losses(losses(runs[reference]), got, range(1, STEPS + 1))
    plain = losses(runs[without])
    assert any(abs(got[s] - plain[s]) > 1e-4 * abs(plain[s]) for s in plain)
    if "rounds" in run:
        run_row = next(json.loads(x) for x in (runs[run] / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
        assert run_row["ulysses_rounds"] == 2


@pytest.mark.timeout(600)
def test_ulysses_inside_groups_with_the_ring_across_matches_one_process(launches, reference):
    run = launches[1]["cp4-hybrid"]
    run_row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"run"' in x)
    assert (run_row["cp"], run_row["cp_mode"], run_row["ulysses_degree"]) == (4, "ulysses", 2)
    assert_same_losses(reference, losses(run), range(1, STEPS + 1))


@pytest.mark.timeout(600)
def test_context_parallel_trains_with_dropout(launches):
    # model.dropout under cp: attention dropout in the ring (its masks checked against a reference in
    # cp_ring_worker.check_ring_dropout), the rest per token. Random, so not one process's losses:
    # every step finite, the first within 5% of the run without dropout, and none equal to it.
    plain = losses(launches[1]["cp2-ddp"])
    for run in ("cp2-dropout", "cp2-ulysses-dropout"):  # the ring's, and Ulysses' (SDPA's dropout per head group)
        dropped = losses(launches[1][run])
        assert sorted(dropped) == sorted(plain) == list(range(1, STEPS + 1))
        assert all(math.isfinite(x) for x in dropped.values())
        assert dropped[1] == pytest.approx(plain[1], rel=0.05)
        assert all(dropped[s] != plain[s] for s in plain), (run, dropped, plain)


def test_train_with_cp_not_dividing_seq_len_fails_before_any_work(tmp_path, text_file, monkeypatch, capsys):
    from kiln.cli import main

    run = tmp_path / "bad"
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--run-dir", str(run), *sets(common(text_file, **{"parallel.cp": 2,
                                                                             "data.seq_len": 30}))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data.seq_len=30 is not divisible by 2*parallel.cp=4" in lines[0], lines
    assert not run.exists()  # nothing was written


@pytest.mark.parametrize("tp, heads, expected", [
    (1, 6, "must divide model.n_heads=6; change parallel.cp or set parallel.cp_mode='ring'"),
    (2, 4, "must divide model.n_heads=4 / parallel.tp=2 = 2; change parallel.cp"),
])
def test_ulysses_with_cp_not_dividing_the_heads_fails_naming_the_values(text_file, tp, heads, expected):
    from kiln.config import load_config

    cfg = load_config(None, common(text_file, **{"parallel.cp": 4, "parallel.tp": tp, **ULYSSES, "model.dim": 48,
                                                 "model.n_heads": heads, "model.n_kv_heads": heads}))
    dims = ParallelDims.from_config(cfg.parallel, world_size=4 * tp, rank=0, local_rank=0, seq_len=cfg.data.seq_len)
    with pytest.raises(ConfigError, match=r"parallel\.cp_mode='ulysses' splits each rank's attention heads over "
                                          r"parallel\.cp=4, which " + expected.replace(".", r"\.").replace("(", r"\(")):
        dims.check_model(cfg)
    ok = load_config(None, common(text_file, **{"parallel.cp": 4, "parallel.tp": tp, "model.dim": 48,
                                                "model.n_heads": heads, "model.n_kv_heads": heads}))
    ParallelDims.from_config(ok.parallel, world_size=4 * tp, rank=0, local_rank=0,
                             seq_len=ok.data.seq_len).check_model(ok)  # the ring takes any head count


def test_ulysses_degree_needs_ulysses_and_a_divisor_of_cp_and_of_the_heads(text_file):
    from kiln.config import load_config

    for extra in ({"parallel.cp_mode": "'ring'"}, {**ULYSSES, "parallel.ulysses_degree": 3}):
        with pytest.raises(ConfigError, match=r"parallel\.ulysses_degree=\d needs parallel\.cp_mode='ulysses' and "
                                              r"must divide parallel\.cp=4"):
            load_config(None, common(text_file, **{"parallel.cp": 4, "parallel.ulysses_degree": 2, **extra}))
    cfg = load_config(None, common(text_file, **{"parallel.cp": 4, **ULYSSES, "parallel.ulysses_degree": 4,
                                                 "model.n_heads": 2}))
    dims = ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0, seq_len=cfg.data.seq_len)
    with pytest.raises(ConfigError, match=r"over parallel\.ulysses_degree=4, which must divide model\.n_heads=2; "
                                          r"change parallel\.ulysses_degree or set parallel\.cp_mode='ring'"):
        dims.check_model(cfg)
    cfg.parallel.ulysses_degree = dims.ulysses_degree = 2  # Ulysses over 2 ranks, the ring across 2 groups
    dims.check_model(cfg)
    # compiled with dropout: the ring's seed enters its op as a tensor; Ulysses alone reseeds torch's generator
    cfg.model.dropout, cfg.train.compile = 0.1, True
    from kiln import torch_compat

    if not torch_compat.dynamo_traces_ring_objects():  # 2.6: compile with cp refused by version first
        with pytest.raises(ConfigError, match=r"train\.compile=true with parallel\.cp=4 needs a torch whose dynamo"):
            dims.check_model(cfg)
        return
    dims.check_model(cfg)
    cfg.parallel.ulysses_degree = dims.ulysses_degree = 0
    cfg.model.n_heads = 4
    with pytest.raises(ConfigError, match=r"model\.dropout=0\.1 with parallel\.cp_mode='ulysses' and train\.compile=true "
                                          r"is not supported; set train\.compile=false"):
        dims.check_model(cfg)


def test_ulysses_rounds_need_ulysses_and_a_divisor_of_the_heads_each_rank_attends(text_file):
    from kiln.config import load_config

    for extra in ({"parallel.cp": 1, **ULYSSES}, {"parallel.cp": 2, "parallel.cp_mode": "'ring'"}):
        with pytest.raises(ConfigError, match=r"parallel\.ulysses_rounds=2 needs parallel\.cp > 1 with "
                                              r"parallel\.cp_mode='ulysses' \(cp=\d, cp_mode='\w+'\); set it to 1"):
            load_config(None, common(text_file, **{"parallel.ulysses_rounds": 2, **extra}))
    cfg = load_config(None, common(text_file, **{"parallel.cp": 2, "parallel.tp": 2, **ULYSSES, "model.dim": 48,
                                                 "model.n_heads": 12, "model.n_kv_heads": 4,
                                                 "parallel.ulysses_rounds": 4}))
    dims = ParallelDims.from_config(cfg.parallel, world_size=4, rank=0, local_rank=0, seq_len=cfg.data.seq_len)
    with pytest.raises(ConfigError, match=r"parallel\.ulysses_rounds=4 must divide the heads each rank attends under "
                                          r"Ulysses, model\.n_heads=12 / parallel\.tp=2 / 2 = 3; change "
                                          r"parallel\.ulysses_rounds"):
        dims.check_model(cfg)
    cfg.parallel.ulysses_rounds = dims.ulysses_rounds = 3
    dims.check_model(cfg)


def test_context_parallel_gets_the_kv_heads_unexpanded_where_the_model_expands_them():
    """Attention.expand_kv (kiln/train/attention.py: repeat K/V heads where only whole heads get a
    fused kernel) applies after context parallel's exchanges, not before them: the ring and Ulysses
    move n_kv_heads K/V (Ulysses expands them after its all-to-all; cp_ring_worker checks it). Without
    cp the expanded heads give the grouped ones' result."""
    from kiln.config import ModelConfig
    from kiln.model.transformer import Attention

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16, vocab_size=256)
    attention = Attention(cfg, 0)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    grouped = attention(x, None)
    attention.expand_kv = True
    torch.testing.assert_close(attention(x, None), grouped)
    seen = []
    attention.attention_fn = lambda q, k, v, *rest: seen.append(k.shape[1]) or torch.zeros_like(q)
    attention(x, None)
    assert seen == [2]
