"""Replicated data parallelism over tensor-parallel pipeline stages (dp2 x tp2 x pp2, 8 gloo
ranks, Megatron's 3-D layout): ddp with 1F1B, zero1 with interleaved 1F1B and ddp with the ZBV
zero-bubble schedule give the per-step losses and grad norms of one process on the same global
batch, and so do ddp 1F1B with cp2 in place of dp2 (the replicas' all-reduce spans dp x cp) and
ddp 1F1B with tied embeddings (the last stage's head copy, against a tied one process), and a
mixture of experts with ep2 (ddp 1F1B, zero1 interleaved 1F1B; SGD), and zero1 1F1B with Muon
(its matrices stepped whole by their owner replica's tp ranks) (evaluation is off: its
batches are per rank, not split from one process's); the ddp runs' checkpoints, dense and MoE,
continue in one process on the global batch. The replicas are kiln's (torch's DDP cannot take
tp's DTensors), on the chunks' local shards, in buckets per chunk: under 1F1B and interleaved 1F1B
each bucket's all-reduce starts in the backward of its parameters' last micro-batch
(`data_parallel.OverlappedStageReplicas`; the per-chunk buckets matter under interleaved 1F1B,
which divides each chunk's gradients right after that chunk's last backward), under ZBV once
after the schedule (`SplitBackwardReplicas`).
Negative control: replicas that are never averaged (each dp rank steps on its own half of the
batch) do not match.

Tolerance: fp32, relative 3e-5 per step (below; TP reorders the row-wise reductions, PP the micro-batch
sums, DP the batch sum). AdamW with clipping active over 5 steps, so the optimizer state (sharded
under zero1) matters. Tiny model: 8 processes share the suite's 2 cores.
"""

import json
import shutil

import pytest

from kiln.config import load_config
from conftest import tiny_overrides
from ranks import patch_for_one_run, run_ranks
from test_moe_tensor_parallel_layouts import rows, train_on_rank

# fp32. On this project's AMD CPU the layouts come within 7e-7 of one process (torch 2.11 and
# 2.13). On the GPU machine's Intel Xeon (torch 2.11, its own stdlib as the corpus) the four
# layouts came 1.1e-5 to 2.0e-5 off one process, in the grad norms of steps 2-4. A likely cause,
# not established: AdamW's normalized update amplifies the tp shards' different rounding of
# near-zero gradients. Replicas that never average miss by far more (the control below).
REL = 3e-5
STEPS = 5
BASE = {"model.dim": 32, "model.n_layers": 4, "model.n_heads": 2, "model.tie_embeddings": "false",
        "data.seq_len": 16, "train.batch_size": 4, "train.grad_accum": 1, "train.steps": STEPS,
        "train.eval_every": 0, "checkpoint.every": STEPS - 1,
        "checkpoint.keep_last": 2, "optim.name": "adamw", "optim.lr": 0.01, "train.clip_grad_norm": 1.0,
        "train.device": "cpu", "schedule.warmup_steps": 0,
        "metrics.peak_flops": 1e12}  # a given peak: no matmul probe per run (seconds on a loaded core)
DP_TP_PP = {"train.batch_size": 2, "parallel.dp_replicate": 2,  # 2 per replica: the global 4
            "parallel.tp": 2, "parallel.pp": 2, "parallel.pp_microbatches": 2}
CASES = {
    "ddp_1f1b": {"parallel.dp_mode": "'ddp'", "parallel.pp_schedule": "'1f1b'"},
    "zero1_interleaved": {"parallel.dp_mode": "'zero1'", "parallel.pp_schedule": "'interleaved_1f1b'",
                          "parallel.pp_virtual_stages": 2},
    "ddp_zbv": {"parallel.dp_mode": "'ddp'", "parallel.pp_schedule": "'zbv_zero_bubble'",
                "parallel.pp_virtual_stages": 2},
    # cp2 in place of dp2: the replicas' all-reduce spans dp x cp (each cp rank holds half the sequence)
    "ddp_cp_1f1b": {"parallel.dp_mode": "'ddp'", "parallel.pp_schedule": "'1f1b'",
                    "parallel.dp_replicate": 1, "parallel.cp": 2, "train.batch_size": 4},
    # tied embeddings: the last stage's head copy of the first stage's embedding (pipeline_tied)
    "ddp_tied_1f1b": {"parallel.dp_mode": "'ddp'", "parallel.pp_schedule": "'1f1b'",
                      "model.tie_embeddings": "true"},
}
# Mixture of experts, ep2 over the two replicas (each expert's hidden units over tp): the dense
# shards are the replicas' (averaged over dp), the experts reduced over edp by expert parallelism.
# SGD: with AdamW these layouts met one process within 3e-7 except one grad norm (step 4, 6e-6 to
# 1e-5) while the losses stayed within 1e-7 (AdamW's normalized step; above); SGD shows the layout.
MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_aux_loss_weight": 0.1,
       "model.moe_z_loss_weight": 0.01, "optim.name": "'sgd'", "optim.lr": 0.1}
