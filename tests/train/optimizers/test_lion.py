import pytest
import torch

from kiln.train.optimizers import Lion

# Hand-computed, lr = 0.1, betas = (0.9, 0.99), w0 = [1, -2, 0.5]:
# step 1, g1 = [5, -0.1, 0]:  c = 0.1 * g1 -> sign [1, -1, 0];  m1 = 0.01 * g1 = [0.05, -0.001, 0]
# step 2, g2 = [-0.3, 0.3, 0.4]:  c = 0.9 * m1 + 0.1 * g2 = [0.015, 0.0291, 0.04] -> sign [1, 1, 1]
#   (the first coordinate follows the momentum, not g2);  m2 = 0.99 * m1 + 0.01 * g2
G1, G2 = [5.0, -0.1, 0.0], [-0.3, 0.3, 0.4]
M1, M2 = [0.05, -0.001, 0.0], [0.0465, 0.00201, 0.004]


@pytest.mark.parametrize("wd,w1,w2", [
    # w = w - 0.1 * sign
    (0.0, [0.9, -1.9, 0.5], [0.8, -2.0, 0.4]),
    # w = w * (1 - 0.1 * 0.5) - 0.1 * sign:  0.85 * 0.95 - 0.1 = 0.7075, -1.8 * 0.95 - 0.1 = -1.81
    (0.5, [0.85, -1.8, 0.475], [0.7075, -1.81, 0.35125]),
])
def test_lion_matches_hand_computed_steps(wd, w1, w2):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = Lion([w], lr=0.1, betas=(0.9, 0.99), weight_decay=wd)
    w.grad = torch.tensor(G1, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor(w1, dtype=torch.float64))
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.tensor(M1, dtype=torch.float64))
    w.grad = torch.tensor(G2, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor(w2, dtype=torch.float64))
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.tensor(M2, dtype=torch.float64))


def test_lion_skips_params_without_grad_and_rejects_bad_betas():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = Lion([a, b], lr=0.1)
    a.grad = torch.ones(2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in opt.state
    with pytest.raises(ValueError, match="betas"):
        Lion([a], betas=(0.9, 1.0))


def test_lion_steps_without_foreach_ops_that_dtensor_lacks_in_torch_2_11(monkeypatch):
    # torch 2.11 has no DTensor sharding rule for _foreach_lerp (out of place) or _foreach_sign(_)
    # (seen on an H200 machine with torch 2.11.0+cu130), so Lion on FSDP-sharded parameters failed
    # there; the step must not depend on them.
    def refuse(*args, **kwargs):
        raise AssertionError("Lion called a foreach op without a DTensor rule in torch 2.11")

    for name in ("_foreach_lerp", "_foreach_sign", "_foreach_sign_"):
        monkeypatch.setattr(torch, name, refuse)
    test_lion_matches_hand_computed_steps(0.5, [0.85, -1.8, 0.475], [0.7075, -1.81, 0.35125])
