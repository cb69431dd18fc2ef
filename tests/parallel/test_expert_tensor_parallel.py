"""Expert parallel x tensor parallel ("expert tensor parallel", etp = tp): `kiln train`'s trainer
in-process on gloo ranks against one process on the same global batch.

Layouts (4 experts, top-2 with capacity factor 1.0, so assignments are dropped; AdamW, clipping
active on every step):
- ep2_tp2 (4 ranks): dp_shard=2 x tp=2; the 2 data-parallel ranks of each tp coordinate split
  the experts, every expert's hidden units are sharded over tp (experts on an (ep, tp) mesh).
- ep2_tp2_dp4 (8 ranks): dp_shard=4 x tp=2, ep=2, so the experts are also FSDP-sharded over the
  2 "edp" ranks that hold the same experts.
The step-3 checkpoints store every expert element exactly once, in (ep[, edp]) x tp chunks (their
DCP metadata), and ep2_tp2's continues (steps 4-5) in one process, under ep2 alone (4 ranks,
dp_shard=4) and under tp2 alone (4 ranks, dp_shard=2 x tp=2, ep=1).

Tolerance: fp32, relative 1e-5 per step for the loss (LM + weighted aux + z-loss), the
pre-clipping grad norm and the logged aux and z-losses (tp and ep change only the order of sums).
Negative controls (each must fail the comparison at step 1): the experts' input gradients not
summed over tp (each tp rank keeps its hidden slice's part), and expert gradients divided by
ep x tp (the tp ranks counted as data-parallel replicas).
"""

import json
import shutil

import pytest

from conftest import tiny_overrides
from ranks import patch_for_one_run, run_ranks
from test_expert_pipeline_context import (REL, SAVE_AT, STEPS, assert_matches_one_process, assert_same,
                                          jobs_with_mistakes, moe_job, rows)

MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_capacity_factor": 1.0,
       "model.moe_aux_loss_weight": 0.1, "model.moe_z_loss_weight": 0.01, "model.init_std": 0.1,
       "data.seq_len": 16}
LAYOUTS = {  # name -> (world, [parallel] settings)
    "single": (1, {}),
    "ep2_tp2": (4, {"parallel.tp": 2, "parallel.ep": 2}),
    "ep2_tp2_dp4": (8, {"parallel.tp": 2, "parallel.ep": 2}),
    "ep2": (4, {"parallel.ep": 2}),
    "tp2": (4, {"parallel.tp": 2}),
}
MISTAKES = ("tp_router_grad_not_summed", "aux_z_share_not_divided_by_tp", "experts_divided_by_ep_x_tp")