CASES["moe_ep2_ddp_1f1b"] = {**MOE, "parallel.ep": 2, **CASES["ddp_1f1b"]}
CASES["moe_ep2_zero1_interleaved"] = {**MOE, "parallel.ep": 2, **CASES["zero1_interleaved"]}
# Muon under zero1: each replica steps the tp-cut matrices it owns as DTensors, its stage's tp
# ranks gathering each whole (kiln/parallel/zero1.py `ZeroRedundancyState.stepped_as`)
MUON = {"optim.name": "'muon'", "optim.lr": 0.02, "optim.muon_adam_lr": 0.01}
CASES["zero1_1f1b_muon"] = {**MUON, "parallel.dp_mode": "'zero1'", "parallel.pp_schedule": "'1f1b'"}
# the one process each case is held to (else "untied")
REFERENCE = {"ddp_tied_1f1b": {"model.tie_embeddings": "true"}, "moe": MOE, "muon": MUON}


def reference(case: str) -> str:
    if case.startswith("moe"):
        return "moe"
    if case.endswith("_muon"):
        return "muon"
    return case if case in REFERENCE else "untied"


def job(text_file, **extra):
    return load_config(None, tiny_overrides(text_file, **{**BASE, **extra}))


def _worker(rank, world, text_file, tmp):
    from kiln.parallel import data_parallel

    made = []  # this rank's OverlappedStageReplicas, one per run
    original_init = data_parallel.OverlappedStageReplicas.__init__
    data_parallel.OverlappedStageReplicas.__init__ = lambda self, *a, **k: (original_init(self, *a, **k),
                                                                             made.append(self))[0]
    for name, extra in CASES.items():
        made.clear()
        train_on_rank(rank, world, job(text_file, **{**DP_TP_PP, **extra}), tmp / name)
        # buckets whose all-reduce started inside the backward, summed over the run's steps
        (tmp / name / f"overlapped-buckets-rank{rank}.txt").write_text(str(sum(r.launched_in_backward for r in made))
                                                                       if made else "none")
    data_parallel.OverlappedStageReplicas.__init__ = original_init
    undo = patch_for_one_run(data_parallel.Replicas, "_launch", lambda self, index, scale=1.0: None)  # never meet
    try:
        train_on_rank(rank, world, job(text_file, **DP_TP_PP, **CASES["ddp_1f1b"]), tmp / "not_averaged")
    finally:
        undo()


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory, text_file):
    tmp = tmp_path_factory.mktemp("dptppp")
    run_ranks(_worker, 8, tmp, text_file, tmp, timeout=400)
    return tmp


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, text_file):
    from kiln.train.trainer import train

    found = {}
    for name, extra in [("untied", {}), *REFERENCE.items()]:
        run = tmp_path_factory.mktemp("dptppp1") / name
        train(job(text_file, **extra), run)
        found[name] = rows(run)
    return found


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", list(CASES))
def test_dp2_tp2_pp2_matches_one_process(eight_ranks, one_process, case):
    got = rows(eight_ranks / case)  # [loss, grad norm(, moe aux, moe z)] per step
    want = one_process[reference(case)]
    per_step = 4 if case.startswith("moe") else 2
    assert len(got) == per_step * STEPS
    assert got == pytest.approx(want, rel=REL), (got, want)
    assert want[per_step * (STEPS - 1)] < want[0] and want[1] > 1.0  # trains, clips


@pytest.mark.parametrize("case", list(CASES))
def test_the_replicas_all_reduce_inside_the_backward_except_under_zero_bubble(eight_ranks, case):
    """1F1B and interleaved 1F1B accumulate gradients through autograd: each bucket's all-reduce
    starts in the backward of its parameters' last micro-batch (data_parallel.OverlappedStageReplicas);
    ZBV's weight pass bypasses the hooks, so its replicas average after the step."""
    counts = {(eight_ranks / case / f"overlapped-buckets-rank{r}.txt").read_text() for r in range(8)}
    if "zbv" in case:
        assert counts == {"none"}
    else:
        assert "none" not in counts and min(int(c) for c in counts) >= STEPS  # every step, every rank


def test_replicas_that_are_not_averaged_do_not_match(eight_ranks, one_process):
    got, one_process = rows(eight_ranks / "not_averaged"), one_process["untied"]
    assert got[1] != pytest.approx(one_process[1], rel=REL)  # the first step's grad norm already
    assert got[2:2 * STEPS] != pytest.approx(one_process[2:2 * STEPS], rel=REL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["ddp_1f1b", "moe_ep2_ddp_1f1b"])
def test_dp2_tp2_pp2_checkpoint_continues_in_one_process(eight_ranks, one_process, tmp_path, case):
    from kiln.train.trainer import train

    run = tmp_path / "resumed"
    shutil.copytree(eight_ranks / case, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}", ignore_errors=True)
    cfg = load_config(run / "config.toml", ["parallel.pp=1", "parallel.tp=1", "parallel.dp_replicate=1",
                                            "parallel.ep=1", "parallel.dp_mode='auto'", "train.batch_size=4"])
    train(cfg, run, resume=True)  # weights, optimizer state, the loader's position from step 4
    got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in got if r["kind"] == "train"][-1]
    assert step["step"] == STEPS and any(r["kind"] == "event" and r["message"].startswith(f"resumed step {STEPS - 1} ")
                                         for r in got)
    want = one_process[reference(case)]
    per_step = 4 if case.startswith("moe") else 2
    assert [step["loss"], step["grad_norm"]] == pytest.approx(want[-per_step:][:2], rel=REL)
