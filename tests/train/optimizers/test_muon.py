import math

import pytest
import torch
from torch import nn

from kiln.train.optimizers import Muon, orthogonalize
from kiln.train.optimizers.muon import shape_lr_scale


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48), (128, 16)])
def test_orthogonalize_gives_singular_values_near_one(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3.0
    out = orthogonalize(g)
    assert out.shape == g.shape and out.dtype == g.dtype
    s = torch.linalg.svdvals(out)
    # The quintic trades exactness for speed: five steps land singular values in about [0.7, 1.2].
    assert s.min() > 0.6 and s.max() < 1.25, s
    # ... and its direction is that of U V^T from the SVD.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    assert (out * polar).sum() / (out.norm() * polar.norm()) > 0.95


def test_orthogonalize_of_zero_is_zero():
    assert torch.equal(orthogonalize(torch.zeros(4, 6)), torch.zeros(4, 6))


def test_shape_lr_scale():
    assert shape_lr_scale(torch.Size([1024, 384])) == pytest.approx(math.sqrt(1024 / 384))
    assert shape_lr_scale(torch.Size([384, 1024])) == 1.0
    assert shape_lr_scale(torch.Size([16, 4, 3, 3])) == 1.0  # conv: in = 4 * 3 * 3 = 36
    assert shape_lr_scale(torch.Size([64, 4, 3, 3])) == pytest.approx(math.sqrt(64 / 36))


def test_muon_step_is_nesterov_momentum_then_orthogonalized():
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(12, 6, generator=gen)
    grads = [torch.randn(12, 6, generator=gen) for _ in range(2)]
    w = nn.Parameter(w0.clone())
    lr, beta, wd = 0.05, 0.9, 0.1
    opt = Muon([w], lr=lr, momentum=beta, weight_decay=wd)
    expected, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        w.grad = g.clone()  # Muon spends the gradient in place (its Nesterov update)
        opt.step()
        buf = beta * buf + (1 - beta) * g
        nesterov = (1 - beta) * g + beta * buf
        expected = expected * (1 - lr * wd) - lr * math.sqrt(12 / 6) * orthogonalize(nesterov)
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], buf)


def test_muon_adamw_groups_match_torch_fused_adamw():
    # Muon's AdamW part is torch's fused AdamW kernel where torch has one (it takes found_inf itself)
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(7, generator=gen), torch.randn(5, 3, generator=gen)]
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    muon = Muon([{"params": ours, "use_muon": False}], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    adamw = torch.optim.AdamW(ref, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, fused=True)
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=gen) for t in init]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        muon.step()
        adamw.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)


def test_muon_rejects_vectors_in_a_muon_group():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.zeros(4))])


def test_muon_trains_a_small_mlp():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 16, generator=gen)
    y = torch.sin(x @ torch.randn(16, 4, generator=gen))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = Muon([{"params": matrices}, {"params": others, "use_muon": False, "lr": 3e-3}], lr=0.02)
    first = None
    for _ in range(150):
        loss = nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first, (first, loss.item())
