"""Mixture-of-experts interop: HF Mixtral and Qwen3-MoE import with transformers' own logits,
export back to the same class, and kiln MoE runs export to them; what neither family expresses is
refused by key. Tolerance: fp32, 1e-4 (kiln's grouped experts against transformers' per-expert loop;
observed ~1e-6)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.cli import main  # noqa: E402
from kiln.data.tokenizer import train_bpe  # noqa: E402

from hf_testlib import LLAMA, SAMPLE, hf_logits, kiln_logits, tokens, train_tiny  # noqa: E402
from test_hf_import import _edit_config, _imports_and_round_trips, _refused  # noqa: E402

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2)


def mixtral(**extra):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2, **extra)
    return transformers.MixtralForCausalLM(config)


def qwen3_moe(**extra):
    torch.manual_seed(0)
    fields = {**SIZES, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
              "norm_topk_prob": True, **extra}
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields))


@pytest.mark.parametrize("family", ["mixtral", "mixtral_window", "qwen3_moe", "qwen3_moe_unnormalized",
                                    "qwen3_moe_every_2nd", "qwen3_moe_fine_grained", "qwen3_moe_top1"])
def test_moe_models_import_with_transformers_logits_and_round_trip(family, tmp_path):
    if family == "mixtral":
        model, fields = mixtral(), dict(moe_every=1, moe_norm_gates=True, sliding_window=0)
    elif family == "mixtral_window":  # a window of 4 on 20-token inputs: every layer windowed
        model, fields = mixtral(sliding_window=4), dict(sliding_window=4, full_attention_every=0)
    elif family == "qwen3_moe":
        model, fields = qwen3_moe(), dict(moe_every=1, moe_norm_gates=True, qk_norm=True)
    elif family == "qwen3_moe_unnormalized":
        model, fields = qwen3_moe(norm_topk_prob=False), dict(moe_norm_gates=False)
    elif family == "qwen3_moe_every_2nd":  # dense MLPs in blocks 0 and 2
        model, fields = qwen3_moe(decoder_sparse_step=2), dict(moe_every=2)
    elif family == "qwen3_moe_fine_grained":  # 24-wide experts beside 48-wide dense MLPs (model.moe_hidden)
        model = qwen3_moe(decoder_sparse_step=2, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3)
        fields = dict(moe_every=2, moe_hidden=24, ffn_hidden=48, moe_experts=8, moe_top_k=3)
    else:
        model, fields = qwen3_moe(num_experts_per_tok=1, norm_topk_prob=False), dict(moe_top_k=1)
    imported = _imports_and_round_trips(model, tmp_path, type(model).__name__)
    cfg = imported.cfg
    assert (cfg.moe_capacity_factor, cfg.moe_router) == (0.0, "softmax")
    assert cfg.moe_experts == fields.get("moe_experts", 4)
    for key, value in fields.items():
        assert getattr(cfg, key) == value, key
    if family == "qwen3_moe_every_2nd":
        assert [type(b.feed_forward).__name__ for b in imported.layers] == ["FeedForward", "MoE"] * 2


def test_imported_moe_trains_on(text_file, tmp_path):
    from test_hf_import import continue_training

    model = mixtral()
    model.save_pretrained(str(tmp_path / "hf"))
    train_bpe(iter([SAMPLE * 50]), 290).save(tmp_path / "hf" / "tokenizer.json")
    assert main(["import-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")]) == 0
    assert continue_training(tmp_path / "run", text_file, 2) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(r["moe_max_load"] >= 1.0 for r in train)


@pytest.mark.parametrize("extra, family", [([], "MixtralForCausalLM"), (["model.qk_norm=true"], "Qwen3MoeForCausalLM"),
                                           (["model.qk_norm=true", "model.moe_norm_gates=false", "model.moe_every=2"],
                                            "Qwen3MoeForCausalLM"),
                                           (["model.moe_hidden=24"], "MixtralForCausalLM"),
                                           (["model.qk_norm=true", "model.moe_every=2", "model.moe_hidden=24"],
                                            "Qwen3MoeForCausalLM")])
def test_kiln_moe_runs_export_with_their_logits(extra, family, text_file, tmp_path):
    moe = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0", "model.tie_embeddings=false"]
    train_tiny(tmp_path / "run", text_file, LLAMA + moe + extra)
    assert main(["export", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(model).__name__ == family
    ids = tokens(model.config.vocab_size)
    torch.testing.assert_close(hf_logits(model, ids), kiln_logits(tmp_path / "run", ids), atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if family.startswith("Qwen3"):  # both names of the expert count: transformers 4 and 5 read one each
        assert config["num_experts"] == config["num_local_experts"] == 4


@pytest.mark.parametrize("extra, named", [
    (["model.moe_router=sigmoid"], "model.moe_router='sigmoid'"),
    (["model.moe_bias_update_rate=0.001"], "model.moe_bias_update_rate=0.001"),
    (["model.moe_norm_gates=false"], "model.moe_norm_gates=false"),
    (["model.moe_top_k=1"], "model.moe_top_k=1"),
    (["model.moe_every=2"], "model.moe_every=2"),
    (["model.sliding_window=8", "model.full_attention_every=2"], "model.full_attention_every=2"),
    (["model.positions=learned", "model.norm=layernorm", "model.activation=gelu"], "model.moe_experts=4"),
])
def test_inexpressible_moe_exports_are_refused_by_key(extra, named, tmp_path, capsys):
    from kiln.config import load_config
    from kiln.errors import KilnError
    from kiln.interop.hf import export_family

    cfg = load_config(None, ["model.moe_experts=4", "model.moe_top_k=2"] + extra).model
    with pytest.raises(KilnError, match=named.replace(".", r"\.").replace("(", r"\(")) as err:
        export_family(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family, changes, named", [
    ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("mixtral", {"num_experts_per_tok": 8}, "num_experts_per_tok=8"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=true"),
])
def test_inexpressible_moe_imports_are_refused_by_key(family, changes, named, tmp_path, capsys):
    model = mixtral() if family == "mixtral" else qwen3_moe()
    model.save_pretrained(str(tmp_path / "hf"))
    train_bpe(iter([SAMPLE * 50]), 290).save(tmp_path / "hf" / "tokenizer.json")
    _edit_config(tmp_path / "hf", **changes)
    _refused(tmp_path / "hf", tmp_path / "run", capsys, named)


def test_missing_expert_is_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    mixtral().save_pretrained(str(tmp_path / "hf"))
    train_bpe(iter([SAMPLE * 50]), 290).save(tmp_path / "hf" / "tokenizer.json")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    _refused(tmp_path / "hf", tmp_path / "run", capsys, "model.layers.1.block_sparse_moe.experts.3.w2.weight")
