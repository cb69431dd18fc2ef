"""The chunked LM head + cross-entropy equals the plain one (value and gradients), padding
(IGNORE_INDEX) targets included. The vocab-parallel variant on 2 ranks is tested in
tests/parallel/test_tensor_parallel.py (one shared launch)."""

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.loss import IGNORE_INDEX, chunked_lm_loss, lm_loss
from kiln.model.transformer import Transformer


@pytest.mark.parametrize("chunk", [1, 7, 128, 4096])
def test_chunked_loss_and_grads_equal_plain_in_fp32(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 50, 32, generator=gen, requires_grad=True)
    w = torch.randn(97, 32, generator=gen, requires_grad=True)
    t = torch.randint(0, 97, (3, 50), generator=gen)
    ref = lm_loss(h @ w.t(), t)
    gh, gw = torch.autograd.grad(ref * 3.0, (h, w))
    got = chunked_lm_loss(h, w, t, chunk=chunk)
    ch, cw = torch.autograd.grad(got * 3.0, (h, w))  # a scaled upstream gradient reaches both
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [7, 4096])
def test_ignored_targets_count_in_neither_the_loss_nor_the_mean(chunk):
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 20, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (2, 20), generator=gen)
    t[0, 3:11] = IGNORE_INDEX
    ref = lm_loss(h @ w.t(), t)
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = chunked_lm_loss(h, w, t, chunk=chunk)
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)
    assert not ch[0, 3:11].any()
    everything_ignored = chunked_lm_loss(h, w, torch.full_like(t, IGNORE_INDEX), chunk=chunk)
    assert everything_ignored.isnan() and lm_loss(h @ w.t(), torch.full_like(t, IGNORE_INDEX)).isnan()


def test_chunked_loss_under_bf16_autocast_is_close_to_plain():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 64, 64, generator=gen)
    w = torch.randn(300, 64, generator=gen) * 0.1
    t = torch.randint(0, 300, (2, 64), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lm_loss(torch.nn.functional.linear(h, w), t)
        got = chunked_lm_loss(h, w, t, chunk=40)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-2


def test_model_loss_paths_agree_and_train_the_same_weights():
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = {}
    for impl in ("full", "chunked"):
        model = Transformer(cfg)
        model.init_weights(torch.Generator().manual_seed(0))
        model.loss_impl = impl
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads[impl] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["chunked"][0], grads["full"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads["chunked"][1], grads["full"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(model(x).argmax(-1), model(x).argmax(-1))  # logits path unchanged


def test_chunked_loss_refuses_a_target_outside_the_vocabulary():
    """lm_loss's gather raises on such a target; the chunked loss's masked gather would count its
    logit as 0 and return a wrong loss silently, so it asserts (on the device) instead."""
    hidden, weight = torch.randn(6, 8), torch.randn(5, 8)
    for bad in (5, -1, 99):
        targets = torch.tensor([0, 1, 2, 3, 4, bad])
        with pytest.raises(RuntimeError, match=r"outside \[0, 5\)"):
            chunked_lm_loss(hidden, weight, targets, chunk=4)
    chunked_lm_loss(hidden, weight, torch.tensor([0, 1, 2, 3, 4, IGNORE_INDEX]), chunk=4)  # fine
