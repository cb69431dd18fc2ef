"""Keep the training benchmarks runnable: each runs its --quick mode (figures are noise)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_throughput_quick(tmp_path):
    out = tmp_path / "throughput.json"
    assert _load("throughput").main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["sizes"]["tiny"]["fp32"]
    assert {r["case"] for r in rows} == {"kiln-default fp32", "kiln-gpt2 fp32", "nanoGPT baseline fp32"}
    assert all(r["tokens_per_s"] > 0 and r["mfu_fp32"] > 0 for r in rows)
    assert any(e["op"] == "aten::mm" for e in result["sizes"]["tiny"]["profile_kiln_default_eager"])


@pytest.mark.timeout(90)
def test_time_to_loss_quick(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)))
    out = tmp_path / "ttl.json"
    assert _load("time_to_loss").main([str(corpus), "--quick", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"default", "baseline"}
    for run in runs.values():  # the quick target (loss 100) is met at the first evaluation
        assert run["reached"] is not None and run["reached"]["step"] == 3
        assert run["reached"]["train_wall_s"] > 0 and run["cpu_s_to_target"] is not None


def test_time_to_loss_rejects_missing_corpus(tmp_path):
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="not found"):
        _load("time_to_loss").main([str(tmp_path / "nope.txt"), "--quick"])


@pytest.mark.timeout(60)
def test_zero1_partition_measures_both_partitions_and_the_prediction(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs this process free of another process group")
    out = tmp_path / "zero1.json"
    assert _load("zero1_partition").main(["--configs", "configs/llama-1b.toml", "--ranks", "2,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [2, 3]
    for r in rows:  # multiples of the even share: never below it, kiln's never fuller than torch's
        for name in ("adamw", "muon", "lamb"):
            assert r[f"predicted_{name}"] == pytest.approx(r[name], abs=1e-6) and 1 <= r[name] <= r["torch"]
        assert r["adamw"] == pytest.approx(1, abs=1e-6)  # cut: even


@pytest.mark.timeout(120)
def test_zero1_checkpoint_saves_shares_and_loads_them_back(tmp_path):
    out = tmp_path / "zero1_checkpoint.json"
    argv = ["--worlds", "2", "--rounds", "1", "--dim", "64", "--heads", "2", "--layers", "1", "--vocab", "256",
            "--out", str(out)]
    assert _load("zero1_checkpoint").main(argv) == 0  # exits non-zero unless each rank loaded back exactly
    (row,) = json.loads(out.read_text())["worlds"]
    kiln, consolidated = row["kiln"], row["consolidated"]
    assert row["full_state_bytes"] <= consolidated["state_bytes"] <= row["full_state_bytes"] + 1024  # + Adam's steps
    assert row["full_state_bytes"] / 2 <= kiln["state_bytes"] <= row["full_state_bytes"] / 2 + 1024  # its half
    assert kiln["sent_bytes"] < consolidated["sent_bytes"] / 10
    assert kiln["read_bytes"] < consolidated["read_bytes"]  # its boxes, not the whole state


@pytest.mark.timeout(120)
def test_replicated_staging_stages_a_share_and_loads_back(tmp_path):
    out = tmp_path / "replicated_staging.json"
    argv = ["--worlds", "2", "--modes", "ddp", "--rounds", "1", "--dim", "64", "--heads", "2", "--layers", "1",
            "--vocab", "256", "--out", str(out)]
    assert _load("replicated_staging").main(argv) == 0  # exits non-zero unless each rank loaded back exactly
    (row,) = json.loads(out.read_text())["results"]
    assert row["whole"]["staged_bytes"] == row["state_bytes"]
    assert row["owned"]["staged_bytes"] < 0.6 * row["state_bytes"]  # about half, DCP's balance


def test_every_benchmark_measures_its_own_checkouts_kiln():
    """A benchmark run from a worktree (an old commit against a new one) must import that
    worktree's kiln: running a script puts only benchmarks/ on sys.path, and an editable install
    then resolves `kiln` to whichever checkout was installed, so both sides measured one code. Every
    entry point that imports kiln puts its repository root first, before its first kiln import."""
    import re

    root_first = re.compile(r"^sys\.path\.insert\(0, str\((Path\(__file__\)\.resolve\(\)\.(parents\[1\]|parent\.parent)|REPO)\)\)",
                            re.M)
    for script in sorted(BENCHMARKS.glob("*.py")):
        text = script.read_text()
        if '__name__ == "__main__"' not in text or not re.search(r"^\s*(from|import) kiln", text, re.M):
            continue
        inserted = root_first.search(text)
        first_import = re.search(r"^(from|import) kiln", text, re.M)
        assert inserted, f"{script.name}: does not put its repository root on sys.path"
        assert first_import is None or inserted.start() < first_import.start(), f"{script.name}: kiln imported first"


@pytest.mark.timeout(120)
def test_hf_interop_quick(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf_interop.json"
    assert _load("hf_interop").main(["--quick", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["class"] == "Qwen3ForCausalLM" and row["import_s"] > 0 and row["export_s"] > 0
    assert row["import_max_abs_logit_diff"] < 1e-4 and row["export_max_abs_logit_diff"] < 1e-4


@pytest.mark.timeout(120)
def test_parallel_eval_splits_and_scores_what_one_rank_scores(tmp_path):
    out = tmp_path / "parallel_eval.json"
    argv = ["--layouts", "dp,cp,pp", "--dim", "64", "--layers", "2", "--heads", "2", "--vocab", "256", "--seq", "64",
            "--batch", "2", "--windows", "8", "--rounds", "1", "--out", str(out)]
    assert _load("parallel_eval").main(argv) == 0  # exits non-zero unless split and whole losses agree
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dp", "cp", "pp"}
    for row in rows.values():  # each rank holds a block of the windows, a half of each sequence, or
        assert row["split"]["peak_bytes"] < row["whole"]["peak_bytes"]  # (pp) one micro-batch's logits


@pytest.mark.timeout(60)
def test_sliding_window_compares_blocked_dense_and_causal(tmp_path):
    out = tmp_path / "sliding_window.json"
    assert _load("sliding_window").main(["--cases", "1x2x64x8w16,1x2x40x8w16", "--repeats", "1",
                                         "--out", str(out)]) == 0  # fails unless blocked == dense mask
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq"] for r in rows] == [64, 40] and all(r["max_abs_diff"] <= 1e-5 for r in rows)
    assert all(r["blocked_s"] > 0 and r["dense_mask_saved_bytes"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_ring_attention_compares_schedules_and_kernels(tmp_path):
    out = tmp_path / "ring_attention.json"
    argv = ["--cp", "3", "--cases", "48w0,48w9", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--rounds", "1",
            "--out", str(out)]
    assert _load("ring_attention").main(argv) == 0  # exits non-zero unless every variant gives kiln's result
    plain, windowed = json.loads(out.read_text())["rows"]
    assert plain["hops"] is None and plain["ring_blocks"] == plain["kiln_blocks"] == 7  # 3 cp - 2
    assert windowed["hops"] == 1 and (windowed["ring_blocks"], windowed["kiln_blocks"]) == (7, 6)
    assert all(row[f"{v}_peak_bytes"] > 0 and row[f"{v}_s"] > 0 for row in (plain, windowed)
               for v in ("kiln", "ring", "matmul"))


@pytest.mark.timeout(120)
def test_cp_modes_compares_ring_and_ulysses(tmp_path):
    out = tmp_path / "cp_modes.json"
    argv = ["--cp", "2", "--cases", "32k2,32k1", "--heads", "4", "--head-dim", "8", "--rounds", "1",
            "--ulysses-rounds", "2", "--out", str(out)]
    assert _load("cp_modes").main(argv) == 0  # exits non-zero unless Ulysses gives the ring's result
    rows = json.loads(out.read_text())["rows"]
    # Ulysses: q, k, v (K/V repeated to 2 heads where there is 1) and the output, 16 tokens x 4 and 2
    # heads x 8 fp32 each, half of it leaving the rank, forward and backward; in 2 rounds the same (a
    # rank's one K/V head goes whole in the first round, not repeated)
    assert [r["ulysses_bytes"] for r in rows] == [(2 * 4 + 2 * 2) * 16 * 8 * 4 // 2 * 2] * 2
    assert [r["rounds_bytes"] for r in rows] == [r["ulysses_bytes"] for r in rows]
    assert all(r["ring_bytes"] > 0 and r["ring_s"] > 0 and r["ulysses_peak_bytes"] > 0 for r in rows)
    assert all(0 < r["rounds_forward_s"] < r["rounds_s"] for r in rows)
    # Ulysses over 2 ranks x the ring over 2 (parallel.ulysses_degree), compared on whole sequences
    argv = ["--cp", "4", "--hybrid", "2", "--cases", "32k4", "--heads", "4", "--head-dim", "8", "--rounds", "1",
            "--out", str(out)]
    assert _load("cp_modes").main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hybrid_bytes"] > 0 and row["hybrid_s"] > 0 and row["max_difference"] <= 1e-5


@pytest.mark.timeout(120)
def test_ep_dispatch_compares_the_exchanges(tmp_path):
    out = tmp_path / "ep_dispatch.json"
    argv = ["--ep", "4", "--node-ranks", "2", "--cases", "k1e8,k4e8", "--tokens", "64", "--dim", "16", "--hidden", "32",
            "--rounds", "1", "--out", str(out)]
    assert _load("ep_dispatch").main(argv) == 0  # exits non-zero unless the exchanges give the same result
    top1, top4 = json.loads(out.read_text())["rows"]
    # top-1: one row per assignment either way; top-4: fewer rows when a token's experts share a
    # rank, and fewer leaving a node two-level
    assert top1["kiln_rows_all_ranks"] == top1["per_assignment_rows_all_ranks"] > 0
    assert 0 < top4["kiln_rows_all_ranks"] < top4["per_assignment_rows_all_ranks"]
    assert 0 < top4["two_level_node_rows_all_ranks"] < top4["kiln_node_rows_all_ranks"]
    assert all(row[f"{v}_s"] > 0 for row in (top1, top4) for v in ("kiln", "per_assignment", "two_level"))


@pytest.mark.timeout(120)
def test_moe_balancing_runs_every_recipe(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    out = tmp_path / "moe_balancing.json"
    assert _load("moe_balancing").main(["--quick", "--steps", "6", "--data", str(corpus), "--workdir",
                                        str(tmp_path / "runs"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"none", "aux loss 0.01", "bias 0.001", "bias 0.01"}
    assert all(r["max_load_last"] >= 1.0 and r["step_ms"] > 0 and r["val_loss"] > 0 for r in results.values())


@pytest.mark.timeout(180)
def test_muon_sharded_compares_gathering_with_dealing_out(tmp_path):
    out = tmp_path / "muon_sharded.json"
    argv = ["--worlds", "2", "--rounds", "1", "--steps", "1", "--dim", "32", "--layers", "2", "--hidden", "64",
            "--vocab", "64", "--out", str(out)]
    assert _load("muon_sharded").main(argv) == 0  # exits non-zero unless both variants step alike
    row = json.loads(out.read_text())["worlds"]["2"]
    assert row["difference"] == 0.0
    assert all(row["step_s"][v] > 0 and row["sent_bytes_per_rank"][v] > 0 for v in ("gather", "split"))


@pytest.mark.timeout(180)
def test_adafactor_sharded_times_the_sharded_step_against_one_process(tmp_path):
    out = tmp_path / "adafactor_sharded.json"
    argv = ["--worlds", "1,2", "--rounds", "1", "--steps", "1", "--dim", "32", "--layers", "2", "--hidden", "64",
            "--vocab", "64", "--out", str(out)]
    assert _load("adafactor_sharded").main(argv) == 0  # exits non-zero unless the sharded step is one process's
    worlds = json.loads(out.read_text())["worlds"]
    assert set(worlds["1"]["step_s"]) == {"torch", "kiln", "adamw"} and set(worlds["2"]["step_s"]) == {"kiln", "adamw"}
    assert worlds["2"]["all_reduces_per_step"] == 3 and worlds["2"]["sent_bytes_per_rank"] > 0
    assert worlds["2"]["difference"] < 1e-5


@pytest.mark.timeout(240)
def test_moe_tp_backward_swaps_an_all_reduce_for_a_reduce_scatter_per_block(tmp_path):
    out = tmp_path / "moe_tp_backward.json"
    argv = ["--tp", "2", "--rounds", "1", "--steps", "1", "--dim", "64", "--layers", "2", "--heads", "2",
            "--vocab", "256", "--rows", "2", "--out", str(out)]
    assert _load("moe_tp_backward").main(argv) == 0
    row = json.loads(out.read_text())["layouts"]["tp2"]
    before, after = (row[v]["c10d_calls"] for v in ("all_reduce", "reduce_scatter"))

    def calls(counts, kind):
        return sum(n for op, n in counts.items() if kind in op)

    # per MoE block (2) one all-reduce of the gathered tokens' gradient becomes a reduce-scatter
    assert calls(before, "allreduce") - calls(after, "allreduce") == 2
    assert calls(after, "reduce_scatter") - calls(before, "reduce_scatter") == 2
    assert row["all_reduce"]["loss"] == pytest.approx(row["reduce_scatter"]["loss"], rel=1e-6)


@pytest.mark.timeout(240)
def test_reduce_dtype_halves_the_gradient_bytes(tmp_path):
    out = tmp_path / "reduce_dtype.json"
    argv = ["--worlds", "2", "--rounds", "1", "--steps", "1", "--dim", "64", "--layers", "2", "--heads", "2",
            "--vocab", "256", "--rows", "2", "--out", str(out)]
    assert _load("reduce_dtype").main(argv) == 0
    row = json.loads(out.read_text())["layouts"]["ddp x2"]
    fp32, bf16 = (row[v]["sent_bytes_per_rank"] for v in ("fp32", "bf16"))
    assert 0.45 < bf16 / fp32 < 0.55  # the gradients' all-reduce is (nearly) all the traffic
    assert row["bf16"]["loss"] == pytest.approx(row["fp32"]["loss"], rel=1e-3)


@pytest.mark.timeout(240)
def test_ddp_grad_buckets_runs_both_variants_to_the_same_loss(tmp_path):
    out = tmp_path / "ddp_grad_buckets.json"
    argv = ["--rounds", "1", "--steps", "1", "--dim", "64", "--layers", "2", "--heads", "2", "--vocab", "256",
            "--out", str(out)]
    assert _load("ddp_grad_buckets").main(argv) == 0
    rows = json.loads(out.read_text())["variants"]
    assert rows["copy"]["loss"] == rows["view"]["loss"]  # the same sums, only where they live differs
    assert all(rows[v]["peak_mib"] >= rows[v]["rss_mib"] > 0 for v in ("copy", "view"))
