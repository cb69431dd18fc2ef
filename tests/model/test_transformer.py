import math

import pytest
import torch

from kiln.config import ModelConfig, load_config
from kiln.model.generate import filter_logits, generate
from kiln.model.transformer import Transformer, count_params, flops_per_token, lm_loss

# Published parameter counts of the shapes the presets reproduce.
PRESET_PARAMS = {
    "gpt2-124m": 124_439_808,  # GPT-2 small, HF "gpt2"
    "llama-1b": 1_235_814_400,  # Llama-3.2-1B
    "llama-7b": 6_738_415_616,  # Llama-2-7B
    "qwen3-0.6b": 596_049_920,  # Qwen3-0.6B: heads wider than dim / n_heads, QK-norm
}


def build(**kw) -> Transformer:
    cfg = ModelConfig(**{"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, **kw})
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("name", ["debug", "small", "gpt2-124m", "llama-1b", "llama-7b", "qwen3-0.6b"])
def test_presets_build_on_meta_with_right_counts(name):
    cfg = load_config(f"configs/{name}.toml")
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = 256 if cfg.data.tokenizer == "byte" else cfg.data.vocab_size
    with torch.device("meta"):
        model = Transformer(cfg.model)
    n = count_params(model)["total"]
    if name in PRESET_PARAMS:
        assert n == PRESET_PARAMS[name]
    if name == "small":
        assert 10e6 < n < 20e6
    assert flops_per_token(model, cfg.data.seq_len) > 6 * count_params(model)["non_embedding"]


def test_tied_weights_survive_materialization():
    model = build(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.isfinite(model.output.weight).all()
    untied = build(tie_embeddings=False)
    assert untied.output.weight is not untied.tok_embeddings.weight


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "geglu"])
def test_architecture_options_train_without_nan(norm, placement, activation):
    _train_few_steps(build(norm=norm, norm_placement=placement, activation=activation))


@pytest.mark.parametrize("init", ["normal", "gpt2", "ds_init", "t_fixup"])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_init_schemes_train_without_nan(init, positions):
    norm = "none" if init == "t_fixup" else "rmsnorm"
    _train_few_steps(build(init=init, positions=positions, norm=norm, dropout=0.1, bias=True))


def _train_few_steps(model, steps=5):
    torch.manual_seed(0)
    data = torch.randint(0, 97, (8, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(data[:, :-1]), data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns the fixed batch


def test_initial_loss_near_uniform():
    model = build(init="gpt2")
    x, y = torch.randint(0, 97, (2, 4, 16), generator=torch.Generator().manual_seed(1))
    assert abs(lm_loss(model(x), y).item() - math.log(97)) < 0.3


def test_gqa_shapes():
    model = build(n_heads=4, n_kv_heads=2)
    assert model.layers[0].attention.wk.weight.shape == (16, 32)
    assert model(torch.randint(0, 97, (2, 10))).shape == (2, 10, 97)


def test_init_scales():
    m = build(init="gpt2", n_layers=8, dim=64)
    assert m.layers[0].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.15)
    assert m.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.15)
    d = build(init="ds_init", n_layers=4, dim=64)
    ratio = d.layers[3].attention.wq.weight.std() / d.layers[0].attention.wq.weight.std()
    assert ratio.item() == pytest.approx(0.5, rel=0.15)  # 1/sqrt(4)


@pytest.mark.parametrize("kw", [{}, {"positions": "learned", "n_kv_heads": 2},
                                {"qk_norm": True, "qkv_bias": True, "head_dim": 12, "n_kv_heads": 2}])
def test_kv_cache_matches_full_forward(kw):
    model = build(**kw).eval()
    tokens = torch.randint(0, 97, (1, 12))
    full = model(tokens)
    cache = model.new_cache(1)
    step_logits = [model(tokens[:, :5], cache=cache, start_pos=0)[:, -1]]
    for i in range(5, 12):
        step_logits.append(model(tokens[:, i:i + 1], cache=cache, start_pos=i)[:, -1])
    expected = full[0, 4:]
    assert torch.allclose(torch.cat(step_logits), expected, atol=1e-5)


def test_greedy_generation_is_argmax_continuation():
    model = build().eval()
    prompt = [1, 2, 3]
    out = generate(model, prompt, max_new_tokens=6, temperature=0)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[3:]


def test_generation_stops_at_eos_and_respects_max_len():
    model = build(max_seq_len=16).eval()
    out = generate(model, [1] * 10, max_new_tokens=100, temperature=1.0,
                   generator=torch.Generator().manual_seed(0))
    assert len(out) <= 6
    first = generate(model, [1, 2], max_new_tokens=1, temperature=0)[0]
    assert generate(model, [1, 2], max_new_tokens=5, temperature=0, eos_id=first) == []


def test_filter_logits_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    probs = logits.softmax(-1)[0]  # ~[0.64, 0.24, 0.09, 0.03]
    kept = ~torch.isinf(filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert probs[0] < 0.7
    assert (~torch.isinf(filter_logits(logits, top_p=0.5))).sum() == 1


def test_rope_scaling_changes_only_the_frequencies_it_names():
    from kiln.model.transformer import rope_frequencies

    base = dict(dim=128, n_heads=2, rope_theta=500000.0)
    plain = rope_frequencies(ModelConfig(**base))
    assert torch.equal(plain, 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(rope_frequencies(ModelConfig(**base, rope_scaling="linear", rope_scaling_factor=4.0)), plain / 4)

    cfg = ModelConfig(**base, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=512)
    scaled, wavelen = rope_frequencies(cfg), 2 * math.pi / plain
    short, long = wavelen < 512 / 4, wavelen > 512 / 1  # high_freq_factor 4, low_freq_factor 1
    between = ~short & ~long
    assert short.any() and long.any() and between.any()  # the three bands all occur at this length
    assert torch.equal(scaled[short], plain[short])  # local detail kept
    assert torch.allclose(scaled[long], plain[long] / 8)  # long range interpolated
    assert (scaled[between] < plain[between]).all() and (scaled[between] > plain[between] / 8).all()
    assert (scaled[1:] < scaled[:-1]).all()  # still a decreasing spectrum: no two bands collide

    model = build(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=4)
    angles = torch.outer(torch.arange(32).float(), rope_frequencies(model.cfg))
    assert torch.allclose(model.rope_cos, angles.cos()) and torch.allclose(model.rope_sin, angles.sin())

    # YaRN: dimensions turning more than beta_fast times over the original context kept, fewer
    # than beta_slow interpolated, a ramp between; cos and sin scaled by 0.1 ln(factor) + 1
    cfg = ModelConfig(**base, rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_seq_len=512)
    scaled, turns = rope_frequencies(cfg), plain * 512 / (2 * math.pi)
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert torch.equal(scaled[fast], plain[fast]) and torch.allclose(scaled[slow], plain[slow] / 8)
    model = build(rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_seq_len=4)
    angles = torch.outer(torch.arange(32).float(), rope_frequencies(model.cfg))
    assert torch.allclose(model.rope_cos, angles.cos() * (0.1 * math.log(8) + 1))
    assert torch.allclose(build(rope_scaling="yarn", rope_attention_factor=1.5).rope_sin / 1.5,
                          build(rope_scaling="yarn", rope_attention_factor=1.0).rope_sin)


def test_qk_norm_normalizes_each_head_of_q_and_k_before_rope():
    model = build(qk_norm=True, n_kv_heads=2)
    attention = model.layers[0].attention
    assert attention.q_norm.weight.shape == (8,) and attention.k_norm.weight.shape == (8,)
    assert {n for n, _ in model.named_parameters()} - {n for n, _ in build().named_parameters()} == {
        f"layers.{i}.attention.{w}_norm.weight" for i in range(2) for w in "qk"}
    seen = {}
    attention.use_rope = False  # look at q and k as the attention receives them
    from torch.nn import functional as F

    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.setdefault("q", q), seen.setdefault("k", k)  # the first block's
        return sdpa(q, k, v, **kw)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        for proj in (attention.wq, attention.wk):  # large: without the norm their RMS would be far from 1
            proj.weight.mul_(30)
        model(torch.randint(0, 97, (2, 12)))
    for name in "qk":
        rms = seen[name].square().mean(-1).sqrt()
        assert seen[name].shape[1] == (4 if name == "q" else 2)
        torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)
