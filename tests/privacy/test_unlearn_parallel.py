"""`kiln unlearn` under FSDP: 2 gloo ranks (the run's default layout, dp_shard over both) give the
same per-step losses, grad norms and metrics as one process, within fp32 tolerance, and write a
checkpoint that a single process loads with the same weights.

Tolerance: rtol 1e-4 / atol 1e-5 on losses, grad norms and weights (the two runs differ only in
the order of fp32 sums: FSDP's reduce-scatter of the gradients, and each rank's half of the
loss); EL/MA are argmax counts, equal unless a logit pair ties within that noise (abs 1e-6).
Wrong math fails it: a rank ascending on the whole chunk, or a missing scale, changes the losses
after the first step and the grad norm of every step. Both retain terms are checked (`lm`, and
`kl`: KL from the original model, loaded as a second FSDP model), as are the canary chunk's format
term and the validation loss, which the ranks split (each scores its block of the windows).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import require_fsdp2_on_cpu
from kiln.cli import main
from kiln.config import load_config

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "data.tokenizer=byte", "data.seq_len=32",
        "model.max_seq_len=32", "train.batch_size=4", "train.steps=30", "train.dtype=fp32",
        "metrics.progress=none", "train.eval_every=0", "metrics.peak_flops=1e12", "schedule.warmup_steps=2",
        "checkpoint.every=0", "train.device=cpu"]
CORPUS = "the quick brown fox jumps over the lazy dog. " * 40 + "a stitch in time saves nine. " * 40
FORGET = ["the quick brown fox jumps", "over the lazy dog. the", "a stitch in time saves"]
HELDOUT = ["QZXJ#@!%&*QZXJ#@", "#@!%QZXJ&*#@!%QZ"]  # bytes never trained on: MA ~0


def _args(run_dir: Path, out: Path, retain_loss: str) -> list[str]:
    # --force and --margin 0 with a 3-step budget: every chunk takes all its steps, so the per-step
    # rows compare; chunks of 3 plain rows (split 2 + 1 padded) then the canary alone (rank 1:
    # padding only);
    # 3 retain windows per step split 2 + 1 (padded).
    return ["unlearn", str(run_dir), "--forget", str(run_dir.parent / "forget.jsonl"), "--retain",
            str(run_dir.parent / "corpus.txt"), "--retain-batch", "3", "--chunk", "3", "--max-steps", "3",
            "--margin", "0", "--force", "--lr", "1e-3", "--clip-grad-norm", "0", "--candidates", "20",
            "--val-tokens", "300", "--device", "cpu", "--retain-loss", retain_loss, "--out", str(out)]


def _unlearn_rank(rank, n, run_dir, outs):
    """Every retain loss's `kiln unlearn` on the 2 ranks of one launch: their exit codes."""
    os.environ.update(WORLD_SIZE=str(n), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    return [main(_args(Path(run_dir), Path(out), retain_loss)) for retain_loss, out in outs]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from kiln.train.trainer import train

    require_fsdp2_on_cpu()  # the run's default 2-rank layout is fsdp
    root = tmp_path_factory.mktemp("unlearn-fsdp")
    (root / "corpus.txt").write_text(CORPUS)
    # One canary row each (exposure: candidates scored by the rank that holds the row, so the
    # ranks score different numbers of sequences and must still run the same forwards).
    canary = {"prefix": "my code is ", "digits": 3}
    rows = [{"text": t} for t in FORGET] + [{"text": t, "heldout": True} for t in HELDOUT] + [
        {**canary, "text": "my code is 4-0-7", "secret": "4-0-7"},
        {**canary, "text": "my code is 9-1-3", "secret": "9-1-3", "heldout": True}]
    (root / "forget.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(load_config(None, TINY + [f"data.source={root / 'corpus.txt'}"]), root / "run")
    return root / "run"


RETAIN_LOSSES = ["lm", "kl"]


@pytest.fixture(scope="module")
def outputs(run_dir, tmp_path_factory):
    """retain loss -> (one-process output, 2-rank output): the one-process runs in this process,
    both 2-rank runs in one launch."""
    from parallel.ranks import run_ranks

    root = tmp_path_factory.mktemp("unlearn-outputs")
    outs = {loss: (root / f"one-{loss}", root / f"two-{loss}") for loss in RETAIN_LOSSES}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for loss, (one, _) in outs.items():
            assert main(_args(run_dir, one, loss)) == 0
    finally:
        torch.set_num_threads(threads)
    assert run_ranks(_unlearn_rank, 2, root, str(run_dir), [(loss, str(two)) for loss, (_, two) in outs.items()],
                     timeout=500) == [[0, 0], [0, 0]]
    return outs


@pytest.mark.timeout(600)  # both retain losses: ~220 s each seen at load average 28 on 2 cores
@pytest.mark.parametrize("retain_loss", RETAIN_LOSSES)
def test_two_fsdp_ranks_match_one_process(outputs, retain_loss):
    from kiln.eval.load import load_run

    one, two = outputs[retain_loss]
    a = json.loads((one / "reports" / "unlearning.json").read_text())
    b = json.loads((two / "reports" / "unlearning.json").read_text())
    assert (a["world_size"], b["world_size"], b["dp_mode"]) == (1, 2, "fsdp")
    assert [c["steps"] for c in a["chunks"]] == [c["steps"] for c in b["chunks"]] == [3, 3]
    assert b["chunks"][1]["exposure"] == pytest.approx(a["chunks"][1]["exposure"], abs=1e-6)  # the canary's
    for ca, cb in zip(a["chunks"], b["chunks"]):
        for ha, hb in zip(ca["history"], cb["history"]):
            assert ha.keys() == hb.keys()
            for key in ("loss", "forget_nll", "format_nll", "retain", "grad_norm"):
                if key not in ha:  # format_nll: only chunks with canary rows (the second)
                    continue
                assert hb[key] == pytest.approx(ha[key], rel=1e-4, abs=1e-5), (ha["step"], key)
            for key in ("el", "ma"):
                assert hb[key] == pytest.approx(ha[key], abs=1e-6), (ha["step"], key)
    for part in ("forget_before", "heldout_reference", "forget_after", "heldout_after"):
        for key, value in a[part].items():
            assert b[part][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (part, key)
    assert a["options"]["retain_loss"] == b["options"]["retain_loss"] == retain_loss
    if retain_loss == "kl":  # 0 at the first step (the model is the original), > 0 once it has moved
        first = a["chunks"][0]["history"]
        assert first[0]["retain"] == pytest.approx(0, abs=1e-6) and first[1]["retain"] > 1e-6
    # Validation is split over the ranks (each scores its block of the windows) and equals one process.
    for part in ("val_before", "val_after"):
        assert len(b[part]["rank_tokens"]) == 2 and 0 < min(b[part]["rank_tokens"])
        assert sum(b[part]["rank_tokens"]) == b[part]["tokens"] == a[part]["tokens"] == a[part]["rank_tokens"][0]
        for key in ("loss", "bpb"):
            assert b[part][key] == pytest.approx(a[part][key], rel=1e-5), (part, key)
    plain, canary = a["chunks"][0]["history"], a["chunks"][1]["history"]
    assert plain[-1]["forget_nll"] > plain[0]["forget_nll"]  # it did ascend (the NLL before each step)
    assert "format_nll" not in plain[0] and canary[-1]["format_nll"] < canary[0]["format_nll"]  # and kept the format
    # The DCP checkpoint the two ranks wrote loads in one process, with the same weights. AdamW
    # divides by sqrt(v): where an element's gradient is near zero, the ranks' fp32 sum-order noise
    # becomes an update difference of up to about lr per step. So a few elements (at most 1 in
    # 1,000 per tensor) may be off by up to the 6 steps' lr; a wrong update moves whole tensors.
    # Seen: 1 element of 8,192 off by 2.9e-5 (train.seed=3 here, and a run trained on an H200).
    wa, wb = load_run(one).model.state_dict(), load_run(two).model.state_dict()
    assert wa.keys() == wb.keys()
    for key in wa:
        off = ~torch.isclose(wb[key], wa[key], rtol=1e-4, atol=1e-5)
        assert int(off.sum()) <= off.numel() // 1000, (key, int(off.sum()), off.numel())
        assert float((wb[key] - wa[key]).abs().max()) <= 6 * 1e-3, key