def overrides(text_file, shards, name):
    world, parallel = LAYOUTS[name]
    per_rank = {"parallel.dp_mode": "'fsdp'", "parallel.tp": 1, "parallel.ep": 1, **parallel}
    return moe_job(text_file, shards, per_rank, world // per_rank["parallel.tp"], moe=MOE)


def deliberate_mistake(kind):
    """Patch one deliberate mistake into this process; returns the undo."""
    if kind == "tp_router_grad_not_summed":  # MoE looks the helper up at call time
        from kiln.parallel import functional

        return patch_for_one_run(functional, "local_with_partial_grad", lambda param: param.to_local())
    if kind == "aux_z_share_not_divided_by_tp":  # then summed over tp with the gates' partial sums
        from kiln.parallel import functional

        return patch_for_one_run(functional, "grad_share_over_tp", lambda t, mesh: t)
    if kind == "experts_divided_by_ep_x_tp":  # the hook is bound when the experts are parallelized
        from kiln.parallel import expert_parallel as xp

        saved = xp._scaled_grad
        return patch_for_one_run(xp, "_scaled_grad", lambda grad, factor: saved(grad, factor / 2))
    return lambda: None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    from kiln.config import load_config
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("eptp")
    shards = root / "shards"
    sets = {name: overrides(text_file, shards, name) for name in LAYOUTS}
    out = {name: root / name for name in ["single", "ep2_tp2", "ep2_tp2_dp4", *MISTAKES]}
    train(load_config(None, sets["single"]), out["single"])  # writes the shared shards first
    for target in ("ep2", "tp2"):
        out[f"ep2_tp2->{target}"] = root / f"to-{target}"
    jobs = [(None, out["ep2_tp2"], sets["ep2_tp2"], None, None)]
    jobs += [(None, out[m], sets["ep2_tp2"], 1, m) for m in MISTAKES]
    jobs += [(out["ep2_tp2"], out[f"ep2_tp2->{t}"], sets[t], None, None) for t in ("ep2", "tp2")]
    (root / "ranks4").mkdir()
    run_ranks(jobs_with_mistakes, 4, root / "ranks4", deliberate_mistake, jobs, timeout=300)
    (root / "ranks8").mkdir()
    run_ranks(jobs_with_mistakes, 8, root / "ranks8", deliberate_mistake, [(None, out["ep2_tp2_dp4"], sets["ep2_tp2_dp4"], None, None)],
              timeout=300)
    out["ep2_tp2->single"] = run = root / "to-single"
    shutil.copytree(out["ep2_tp2"], run, ignore=shutil.ignore_patterns(f"step-{STEPS}"))
    train(load_config(None, sets["single"]), run, resume=True)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ep2_tp2", "ep2_tp2_dp4"])
def test_ep_with_tp_matches_one_process(runs, name):
    assert_matches_one_process(runs["single"], runs[name], LAYOUTS[name][0], name)


@pytest.mark.timeout(600)  # whichever test runs first sets the module's runs up
@pytest.mark.parametrize("target", ["single", "ep2", "tp2"])
def test_ep_tp_checkpoint_continues_in_another_layout(runs, target):
    pair = f"ep2_tp2->{target}"
    expected, got = rows(runs["single"]), rows(runs[pair])
    run_row = [json.loads(x) for x in (runs[pair] / "metrics.jsonl").read_text().splitlines() if '"run"' in x][-1]
    assert run_row["resumed_from"] == SAVE_AT
    assert_same(expected, got, range(SAVE_AT + 1, STEPS + 1), pair)


def expert_chunks(run, step=SAVE_AT):
    """{expert weight: (global size, [(offsets, sizes) of each saved chunk])} from a run's DCP
    checkpoint metadata (read through kiln's safe loader)."""
    from kiln.checkpoint.safe_load import load_metadata

    path = run / "checkpoints" / f"step-{step}" / ".metadata"
    meta = load_metadata(path.read_bytes(), str(path))
    return {k: (tuple(v.size), [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
            for k, v in meta.state_dict_metadata.items() if k.startswith("app.model.") and ".experts.w" in k}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, chunk", [("ep2_tp2", 2), ("ep2_tp2_dp4", 1)])
def test_ep_tp_checkpoint_saves_every_expert_element_once(runs, name, chunk):
    import torch

    weights = expert_chunks(runs[name])
    assert len(weights) == 2 * 3  # w1, w2, w3 of both MoE layers
    for key, (size, chunks) in weights.items():
        seen = torch.zeros(size, dtype=torch.int32)
        for offsets, sizes in chunks:
            # experts split over ep (and edp), hidden units (w1/w3 dim 2, w2 dim 1) over tp
            hidden = 1 if key.endswith("w2") else 2
            assert sizes[0] == chunk and sizes[hidden] == size[hidden] // 2, (key, sizes)
            seen[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert bool((seen == 1).all()), key  # every element saved by exactly one rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MISTAKES)
def test_each_deliberate_mistake_fails_the_comparison(runs, name):
    expected, got = rows(runs["single"]), rows(runs[name])
    assert sorted(got) == [1]
    assert got[1]["loss"] == pytest.approx(expected[1]["loss"], rel=REL)  # the same first forward
    assert got[1]["grad_norm"] != pytest.approx(expected[1]["grad_norm"], rel=10 * REL)


@pytest.mark.parametrize("world, sets, expected", [
    # (ep x tp runs under ddp/zero1, with pp too: tests/parallel/test_data_tensor_pipeline_parallel.py)
    # ep borrows data-parallel ranks (and cp), never tp: 4 ranks / tp 2 leave dp_shard=2 for ep=4
    (4, {"parallel.ep": 4}, "parallel.ep=4 must divide dp_shard=2"),
    # the experts must divide over ep, their hidden units over tp
    (4, {"model.moe_experts": 3, "model.moe_top_k": 1}, "parallel.ep=2 must divide model.moe_experts=3"),
    (4, {"model.ffn_hidden": 33}, "parallel.tp=2 must divide model.ffn_hidden (the FFN hidden size)=33"),
    (4, {"model.moe_hidden": 33}, "parallel.tp=2 must divide model.moe_hidden (the experts' hidden size)=33"),
])
def test_ep_tp_layouts_that_cannot_divide_are_refused_in_one_line(text_file, tmp_path, monkeypatch, capsys,
                                                                  world, sets, expected):
    from kiln.cli import main

    for name, value in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    sets = tiny_overrides(text_file, **{**MOE, "parallel.tp": 2, "parallel.ep": 2, **sets})
    assert main(["train", "--run-dir", str(tmp_path / "run"), *[x for o in sets for x in ("--set", o)]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before any work


def test_ep_tp_under_fsdp_or_zero2_is_accepted():
    from kiln.config import ParallelConfig
    from kiln.parallel.dims import ParallelDims

    for mode in ("fsdp", "zero2"):
        d = ParallelDims.from_config(ParallelConfig(ep=2, tp=2, dp_mode=mode), world_size=8, rank=0, local_rank=0)
        assert (d.dp_mode, d.dp_shard, d.tp, d.ep) == (mode, 4, 2, 2)
