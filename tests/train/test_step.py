"""The sync-free step: the same numbers as the host-checked step it replaced, bit for bit on CPU,
and a non-finite step leaves parameters and optimizer state untouched on either path."""

import contextlib
import math

import pytest
import torch

from kiln.config import ModelConfig, OptimConfig
from kiln.model.loss import lm_loss
from kiln.model.transformer import Transformer
from kiln.train.optim import build_optimizer
from kiln.train.schedule import LRSchedule
from kiln.train.step import PendingSteps, skips_on_device, train_step
from kiln.config import ScheduleConfig

NO_AUTOCAST = contextlib.nullcontext()


def _setup(optim: str, impl: str = "auto"):
    model = Transformer(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OptimConfig(name=optim, implementation=impl, lr=1e-2))
    LRSchedule(opt, ScheduleConfig(warmup_steps=0), 10)
    return model, opt


def _batches(n: int):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        t = torch.randint(0, 50, (2, 17), generator=gen)
        out.append([(t[:, :-1], t[:, 1:])])
    return out


def _old_step(model, optimizer, micro_batches, clip):
    """The step as kiln ran it before: loss from logits, then a host check before stepping."""
    total = torch.zeros(())
    for x, y in micro_batches:
        loss = lm_loss(model(x), y) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf, foreach=True)
    finite = bool(torch.isfinite(total) and torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, finite


@pytest.mark.parametrize("optim, impl, on_device", [("adamw", "fused", True), ("adamw", "foreach", False),
                                                    ("lion", "auto", False)])
def test_sync_free_step_is_bitwise_the_old_step(optim, impl, on_device):
    new_model, new_opt = _setup(optim, impl)
    old_model, old_opt = _setup(optim, impl)
    assert skips_on_device(new_opt) is on_device
    for batch in _batches(5):
        loss, gnorm, skipped = train_step(new_model, new_opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
        ref_loss, ref_gnorm, finite = _old_step(old_model, old_opt, batch, 1.0)
        assert torch.equal(loss, ref_loss) and torch.equal(gnorm, ref_gnorm) and bool(skipped) is not finite
    for a, b in zip(new_model.parameters(), old_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optim, impl", [("adamw", "fused"), ("adamw", "foreach"), ("lamb", "auto")])
def test_non_finite_step_changes_nothing(optim, impl):
    model, opt = _setup(optim, impl)
    (batch,) = _batches(1)
    train_step(model, opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    model.loss_impl = "full"
    with torch.no_grad():
        model.layers[0].attention.wq.weight[0, 0] = float("inf")  # -> non-finite loss and gradients
    params[[n for n, _ in model.named_parameters()].index("layers.0.attention.wq.weight")][0, 0] = float("inf")
    loss, gnorm, skipped = train_step(model, opt, batch, autocast=NO_AUTOCAST, scaler=None, clip=1.0)
    assert bool(skipped)
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b.detach())
    after = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(state[k], after[k]) for k in state)


def test_pending_steps_fetch_in_order_once():
    pending = PendingSteps()
    for i in range(3):
        pending.add(i + 1, torch.tensor(float(i)), torch.tensor(0.5), torch.tensor(i == 1), lr=0.1 * i,
                    data_wait_s=0.0, tokens=10 * (i + 1))
    got = pending.fetch()
    assert [(r.step, r.loss, r.skipped, r.tokens) for r in got] == [(1, 0.0, False, 10), (2, 1.0, True, 20),
                                                                      (3, 2.0, False, 30)]
    assert pending.fetch() == [] and len(pending) == 0
