"""Expert parallel borrowing tp (parallel.etp=1, torchtitan's etp = 1): `kiln train`'s trainer
in-process on gloo ranks against one process on the same global batch.

Layouts (4 experts, top-2 with capacity factor 1.0, so assignments are dropped; AdamW, clipping
active on every step; seq_len 16, so each tp rank routes 8 tokens of every sequence):
- ep2_tp2 (4 ranks, fsdp): dp_shard=2 x tp=2, ep=2: each data-parallel rank's 2 tp ranks are one
  ep group (2 whole experts each), the experts FSDP-sharded over the 2 "edp" ranks.
- ep4_tp2 (4 ranks, zero2): ep=4 spans dp_shard x tp, one whole expert per rank, edp = 1.
- ep4_cp2_tp2 (4 ranks, fsdp): cp=2 x tp=2, ep=4 = cp x tp, one whole expert per rank. Each cp
  rank holds the zig-zag chunks (r, 3-r) of 4 of every sequence and each of its tp ranks one of
  them (4 tokens): rank (c, t) routes chunk c if t = 0, else chunk 3-c.
Capacity semantics: one process's, exactly. Capacity is per sequence (GShard groups,
kiln/model/moe.py), not per rank: the tp ranks exchange per-expert counts of their sequence
shards, so each assignment gets the slot it has in one process and the same assignments drop.
The step-3 checkpoints of ep2_tp2 and ep4_cp2_tp2 store every expert once (whole experts, split over ep x edp,
its DCP metadata) and continue (steps 4-5) in one process; ep2_tp2's also under etp = tp (ep2 x
tp2, experts sharded over tp).

Tolerance: fp32, relative 1e-5 per step for the loss (LM + weighted aux + z-loss), the
pre-clipping grad norm and the logged aux and z-losses (the layout changes only the order of sums).
Negative controls (each must fail the comparison at step 1): the expert gradients scaled as for
etp = tp (1 / ep instead of edp / D), the router's gradient not summed over tp, and queue slots
counted within each tp rank's shard of the sequence (capacity per rank's tokens: other drops), and
under cp x tp the slots counted over the tp slices of the cp rank's half only, without the other cp
rank's chunks before them (the cp offset left out: other drops), or counted over the whole sequence
but with the cp ranks' chunks taken as contiguous instead of zig-zag (wrong offsets: other drops).
"""

import json
import shutil

import pytest

from conftest import tiny_overrides
from ranks import patch_for_one_run, run_ranks
from test_expert_pipeline_context import (SAVE_AT, STEPS, assert_matches_one_process, assert_same,
                                          jobs_with_mistakes, moe_job, rows)
from test_expert_tensor_parallel import MOE, expert_chunks

LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "ep2_tp2": (4, {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}),
    "ep4_tp2": (4, {"parallel.tp": 2, "parallel.ep": 4, "parallel.etp": 1, "parallel.dp_mode": "'zero2'"}),
    "ep4_cp2_tp2": (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.ep": 4, "parallel.etp": 1}),
    "ep2_tp2_etp2": (4, {"parallel.tp": 2, "parallel.ep": 2}),  # etp = tp (the default)
}
MISTAKES = ("experts_scaled_as_etp_tp", "router_grad_not_summed", "capacity_per_tp_shard")
CP_MISTAKES = ("cp_tp_capacity_without_cp_offset", "cp_tp_pieces_not_zigzag")


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.cp": 1, "parallel.tp": 1, "parallel.ep": 1, **parallel}
    return moe_job(text_file, shards, per_rank, world // (per_rank["parallel.cp"] * per_rank["parallel.tp"]), moe=MOE)


def deliberate_mistake(kind):
    """Patch one deliberate mistake into this process; returns the undo."""
    if kind == "experts_scaled_as_etp_tp":  # the hook is bound when the experts are parallelized
        from kiln.parallel import expert_parallel as xp

        saved = xp._scaled_grad  # edp / D = 1 -> 1 / ep
        return patch_for_one_run(xp, "_scaled_grad", lambda grad, factor: saved(grad, factor / 2))
    if kind == "router_grad_not_summed":  # MoE looks the helper up at call time: the gradient taken as whole
        from kiln.parallel import functional

        return patch_for_one_run(functional, "local_with_partial_grad", lambda param: param.to_local())
    if kind == "capacity_per_tp_shard":
        from kiln.model.moe import MoE

        return patch_for_one_run(MoE, "_sp_positions", lambda self, onehot: (onehot.cumsum(1) * onehot).sum(-1) - 1)
    if kind == "cp_tp_capacity_without_cp_offset":  # the cp rank's half taken for the whole sequence
        from kiln.model.moe import MoE

        return patch_for_one_run(MoE, "_cp_sp_positions", lambda self, onehot: self._sp_positions(onehot))
    if kind == "cp_tp_pieces_not_zigzag":  # whole-sequence counts, but cp's chunks taken as contiguous
        from kiln.model import moe

        saved = moe.cp_sp_pieces
        return patch_for_one_run(moe, "cp_sp_pieces",
                                 lambda seq_len, cp, sp, r, t: saved(seq_len, 1, cp * sp, 0, r * sp + t))
    return lambda: None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("epborrowtp")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    out = {name: root / name for name in ["single", "ep2_tp2", "ep4_tp2", "ep4_cp2_tp2", *MISTAKES, *CP_MISTAKES]}
    train(load_config(None, sets["single"]), out["single"])  # writes the shared shards first
    out["ep2_tp2->etp2"] = root / "to-etp2"
    jobs = [(None, out[name], sets[name], None, None) for name in ("ep2_tp2", "ep4_tp2", "ep4_cp2_tp2")]
    jobs += [(None, out[m], sets["ep2_tp2"], 1, m) for m in MISTAKES]
    jobs += [(None, out[m], sets["ep4_cp2_tp2"], 1, m) for m in CP_MISTAKES]
    jobs += [(out["ep2_tp2"], out["ep2_tp2->etp2"], sets["ep2_tp2_etp2"], None, None)]
    run_ranks(jobs_with_mistakes, 4, root, deliberate_mistake, jobs, timeout=300)
    for name in ("ep2_tp2", "ep4_cp2_tp2"):
        out[f"{name}->single"] = run = root / f"{name}-to-single"
        shutil.copytree(out[name], run, ignore=shutil.ignore_patterns(f"step-{STEPS}"))
        train(load_config(None, sets["single"]), run, resume=True)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ep2_tp2", "ep4_tp2", "ep4_cp2_tp2"])
def test_ep_borrowing_tp_matches_one_process(runs, name):
    assert_matches_one_process(runs["single"], runs[name], LAYOUTS[name][0], name)


@pytest.mark.timeout(600)  # whichever test runs first sets the module's runs up
@pytest.mark.parametrize("pair", ["ep2_tp2->single", "ep2_tp2->etp2", "ep4_cp2_tp2->single"])
def test_ep_borrowing_tp_checkpoint_continues_in_another_layout(runs, pair):
    expected, got = rows(runs["single"]), rows(runs[pair])
    run_row = [json.loads(x) for x in (runs[pair] / "metrics.jsonl").read_text().splitlines() if '"run"' in x][-1]
    assert run_row["resumed_from"] == SAVE_AT
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), pair)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, experts_per_chunk", [("ep2_tp2", 1), ("ep4_tp2", 1), ("ep4_cp2_tp2", 1)])
def test_ep_borrowing_tp_checkpoint_saves_whole_experts_once(runs, name, experts_per_chunk):
    import torch

    weights = expert_chunks(runs[name])
    assert len(weights) == 2 * 3  # w1, w2, w3 of both MoE layers
    for key, (size, chunks) in weights.items():
        seen = torch.zeros(size, dtype=torch.int32)
        for offsets, sizes in chunks:
            # split on the expert dim only (ep x edp): every chunk holds whole experts
            assert sizes == (experts_per_chunk, *size[1:]), (key, sizes)
            seen[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert bool((seen == 1).all()), key  # every element saved by exactly one rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [*MISTAKES, *CP_MISTAKES])
def test_each_deliberate_mistake_fails_the_comparison(runs, name):
    expected, got = rows(runs["single"]), rows(runs[name])
    assert sorted(got) == [1]
    with pytest.raises(AssertionError):
        assert_same(expected, got, [1], name)


@pytest.mark.parametrize("world, sets, expected", [
    (4, {"parallel.etp": 3}, "parallel.etp=3 must be 1 (experts whole, ep borrows tp) or parallel.tp=2"),
    # ep borrows all of tp: a multiple of tp that divides dp_shard x tp
    (4, {"parallel.tp": 4, "model.n_heads": 4},
     "parallel.ep=2 must be a multiple of parallel.tp=4 with parallel.etp=1"),
    (4, {"parallel.ep": 8, "model.moe_experts": 8},
     "parallel.ep=8 must divide dp_shard x tp = 2 x 2 with parallel.etp=1"),
    # with cp, ep borrows all of cp x tp: a multiple of cp x tp that divides dp_shard x cp x tp
    (8, {"parallel.cp": 2}, "parallel.ep=2 must be a multiple of parallel.cp x tp = 2 x 2 with parallel.etp=1"),
    (8, {"parallel.cp": 2, "parallel.ep": 12, "model.moe_experts": 12},
     "parallel.ep=12 must divide dp_shard x cp x tp = 2 x 2 x 2 with parallel.etp=1"),
    (4, {"parallel.dp_mode": "'zero1'"}, "parallel.etp=1 with parallel.ep=2 and parallel.tp=2 needs parallel.dp_mode="),
    (4, {"data.seq_len": 15}, "data.seq_len=15 is not divisible by parallel.cp x tp = 1 x 2 (with parallel.etp=1"),
    (8, {"parallel.cp": 2, "parallel.tp": 4, "model.n_heads": 4, "parallel.ep": 8, "model.moe_experts": 8,
         "data.seq_len": 20}, "data.seq_len=20 is not divisible by parallel.cp x tp = 2 x 4"),
])
def test_ep_borrowing_tp_bad_layouts_are_refused_in_one_line(text_file, tmp_path, monkeypatch, capsys,
                                                              world, sets, expected):
    from kiln.cli import main

    for name, value in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    sets = tiny_overrides(text_file, **{**MOE, "parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1, **sets})
    assert main(["train", "--run-dir", str(tmp_path / "run"), *[x for o in sets for x in ("--set", o)]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before any work


def test_etp_resolves_to_tp_by_default_and_to_1_when_set():
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    d = ParallelDims.from_config(ParallelConfig(ep=2, tp=2), world_size=4, rank=0, local_rank=0)
    assert (d.etp, d.ep_borrows_tp) == (2, False)
    d = ParallelDims.from_config(ParallelConfig(ep=4, tp=2, etp=1), world_size=4, rank=0, local_rank=0)
    assert (d.etp, d.ep_borrows_tp, d.dp_shard) == (1, True, 2)
    # with pp and under HSDP (checked against one process by hand, docs/parallel.md)
    for extra in ({"pp": 2}, {"dp_replicate": 2, "dp_shard": 2}):
        d = ParallelDims.from_config(ParallelConfig(ep=2, tp=2, etp=1, **extra), world_size=8, rank=0, local_rank=0)
        assert d.ep_borrows_tp and d.dp_mode == "fsdp"
    # etp=1 with ep=1 or tp=1 changes nothing
    d = ParallelDims.from_config(ParallelConfig(ep=1, tp=2, etp=1), world_size=4, rank=0, local_rank=0)
    assert not d.ep_borrows_tp


@pytest.mark.parametrize("cp, sp, seq_len", [(2, 2, 16), (2, 4, 16), (2, 3, 24), (3, 2, 12), (4, 2, 48)])
def test_cp_sp_pieces_are_each_ranks_tokens_in_order(cp, sp, seq_len):
    """kiln/model/moe.py `cp_sp_pieces` against context_parallel.py's zig-zag token positions, split
    contiguously over tp: a slice within one chunk (sp even), across both (sp odd), several per chunk."""
    from kiln.model.moe import cp_sp_pieces
    from kiln.parallel.context_parallel import zigzag_positions

    piece_len = seq_len // len([p for r in range(cp) for t in range(sp) for p in cp_sp_pieces(seq_len, cp, sp, r, t)])
    for r in range(cp):
        held = zigzag_positions(seq_len, cp, r).tolist()
        for t in range(sp):
            pieces = cp_sp_pieces(seq_len, cp, sp, r, t)
            got = [p * piece_len + i for p in pieces for i in range(piece_len)]
            assert got == held[t * len(held) // sp:(t + 1) * len(held) // sp], (r, t)
