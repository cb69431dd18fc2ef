"""ZeRO-1's fullest rank (kiln/plan/memory.py `zero1_fullest_share`) against the real partition:
kiln's Zero1Optimizer over kiln's param groups of a real model, built once per rank of a process
group of n ranks faked in this process (torch's testing "fake" backend: collectives are no-ops,
so each rank's ZeRO holds exactly what the partition assigned it). And kiln's partition (even
where the update is elementwise, whole tensors largest first across the groups where not)
against torch's own (whole tensors, group by group)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from zero1_partition import fullest_share  # noqa: E402

from kiln.config import load_config
from kiln.model.transformer import Transformer
from kiln.plan.memory import Layout, ModelShape, rank_memory, zero1_fullest_share

BASE = ["model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.vocab_size=300", "data.seq_len=32",
        "model.max_seq_len=32"]
SHAPES = {
    "tied_swiglu": [],
    "untied": ["model.tie_embeddings=false"],
    "gelu_learned_positions": ["model.activation='gelu'", "model.positions='learned'"],
    "big_vocab": ["model.vocab_size=4000"],
    "moe": ["model.moe_experts=4", "model.moe_top_k=2"],
    "gpt2_biases": ["model.activation='gelu'", "model.positions='learned'", "model.norm='layernorm'", "model.bias=true"],
    "qkv_bias_qk_norm": ["model.qkv_bias=true", "model.qk_norm=true", "model.n_kv_heads=2", "model.head_dim=32"],
}


def _fullest_share(cfg, ranks: int, partition: str = "adamw") -> float:
    """Elements in the fullest rank's partition / all elements, for kiln's ZeRO-1 of the
    `partition` optimizer or torch's ZeroRedundancyOptimizer ("torch"), as the benchmark measures."""
    torch.manual_seed(0)
    return fullest_share(Transformer(cfg.model), cfg, ranks, partition)


FREE = pytest.mark.skipif(dist.is_initialized(), reason="needs this process free of another process group")


@FREE
@pytest.mark.parametrize("name", SHAPES)
def test_predicted_fullest_rank_is_kiln_partition(name):
    cfg = load_config(None, BASE + SHAPES[name])
    shape = ModelShape.from_config(cfg.model, cfg.model.vocab_size)
    for ranks in (2, 3, 4, 8, 64):
        for optimizer in ("adamw", "muon", "lamb"):
            share = zero1_fullest_share(shape, Layout(dp_replicate=ranks, dp_mode="zero1"), optimizer=optimizer)
            # the prediction divides evenly; the partition gives the remainder's elements one each
            assert share == pytest.approx(_fullest_share(cfg, ranks, optimizer), abs=1 / shape.params), (name, ranks, optimizer)


@FREE
def test_elementwise_updates_are_cut_even_and_whole_tensors_never_fuller_than_torch():
    """AdamW's tensors are cut: each rank holds an even share, within one element, also where the
    embedding alone is above it; torch's greedy (and LAMB's whole tensors) leave that rank fuller.
    LAMB's whole tensors, largest first across groups, leave the embedding's rank at the embedding
    alone (no split into whole tensors does better), torch's group by group more."""
    for name in SHAPES:
        cfg = load_config(None, BASE + SHAPES[name])
        n = sum(p.numel() for p in Transformer(cfg.model).parameters())
        for ranks in (2, 4, 8):
            assert _fullest_share(cfg, ranks) <= (n // ranks + 1) / n, (name, ranks)
            assert _fullest_share(cfg, ranks, "lamb") <= _fullest_share(cfg, ranks, "torch"), (name, ranks)
    cfg = load_config(None, BASE + SHAPES["big_vocab"])
    n = sum(p.numel() for p in Transformer(cfg.model).parameters())
    embedding = 4000 * 64 / n
    assert embedding > 1 / 4 and _fullest_share(cfg, 4) == pytest.approx(1 / 4, abs=1 / n)
    assert _fullest_share(cfg, 4, "lamb") == pytest.approx(embedding)
    assert _fullest_share(cfg, 4, "torch") > embedding
    # Muon: its matrices whole, the embedding (an AdamW tensor) cut around them
    assert _fullest_share(cfg, 4, "muon") == pytest.approx(1 / 4, abs=1 / n)


def test_the_fullest_rank_sets_the_optimizer_state_and_cp_ranks_share_the_partition():
    """The optimizer term is the fullest rank's share of the state (not 1/dp), the partition runs
    over dp x cp (data_parallel.py grad_mesh), and a single replica keeps the whole state."""
    cfg = load_config(None, BASE + ["model.vocab_size=4000"])
    shape = ModelShape.from_config(cfg.model, 4000)
    whole = rank_memory(shape, Layout(dp_mode="ddp", precision="fp32"), 32, optimizer="lamb").optimizer
    share = zero1_fullest_share(shape, Layout(dp_replicate=4, dp_mode="zero1"), optimizer="lamb")
    assert share > 0.3  # LAMB's tensors stay whole: the 4000 x 64 embedding alone is over a third
    zero1 = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", precision="fp32"), 32, optimizer="lamb")
    assert zero1.optimizer == pytest.approx(whole * share)
    adamw = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", precision="fp32"), 32)
    assert adamw.optimizer == pytest.approx(whole / 4)  # AdamW's: cut even
    cp = Layout(dp_replicate=2, cp=2, dp_mode="zero1", precision="fp32")
    assert zero1_fullest_share(shape, cp, optimizer="lamb") == share
    assert zero1_fullest_share(shape, Layout(cp=1, dp_mode="zero1")) == 1.0


def test_parallel_experts_stay_outside_the_partition():
    """Under ep the experts are stepped on every rank (Zero1Optimizer): their state is
    whole on each; without ep they are tensors of the partition like any other."""
    cfg = load_config(None, BASE + SHAPES["moe"])
    shape = ModelShape.from_config(cfg.model, 300)
    with_ep = Layout(dp_replicate=4, ep=2, dp_mode="zero1", precision="fp32")
    without = Layout(dp_replicate=4, dp_mode="zero1", precision="fp32")
    dense = shape.params - shape.expert_params
    mem = rank_memory(shape, with_ep, 32)  # AdamW: 8 bytes per parameter; ep = 2 halves the experts
    assert mem.optimizer == pytest.approx(8 * dense * zero1_fullest_share(shape, with_ep) + 8 * shape.expert_params / 2)
    mem = rank_memory(shape, without, 32)
    assert mem.optimizer == pytest.approx(8 * shape.params * zero1_fullest_share(shape, without))
