"""kiln's optimizers under torch's found_inf protocol: GradScaler drives them without a host check,
a skipped step changes nothing, they only claim the device skip where it is exact, and train_step
uses it only off the CPU unless forced."""

import pytest
import torch
from torch import nn

import kiln.train.optimizers.muon as muon_module
from kiln.train.optimizers import Lamb, Lion, Muon
from kiln.train.optimizers.skip import skip_flag, unless_skipped, zero_if_skipped_
from kiln.train.step import force_device_skip, honours_found_inf, skips_on_device


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _make(cls, model):
    if cls is Muon:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        return Muon([{"params": matrices}, {"params": [p for p in model.parameters() if p.ndim < 2],
                                            "use_muon": False}], lr=0.02, weight_decay=0.1)
    return cls(model.parameters(), lr=0.01, weight_decay=0.1)


def test_zero_if_skipped_and_unless_skipped():
    values = [torch.tensor([1.5, float("nan"), float("-inf")]), torch.tensor([-2.0])]
    zero_if_skipped_(torch.tensor(True), values)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in values)
    finite = [torch.tensor([1.5, -0.25]), torch.tensor([3.0])]
    zero_if_skipped_(torch.tensor(False), finite)
    assert torch.equal(finite[0], torch.tensor([1.5, -0.25])) and torch.equal(finite[1], torch.tensor([3.0]))
    assert unless_skipped(None, 0.9, 1.0) == 0.9
    assert unless_skipped(torch.tensor(True), 0.9, 1.0).item() == 1.0
    assert unless_skipped(torch.tensor(False), 0.9, 1.0).item() == torch.tensor(0.9).item()


def test_skip_flag_reads_the_protocol_attributes():
    opt = Lion([nn.Parameter(torch.zeros(2))])
    assert skip_flag(opt) is None
    opt.found_inf = torch.tensor(2.0)  # GradScaler sums its per-device flags
    assert skip_flag(opt).item() is True
    opt.grad_scale = torch.tensor(1024.0)
    with pytest.raises(RuntimeError, match="unscale_"):
        skip_flag(opt)


@pytest.mark.parametrize("cls", [Lion, Lamb, Muon])
def test_grad_scaler_steps_them_without_a_host_check(cls):
    """GradScaler sees `_step_supports_amp_scaling` and hands over found_inf: a non-finite step is
    skipped (parameters and state unchanged) and a finite one matches the plain step."""
    model, ref = _model(), _model()
    opt, ref_opt = _make(cls, model), _make(cls, ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        loss = model(x).square().mean() * (float("nan") if step == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        before = [p.detach().clone() for p in model.parameters()]
        state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        scaler.step(opt)
        scaler.update()
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            after = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            assert all(torch.equal(a, b) for a, b in zip(state, after))
        else:
            ref(x).square().mean().backward()
            ref_opt.step()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_device_skip_is_claimed_only_where_it_is_exact(monkeypatch):
    assert honours_found_inf(Lion(_model().parameters())) and honours_found_inf(Lamb(_model().parameters()))
    assert honours_found_inf(_make(Muon, _model()))
    double = _model().double()  # float32 factors would round float64 state: the host check stays
    assert not honours_found_inf(Lion(double.parameters())) and not honours_found_inf(_make(Muon, double))
    assert not skips_on_device(force_device_skip(Lion(double.parameters())))  # forcing cannot make it exact
    # Muon's AdamW groups skip through torch's fused kernel: without one, no device-skip claim
    monkeypatch.setattr(muon_module, "fused_adam_supported", lambda params, device_type=None: False)
    assert not honours_found_inf(_make(Muon, _model()))


@pytest.mark.parametrize("cls", [Lion, Lamb, Muon])
def test_train_step_skips_on_the_device_only_off_the_cpu(cls):
    """On CPU the host check is free, so train_step uses it unless forced; on any other device the
    optimizer gets found_inf (a meta-device model stands in for a GPU one: only devices are read;
    Muon's AdamW part has no fused kernel on meta, so Muon makes no claim there)."""
    opt = _make(cls, _model())
    assert honours_found_inf(opt) and not skips_on_device(opt)
    assert skips_on_device(force_device_skip(opt))
    assert skips_on_device(_make(cls, _model().to("meta"))) is (cls is not Muon)
    fused = torch.optim.AdamW(_model().parameters(), fused=True)  # torch's own found_inf optimizer
    assert honours_found_inf(fused) and not skips_on_device(fused)
