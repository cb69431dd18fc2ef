"""benchmarks/parallel_memory.py: the collective counts it reports, its layout table and --only
selection, the merge of a partial run into a results file, and one --quick run of the layouts
issue 7 added (expert parallel and DiLoCo at 2 processes) checked against exact byte counts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # the multi-process harness

from comm_count import event_bytes, scaled, summarize  # noqa: E402
from parallel_rows import rows, select, unsupported  # noqa: E402
from ranks import run_ranks  # noqa: E402
from conftest import require_fsdp2_on_cpu  # noqa: E402


def _counted(rank, n):
    """Known collectives under the counting profiler: 2 all-reduces (one explicit, DDP's single
    bucket), one all-gather of a 10-float shard, one bf16 broadcast, a send or a receive."""
    import torch
    import torch.distributed as dist

    from comm_count import counting_collectives

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))  # 72 parameters
    for _ in range(2):  # not counted: DDP builds its buckets, then rebuilds them (broadcasting their order)
        model(torch.ones(2, 8)).sum().backward()
    with counting_collectives() as comm:
        dist.all_reduce(torch.ones(1000))
        model(torch.ones(2, 8)).sum().backward()
        dist.all_gather_into_tensor(torch.empty(10 * n), torch.ones(10))
        dist.broadcast(torch.ones(6, dtype=torch.bfloat16), src=0)
        dist.send(torch.ones(5), 1) if rank == 0 else dist.recv(torch.empty(5), 0)
    return comm


def test_counts_of_known_collectives_on_two_gloo_ranks(tmp_path):
    for rank, comm in enumerate(run_ranks(_counted, 2, tmp_path, timeout=90)):
        ops = comm["by_op"]
        assert ops["all_reduce"] == {"calls": 2, "bytes": 1000 * 4 + 72 * 4}
        assert ops["all_gather"] == {"calls": 1, "bytes": 10 * 4}  # this rank's shard, not the output
        assert ops["broadcast"] == {"calls": 1, "bytes": 6 * 2}
        p2p = "send" if rank == 0 else "recv"
        assert ops[p2p] == {"calls": 1, "bytes": 5 * 4}
        sent = 4000 + 288 + 40 + 12 + (20 if rank == 0 else 0)
        assert (comm["sent_bytes"], comm["received_bytes"], comm["calls"]) == (sent, 20 * rank, 5)


def test_summary_per_step_and_unknown_dtype():
    events = [SimpleNamespace(name="gloo:all_reduce", input_shapes=[[4, 8]], input_dtypes=["float"]),
              SimpleNamespace(name="aten::mm", input_shapes=[[4, 8]], input_dtypes=["float"]),
              SimpleNamespace(name="gloo:all_to_all", input_shapes=[[6], [], []], input_dtypes=["long int", "", ""])]
    s = summarize(events)
    assert s["by_op"] == {"all_reduce": {"calls": 1, "bytes": 128}, "all_to_all": {"calls": 1, "bytes": 48}}
    per = scaled(s, 4)
    assert (per["calls"], per["sent_bytes"], per["by_op"]["all_reduce"]["bytes"]) == (0.5, 44, 32)
    with pytest.raises(ValueError, match="float4"):
        event_bytes([[2]], ["float4"])


def test_layouts_for_the_benchmark_model():
    table = {r.name: r for r in rows(384, 6, 6, 128, 256, 8)}
    for name in ("hsdp@4", "moe_ep@2", "moe_ep@4", "moe_fsdp@4", "diloco@2", "tp@4", "cp@4", "pp_1f1b@4",
                 "pp_gpipe@4", "pp_interleaved_1f1b@2"):
        assert name in table
    assert "model.n_heads=8" in table["tp@4"].overrides  # 6 heads do not split 4 ways
    assert "parallel.dp_replicate=2" in table["hsdp@4"].overrides and table["hsdp@4"].shard == 2
    assert "parallel.diloco_inner_steps=8" in table["diloco@2"].overrides
    # 2 stages per rank: on the 6-layer model at 2 processes, on its 8-layer variant at 4
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"):
        two, four = table[f"pp_{schedule}@2"], table[f"pp_{schedule}@4"]
        assert "parallel.pp_virtual_stages=2" in two.overrides and two.reference == "single@1"
        assert four.overrides[-1] == "model.n_layers=8" and four.reference == "deep_single@1"
    assert table["deep_single@1"].overrides == ("parallel.dp_mode='ddp'", "model.tie_embeddings=false",
                                                "model.n_layers=8")
    assert "deep_single@1" not in {r.name for r in rows(384, 6, 8, 128, 256, 8)}  # 8 layers take pp=4 x 2
    assert unsupported(384, 6, 6, 128) == []


def test_only_selects_layouts_and_their_reference():
    all_rows = rows(384, 6, 6, 128, 256, 8)
    names = lambda only, worlds=(1, 2, 4): [r.name for r in select(all_rows, only, list(worlds))]  # noqa: E731
    assert names("hsdp,moe_ep@2") == ["single@1", "moe_single@1", "moe_ep@2", "hsdp@4"]  # measuring order
    assert names("moe_ep", (1, 2)) == ["moe_single@1", "moe_ep@2"]
    assert len(names("")) == len(all_rows)
    assert names("pp_zbv_zero_bubble") == ["single@1", "deep_single@1", "pp_zbv_zero_bubble@2", "pp_zbv_zero_bubble@4"]
    assert "deep_single@1" not in names("", (1, 2))  # its model runs only at 4 processes
    with pytest.raises(ValueError, match="hsdp@2"):
        names("hsdp@2")


def _run(mode, world, step_s, **extra):
    return {"mode": mode, "world": world, "overrides": [], "step_s_median": step_s,
            "per_rank": [{"params": 1, "step_s": step_s} for _ in range(world)], **extra}


def test_bubble_of_rows_measured_before_it_was_recorded():
    from parallel_results import bubble, layout_name

    gpipe = _run("pp_gpipe", 2, 1.0, overrides=["parallel.pp=2", "parallel.pp_schedule='gpipe'",
                                                "parallel.pp_microbatches=4", "model.tie_embeddings=false"])
    assert bubble(gpipe) == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    zbv = _run("pp_zbv_zero_bubble", 4, 1.0, overrides=["model.n_layers=8"])
    zbv["per_rank"][0]["bubble_fraction"] = 0.25  # recorded: taken as it is
    assert bubble(zbv) == 0.25 and bubble(_run("ddp", 2, 1.0)) is None
    assert layout_name(zbv) == "pp_zbv_zero_bubble (8 layers)"


def test_partial_run_merges_into_results():
    import parallel_results as pm

    old = {"single": {"n_params": 1, "step_s_median": 1.0}, "args": {}, "runs": [_run("ddp", 2, 0.5), _run("tp", 2, 0.9)]}
    new = {"single": {"step_s_median": 3.0}, "command": "c", "date_utc": "d", "rounds": [], "seconds": 1,
           "machine": {}, "runs": [_run("ddp", 2, 1.5), _run("hsdp", 4, 2.0), _run("moe_single", 1, 2.0)]}
    merged = pm.merge(old, new, {"hsdp@4", "ddp@2"})
    by_name = {f"{r['mode']}@{r['world']}": r["step_s_median"] for r in merged["runs"]}
    # named layouts replace theirs; a reference the file lacks is added; single (not named) stays
    assert by_name == {"tp@2": 0.9, "ddp@2": 1.5, "hsdp@4": 2.0, "moe_single@1": 2.0}
    assert merged["single"]["step_s_median"] == 1.0 and merged["partial_runs"][0]["layouts"][0] == "ddp@2"

    counted = dict(new, runs=[_run("tp", 2, 5.0, per_rank=[{"comm": {"calls": 3}}, {"comm": {"calls": 4}}])])
    merged = pm.add_counts(old, counted)
    tp = next(r for r in merged["runs"] if r["mode"] == "tp")
    assert tp["step_s_median"] == 0.9 and [r["comm"]["calls"] for r in tp["per_rank"]] == [3, 4]


@pytest.mark.timeout(240)
def test_quick_run_of_expert_parallel_and_diloco(tmp_path):
    require_fsdp2_on_cpu()  # moe_ep is ep=2 carved out of fsdp's dp_shard
    out = tmp_path / "pm.json"  # an earlier run of the same (--quick) model: the new rows merge into it
    single = {"n_params": 1, "params": 4, "params_after_forward": 4, "grads": 4, "optimizer": 8, "step_s_median": 1.0}
    earlier = _run("tp", 2, 0.5)
    out.write_text(json.dumps({"args": {"dim": 32, "layers": 4, "heads": 2, "vocab": 256, "seq": 16, "batch": 4},
                               "single": single, "runs": [earlier]}))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "parallel_memory.py"), "--quick", "--only",
                           "moe_ep,diloco,pp_zbv_zero_bubble", "--out", str(out)], capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = {f"{r['mode']}@{r['world']}": r for r in data["runs"]}
    assert set(runs) == {"tp@2", "moe_single@1", "moe_ep@2", "diloco@2", "pp_zbv_zero_bubble@2"}
    assert runs["tp@2"] == earlier and data["single"] == single  # not named: kept as they were
    assert data["partial_runs"][0]["layouts"] == ["diloco@2", "moe_ep@2", "moe_single@1", "pp_zbv_zero_bubble@2"]
    del runs["tp@2"]
    # ZBV at 2: stages 0 and 3 on rank 0 (embedding and head), 1 and 2 on rank 1; 4 micro-batches.
    zbv = runs.pop("pp_zbv_zero_bubble@2")
    assert [p["bubble_fraction"] for p in zbv["per_rank"]] == [pytest.approx(1 / 9)] * 2  # (p-1) / (v m + p-1)
    assert all(p["comm"]["by_op"]["send"]["calls"] > 0 for p in zbv["per_rank"])
    assert "| pp_zbv_zero_bubble | 2 |" in data["table"] and data["table"].count("| 0.11 |") == 1
    for r in runs.values():
        assert all(math.isfinite(p["loss"]) and p["loss"] < 2 * math.log(256) for p in r["per_rank"])
    ep = runs["moe_ep@2"]
    assert ep["worst_over_ideal"] == pytest.approx(1.0)  # ep=2 x fsdp 2: every part split in two
    assert all(p["comm"]["by_op"]["all_to_all"]["calls"] > 0 for p in ep["per_rank"])
    diloco = runs["diloco@2"]
    h = diloco["per_rank"][0]["sync_every"]
    # One all-reduce of every fp32 parameter per H steps, nothing else.
    for p in diloco["per_rank"]:
        assert p["comm"]["by_op"] == {"all_reduce": {"calls": 1 / h, "bytes": p["n_params"] * 4 / h}}


def test_run_entry_keeps_each_rounds_slowest_rank():
    import parallel_memory as pm
    from parallel_rows import Row

    rounds = [[{"step_s": 1.0, "cpu_s": 1.0}, {"step_s": 3.0, "cpu_s": 1.0}],
              [{"step_s": 2.0, "cpu_s": 1.0}, {"step_s": 1.0, "cpu_s": 1.0}],
              [{"step_s": 5.0, "cpu_s": 1.0}, {"step_s": 1.5, "cpu_s": 1.0}]]
    entry = pm.run_entry(Row("ddp", 2, "dp", ()), rounds, [0.0] * 3, None)
    assert entry["step_s_rounds"] == [3.0, 2.0, 5.0] and entry["step_s_median"] == 3.0
    assert entry["step_s_spread"] == pytest.approx(1.0)
    assert [r["step_s"] for r in entry["per_rank"]] == [2.0, 1.5]  # each rank's median over the rounds
