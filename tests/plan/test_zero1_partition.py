"""ZeRO-1's fullest rank (kiln/plan/memory.py `zero1_fullest_share`) against the real partition:
kiln's ZeroRedundancyState over kiln's param groups of a real model, built once per rank of a
process group of n ranks faked in this process (torch's testing "fake" backend: collectives are
no-ops, so each rank's local optimizer holds exactly what the partition assigned it). And kiln's
partition (largest first across the groups) against torch's own (group by group)."""

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
}


def _fullest_share(cfg, ranks: int, zero_class=None) -> float:
    """Elements in the fullest rank's partition / all elements, as `zero_class` (kiln's
    ZeroRedundancyState unless given) partitions kiln's param groups (the benchmark's measurement)."""
    from kiln.parallel.zero1 import ZeroRedundancyState

    torch.manual_seed(0)
    return fullest_share(Transformer(cfg.model), cfg, ranks, zero_class or ZeroRedundancyState)


FREE = pytest.mark.skipif(dist.is_initialized(), reason="needs this process free of another process group")


@FREE
@pytest.mark.parametrize("name", SHAPES)
def test_predicted_fullest_rank_is_kiln_partition(name):
    cfg = load_config(None, BASE + SHAPES[name])
    shape = ModelShape.from_config(cfg.model, cfg.model.vocab_size)
    for ranks in (2, 3, 4, 8, 64):
        share = zero1_fullest_share(shape, Layout(dp_replicate=ranks, dp_mode="zero1"))
        assert share == pytest.approx(_fullest_share(cfg, ranks), rel=1e-12), (name, ranks)


@FREE
def test_kiln_partition_is_never_fuller_than_torch_and_puts_the_embedding_alone():
    """torch's greedy puts the no-decay group's embedding on a rank already holding its share of
    the matrices; kiln's, largest first across groups, leaves the embedding's rank at the
    embedding alone where that is above the even share (no split into whole tensors does better)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    for name in SHAPES:
        cfg = load_config(None, BASE + SHAPES[name])
        for ranks in (2, 4, 8):
            assert _fullest_share(cfg, ranks) <= _fullest_share(cfg, ranks, ZeroRedundancyOptimizer), (name, ranks)
    cfg = load_config(None, BASE + SHAPES["big_vocab"])
    embedding = 4000 * 64 / sum(p.numel() for p in Transformer(cfg.model).parameters())
    assert _fullest_share(cfg, 4) == pytest.approx(embedding) and embedding > 1 / 4
    assert _fullest_share(cfg, 4, ZeroRedundancyOptimizer) > embedding


def test_the_fullest_rank_sets_the_optimizer_state_and_cp_ranks_share_the_partition():
    """The optimizer term is the fullest rank's share of the state (not 1/dp), the partition runs
    over dp x cp (data_parallel.py grad_mesh), and a single replica keeps the whole state."""
    cfg = load_config(None, BASE + ["model.vocab_size=4000"])
    shape = ModelShape.from_config(cfg.model, 4000)
    whole = rank_memory(shape, Layout(dp_mode="ddp", precision="fp32"), 32).optimizer
    share = zero1_fullest_share(shape, Layout(dp_replicate=4, dp_mode="zero1"))
    assert share > 0.3  # the 4000 x 64 embedding alone is over a third of this model: far above 1/4
    zero1 = rank_memory(shape, Layout(dp_replicate=4, dp_mode="zero1", precision="fp32"), 32)
    assert zero1.optimizer == pytest.approx(whole * share)
    cp = Layout(dp_replicate=2, cp=2, dp_mode="zero1", precision="fp32")
    assert zero1_fullest_share(shape, cp) == share
    assert zero1_fullest_share(shape, Layout(cp=1, dp_mode="zero1")) == 1.0


def test_parallel_experts_stay_outside_the_partition():
    """Under ep the experts are stepped on every rank (ZeroRedundancyExceptExperts): their state is
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
