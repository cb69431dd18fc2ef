import pytest
import torch

from kiln.train.optimizers import Lamb

# Hand-computed LAMB (You et al. 2019, Algorithm 2), lr = 0.1, betas = (0.9, 0.999), eps = 1e-8,
# w0 = [3, 4] (norm 5), g1 = [0.3, -0.4], g2 = [0.1, 0.2].
# step 1: m_hat = g1, sqrt(v_hat) = |g1|, so r = [1, -1] + wd * w0 (eps shifts it by ~3e-8)
#   wd = 0:   ||r|| = sqrt(2), trust = 5 / sqrt(2) = 3.53553, w1 = w0 - 0.1 * 3.53553 * [1, -1]
#   wd = 0.1: r = [1.3, -0.6], ||r|| = sqrt(2.05), trust = 3.49215, w1 = [3 - 0.45398, 4 + 0.20953]
# step 2: m = [0.037, -0.016], v = [9.991e-5, 1.9984e-4], bias corrections 0.19 and 0.001999
#   m_hat = [0.194737, -0.084211], sqrt(v_hat) = [0.223562, 0.316180]
#   wd = 0:   r = [0.871064, -0.266337], trust = ||w1|| / ||r|| = 5.093980 / 0.910733 = 5.593335
#   wd = 0.1: r = m_hat / sqrt(v_hat) + 0.1 * w1 = [1.125666, 0.154616], trust = 4.329728
G1, G2 = [0.3, -0.4], [0.1, 0.2]


@pytest.mark.parametrize("wd,w1,w2", [
    (0.0, [2.646446611, 4.353553392], [2.159231417, 4.502524606]),
    (0.1, [2.546020306, 4.209529086], [2.058637518, 4.142584609]),
])
def test_lamb_matches_hand_computed_steps(wd, w1, w2):
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([w], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    w.grad = torch.tensor(G1, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor(w1, dtype=torch.float64), rtol=0, atol=1e-8)
    assert float(opt.state[w]["step"]) == 1.0
    w.grad = torch.tensor(G2, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor(w2, dtype=torch.float64), rtol=0, atol=1e-8)
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.tensor([0.037, -0.016], dtype=torch.float64))
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"], torch.tensor([9.991e-5, 1.9984e-4], dtype=torch.float64))


def test_lamb_trust_ratio_is_one_for_zero_weights():
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = Lamb([w], lr=0.1, betas=(0.9, 0.999), eps=0.0)
    w.grad = torch.tensor(G1, dtype=torch.float64)
    opt.step()  # r = [1, -1]; ||w|| = 0 so the ratio is 1, not 0
    torch.testing.assert_close(w.detach(), torch.tensor([-0.1, 0.1], dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt2 = Lamb([w2], lr=0.1)
    w2.grad = torch.zeros(2, dtype=torch.float64)
    opt2.step()  # r = 0: ratio 1, and the weights stay put rather than turning NaN
    torch.testing.assert_close(w2.detach(), torch.tensor([3.0, 4.0], dtype=torch.float64))


def test_lamb_trust_ratio_is_per_tensor():
    def run(pairs):  # [(weights, grad), ...] in one group
        params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w, _ in pairs]
        opt = Lamb(params, lr=0.1, weight_decay=0.1)
        for p, (_, g) in zip(params, pairs):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        return [p.detach() for p in params]

    a, b = ([3.0, 4.0], G1), ([10.0, -20.0, 1.0], [2.0, -1.0, 0.5])
    together = run([a, b])
    torch.testing.assert_close(together[0], run([a])[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(together[1], run([b])[0], rtol=0, atol=1e-12)
