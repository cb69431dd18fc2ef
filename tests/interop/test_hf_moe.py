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


def qwen2_moe(**extra):
    torch.manual_seed(0)
    fields = {**SIZES, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "shared_expert_intermediate_size": 32, **extra}
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**fields))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen2_moe_normalized_every_2nd", "qwen2_moe_without_qkv_bias"])
def test_qwen2_moe_imports_with_its_gated_shared_expert_and_round_trips(family, tmp_path):
    """Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, 16-wide experts and a 32-wide shared expert (2 x the
    expert width) scaled by its per-token sigmoid gate; random gate and bias weights count."""
    if family == "qwen2_moe":
        model, fields = qwen2_moe(), dict(moe_every=1, moe_norm_gates=False, qkv_bias=True, ffn_hidden=16, moe_hidden=0)
    elif family == "qwen2_moe_normalized_every_2nd":  # dense blocks 48 wide between
        model = qwen2_moe(decoder_sparse_step=2, norm_topk_prob=True)
        fields = dict(moe_every=2, moe_norm_gates=True, ffn_hidden=48, moe_hidden=16)
    else:
        model, fields = qwen2_moe(qkv_bias=False), dict(qkv_bias=False)
    with torch.no_grad():  # transformers initializes the biases to 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.2)
    imported = _imports_and_round_trips(model, tmp_path, "Qwen2MoeForCausalLM")
    cfg = imported.cfg
    assert (cfg.moe_shared_experts, cfg.moe_shared_gate, cfg.moe_experts, cfg.moe_capacity_factor) == (2, True, 4, 0.0)
    for key, value in fields.items():
        assert getattr(cfg, key) == value, key
    ids = tokens(300)  # the gate matters: without it (a gate of 1) the logits differ
    with torch.no_grad():
        gated = imported(ids)
        for block in imported.layers:
            if block.shared_experts is not None:
                block.shared_experts.gate.weight.fill_(100.0)  # sigmoid ~ 1 only where x . 1 > 0: changes
        assert (imported(ids) - gated).abs().max() > 1e-3


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
                                           (["model.qkv_bias=true", "model.moe_shared_experts=1",
                                             "model.moe_shared_gate=true", "model.moe_hidden=16"],
                                            "Qwen2MoeForCausalLM"),
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
    (["model.moe_shared_experts=1"], "model.moe_shared_gate=false"),
    (["model.moe_gate_scale=2.5"], "model.moe_gate_scale=2.5"),
    (["model.moe_groups=2"], "model.moe_groups=2"),
    (["model.moe_shared_experts=1", "model.moe_shared_gate=true", "model.qk_norm=true"], "model.qk_norm=true"),
    (["model.moe_shared_experts=1", "model.moe_shared_gate=true", "model.head_dim=32"], "model.head_dim=32"),
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
    ("qwen2_moe", {"shared_expert_intermediate_size": 40}, "shared_expert_intermediate_size=40"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=true"),
    # hostile values: typed and ranged like every other key, refused before any model is built
    ("mixtral", {"num_local_experts": 1 << 40}, "invalid kiln config"),
    ("mixtral", {"num_local_experts": "8"}, "num_local_experts='8'"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -32}, "shared_expert_intermediate_size=-32"),
    ("qwen3_moe", {"decoder_sparse_step": 9}, "decoder_sparse_step=9"),
])
def test_inexpressible_or_hostile_moe_imports_are_refused_by_key(family, changes, named, tmp_path, capsys):
    model = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe}[family]()
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


@pytest.mark.parametrize("damage", ["shape", "dtype"])
def test_misshapen_or_integer_experts_are_named_before_any_data_is_read(damage, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    qwen3_moe().save_pretrained(str(tmp_path / "hf"))
    train_bpe(iter([SAMPLE * 50]), 290).save(tmp_path / "hf" / "tokenizer.json")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous() if damage == "shape" else weights[name].to(torch.int32)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    _refused(tmp_path / "hf", tmp_path / "run", capsys, f"{name} has {damage}")
