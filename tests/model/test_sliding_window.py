"""Sliding-window attention (model.sliding_window, model.full_attention_every): against running
the model on the window alone, through the KV cache, with packed documents, in the FLOP count."""

import pytest
import torch

from kiln.config import ModelConfig, load_config
from kiln.errors import ConfigError
from kiln.model.transformer import Transformer, attention_window, document_mask, flops_per_token, window_mask


def build(**kw) -> Transformer:
    cfg = ModelConfig(**{"vocab_size": 97, "dim": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 32, **kw})
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2, "qk_norm": True}])
def test_a_token_sees_exactly_its_window(kw):
    """One layer with RoPE (relative positions): the output at position p equals the model run on
    the window's tokens alone (p - W + 1 .. p), which a window that leaks or cuts short breaks."""
    window = 5
    model, full = build(sliding_window=window, **kw), build(**kw)
    full.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        for p in range(20):
            alone = model(tokens[:, max(0, p - window + 1):p + 1])[:, -1]
            torch.testing.assert_close(logits[:, p], alone, atol=1e-5, rtol=0)
        # positions within the first window see their whole past: plain causal attention there
        torch.testing.assert_close(logits[:, :window], full(tokens)[:, :window], atol=1e-5, rtol=0)
        assert not torch.allclose(logits[:, window:], full(tokens)[:, window:], atol=1e-3)


@pytest.mark.parametrize("prefill", [6, 2])  # longer than the window, shorter
@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2, "full_attention_every": 2}])
def test_kv_cache_decoding_equals_the_full_forward_with_a_window(kw, prefill):
    """Decoding through the KV cache gives the full forward's logits, the windowed layers' caches
    rolling buffers of the window (4 of the 32 positions) that wrap around several times."""
    model = build(sliding_window=4, n_layers=3, **kw)
    tokens = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        steps = [model(tokens[:, :prefill], cache=cache, start_pos=0)[:, -1]]
        for i in range(prefill, 14):
            steps.append(model(tokens[:, i:i + 1], cache=cache, start_pos=i)[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, prefill - 1:], atol=1e-5, rtol=0)
    windows = [attention_window(model.cfg, i) for i in range(3)]
    assert [k.shape[2] for k in cache.k] == [w or 32 for w in windows] == ([4, 32, 4] if kw else [4, 4, 4])


def test_full_attention_every_keeps_every_kth_layer_global():
    cfg = ModelConfig(vocab_size=97, n_layers=6, sliding_window=8, full_attention_every=3)
    assert [attention_window(cfg, i) for i in range(6)] == [8, 8, 0, 8, 8, 0]
    assert [attention_window(ModelConfig(vocab_size=97, n_layers=2, sliding_window=8), i) for i in range(2)] == [8, 8]
    assert attention_window(ModelConfig(vocab_size=97), 0) == 0
    with pytest.raises(ConfigError, match="model.full_attention_every=2 needs model.sliding_window > 0"):
        load_config(None, ["model.full_attention_every=2"])


def test_packed_documents_get_the_window_inside_each_document():
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    got = document_mask(doc_ids, window=3)[0, 0]
    same_doc = doc_ids[0][:, None] == doc_ids[0][None, :]
    assert torch.equal(got, same_doc & window_mask(torch.arange(12), 12, 3))
    assert int(got.sum(-1).max()) == 3
    assert torch.equal(document_mask(doc_ids)[0, 0], same_doc & torch.ones(12, 12).tril().bool())
    # through the model: a windowed model with document ids = each document run alone
    model = build(sliding_window=3)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids)
        alone = torch.cat([model(tokens[:, :5]), model(tokens[:, 5:])], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_flops_count_the_window_not_the_sequence():
    seq = 32
    full, local = build(n_layers=2), build(n_layers=2, sliding_window=8, full_attention_every=2)
    attention = 12 * 32  # per layer and key: 12 x n_heads x head_dim
    assert flops_per_token(full, seq) - flops_per_token(local, seq) == attention * (seq - 8)  # layer 0 local
    assert flops_per_token(build(sliding_window=64), seq) == flops_per_token(build(), seq)  # wider than seq


@pytest.mark.parametrize("seq,window,kv", [(20, 5, 4), (23, 5, 2), (7, 5, 4), (5, 5, 4), (16, 1, 2), (33, 8, 1)])
def test_blocked_attention_equals_sdpa_with_the_dense_window_mask(seq, window, kv):
    """Blocks of `window` queries against their own and the previous block: the dense-mask result,
    forward and gradients, also with a padded last block, one block only, and window 1 (itself)."""
    from kiln.model.transformer import sliding_window_attention
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, seq, 8, generator=g)
    k, v = (torch.randn(2, kv, seq, 8, generator=g) for _ in range(2))
    grad = torch.randn(2, 4, seq, 8, generator=g)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    got = sliding_window_attention(*a, window, enable_gqa=kv != 4)
    want = F.scaled_dot_product_attention(*b, attn_mask=window_mask(torch.arange(seq), seq, window), enable_gqa=kv != 4)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=0)
