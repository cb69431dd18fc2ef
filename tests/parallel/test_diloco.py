"""DiLoCo on 2 gloo ranks gives the per-step losses of its own definition simulated in one process
(two replicas, each with its own AdamW and its own half of the batch, an outer Nesterov step on the
averaged delta every H steps) - DiLoCo, not plain data parallelism, which the last check tells apart.

Tolerance: fp32, relative 1e-5 per step over 9 steps (3 outer steps); observed ~1e-7.
"""

import pytest
import torch

from ranks import run_ranks

H, STEPS, OUTER_LR, MOMENTUM, REL = 3, 9, 0.7, 0.9, 1e-5


def model_and_data():
    from kiln.config import ModelConfig
    from kiln.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=41, dim=16, n_layers=1, n_heads=2, max_seq_len=16))
    model.init_weights(torch.Generator().manual_seed(0))
    data = torch.randint(0, 41, (STEPS, 4, 13), generator=torch.Generator().manual_seed(1))
    return model, data


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def simulated(outer_lr=OUTER_LR, momentum=MOMENTUM):
    """Algorithm 1 of Douillard et al. 2023 with 2 replicas in one process, written out by hand."""
    import copy

    base, data = model_and_data()
    replicas = [copy.deepcopy(base), copy.deepcopy(base)]
    inner = [adamw(m) for m in replicas]
    anchor = [p.detach().clone() for p in base.parameters()]
    velocity = [torch.zeros_like(p) for p in anchor]
    losses = []
    for step, batch in enumerate(data, start=1):
        step_losses = []
        for r, (model, opt) in enumerate(zip(replicas, inner)):
            part = batch[2 * r:2 * r + 2]
            loss = model(part[:, :-1], part[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / 2)
        if step % H == 0:
            with torch.no_grad():
                for i, params in enumerate(zip(*(m.parameters() for m in replicas))):
                    delta = anchor[i] - sum(params) / 2
                    velocity[i] = momentum * velocity[i] + delta  # Nesterov momentum
                    anchor[i] -= outer_lr * (delta + momentum * velocity[i])
                    for p in params:
                        p.copy_(anchor[i])
    return losses


def diloco_rank(rank, world):
    import torch.distributed as dist

    from kiln.parallel.diloco import DiLoCo

    model, data = model_and_data()
    opt = adamw(model)
    diloco = DiLoCo(model, H, OUTER_LR, MOMENTUM)
    losses, sent = [], []
    for step, batch in enumerate(data, start=1):
        part = batch[2 * rank:2 * rank + 2]
        loss = model(part[:, :-1], part[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if diloco.due(step):
            sent.append(diloco.outer_step())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    n_params = sum(p.numel() for p in model.parameters())
    return losses, sent, n_params, diloco.state_dict()


@pytest.mark.timeout(240)
def test_two_ranks_match_the_single_process_definition(tmp_path):
    ranks = run_ranks(diloco_rank, 2, tmp_path)
    (losses, sent, n_params, state), other = ranks[0], ranks[1]
    assert losses == other[0]
    assert losses == pytest.approx(simulated(), rel=REL)
    assert sent == [4 * n_params] * (STEPS // H)  # one fp32 all-reduce of the parameters per outer step
    assert int(state["outer_steps"]) == STEPS // H
    # Not the same run as other outer settings (outer lr 1, no momentum = plain parameter averaging).
    assert losses != pytest.approx(simulated(outer_lr=1.0, momentum=0.0), rel=REL)


def test_kiln_train_logs_moe_losses_and_outer_steps(tmp_path, text_file):
    # One process: the trainer wiring (outer step every H steps with its row, MoE losses in every
    # train row, active parameters in the run row); the 2-rank numerics are checked above.
    import json

    from conftest import tiny_overrides
    from kiln.cli import main

    run = tmp_path / "run"
    sets = [x for o in tiny_overrides(text_file, **{
        "train.steps": 4, "train.eval_every": 0, "checkpoint.every": 2, "parallel.diloco_inner_steps": 2,
        "model.moe_experts": 4, "model.moe_top_k": 2, "train.device": "cpu"}) for x in ("--set", o)]
    assert main(["train", "--run-dir", str(run), *sets]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    run_row = next(r for r in rows if r["kind"] == "run")
    assert run_row["dp_mode"] == "diloco" and run_row["n_params_active"] < run_row["n_params"]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in train)
    assert [(r["step"], r["outer_step"], r["bytes_sent"]) for r in rows if r["kind"] == "diloco"] == \
        [(2, 1, 0), (4, 2, 0)]  # one process: nothing to send
