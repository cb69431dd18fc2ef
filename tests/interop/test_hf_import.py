"""kiln import-hf: a local transformers Llama/GPT-2 becomes a run that evaluates and trains on."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.cli import main  # noqa: E402
from kiln.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from kiln.interop.hf_tokenizer import byte_level_tokenizer  # noqa: E402

from hf_testlib import SAMPLE, hf_logits, kiln_logits, tokens  # noqa: E402


def tiny_llama(out, **extra):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=1000.0, tie_word_embeddings=False, initializer_range=0.2,
                                   rms_norm_eps=1e-5, **extra)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(out))
    train_bpe(iter([SAMPLE * 50]), 290).save(out / "tokenizer.json")  # fewer tokens than vocab_size
    return model


def tiny_gpt2(out, max_shard_size=None, activation="gelu", **extra):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  activation_function=activation, initializer_range=0.2, **extra)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    return model


def continue_training(run, text_file, steps):
    return main(["train", "--resume", str(run), "--set", f"data.source={str(text_file)!r}", "--set",
                 f"train.steps={steps}", "--set", "train.batch_size=2", "--set", "data.seq_len=16", "--set",
                 "train.dtype=fp32", "--set", "train.eval_every=0", "--set", "metrics.progress=none", "--set",
                 "metrics.peak_flops=1e12", "--set", "schedule.warmup_steps=1", "--set", "optim.lr=1e-3",
                 "--set", "data.max_bytes=20000", "--set", "data.prefetch=1"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["llama", "gpt2-sharded", "gpt2-tanh-gelu"])
def test_imported_model_matches_hf_evaluates_and_trains_on(family, text_file, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    if family == "llama":
        model = tiny_llama(hf_dir)
    elif family == "gpt2-sharded":
        model = tiny_gpt2(hf_dir, max_shard_size="40KB")
    else:  # the activation real GPT-2 checkpoints use (HF's gelu_new = kiln's gelu_tanh)
        model = tiny_gpt2(hf_dir, max_shard_size="40KB", activation="gelu_new")
    if family != "llama":
        assert (hf_dir / "model.safetensors.index.json").is_file()  # the sharded path is exercised
    run = tmp_path / "run"
    assert main(["import-hf", str(hf_dir), "--run-dir", str(run)]) == 0
    assert "imported" in capsys.readouterr().out
    vocab = model.config.vocab_size
    ids = tokens(vocab)
    torch.testing.assert_close(kiln_logits(run, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    imported_tok, hf_tok = load_tokenizer(run / "tokenizer.json"), load_tokenizer(hf_dir / "tokenizer.json")
    assert imported_tok.encode(SAMPLE) == hf_tok.encode(SAMPLE)

    held_out = tmp_path / "held_out.txt"
    held_out.write_text(SAMPLE * 20)
    report = tmp_path / "eval.json"
    assert main(["eval", str(run), "--data", str(held_out), "--out", str(report)]) == 0
    ppl = json.loads(report.read_text())["parts"]["perplexity"]
    assert ppl["tokens"] > 0 and ppl["loss"] > 0

    # Continue training from the imported weights: fresh optimizer/schedule, 2 steps, then a normal resume.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert continue_training(run, text_file, 2) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["resumed_from"] == 0 and [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    from kiln.eval.load import load_run

    trained = load_run(run)
    assert trained.step == 2
    emb = "model.embed_tokens.weight" if family == "llama" else "transformer.wte.weight"
    drift = (trained.model.tok_embeddings.weight - before[emb]).abs().max().item()
    assert 0 < drift < 0.05  # moved by two small steps from the imported weights, not re-initialized
    assert continue_training(run, text_file, 3) == 0  # step-2 is a full checkpoint: ordinary resume
    assert load_run(run).step == 3


def test_llama_with_biases_imports_and_round_trips(tmp_path):
    hf_dir = tmp_path / "hf"
    model = tiny_llama(hf_dir, attention_bias=True, mlp_bias=True)
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "a")]) == 0
    ids = tokens(300)
    torch.testing.assert_close(kiln_logits(tmp_path / "a", ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert main(["export", str(tmp_path / "a"), "--to", "hf", str(tmp_path / "hf2")]) == 0
    assert main(["import-hf", str(tmp_path / "hf2"), "--run-dir", str(tmp_path / "b")]) == 0
    torch.testing.assert_close(kiln_logits(tmp_path / "a", ids), kiln_logits(tmp_path / "b", ids), atol=0, rtol=0)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 8}


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 2.0}


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
                                  YARN_ROPE, {**YARN_ROPE, "attention_factor": 1.5}],
                         ids=["llama3", "linear", "yarn", "yarn_attention_factor"])
def test_scaled_rope_imports_with_transformers_logits_and_round_trips(rope, tmp_path):
    hf_dir = tmp_path / "hf"
    model = tiny_llama(hf_dir, rope_parameters=dict(rope))
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "a")]) == 0
    from kiln.config import load_config

    cfg = load_config(tmp_path / "a" / "config.toml").model
    assert cfg.rope_scaling == rope["rope_type"] and cfg.rope_scaling_factor == rope["factor"]
    ids = tokens(300, length=24)  # 3x the llama3 case's original context: every band is in use
    ours = kiln_logits(tmp_path / "a", ids)
    torch.testing.assert_close(ours, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    # The scaling matters here: the same weights with plain RoPE give other logits.
    config = json.loads((hf_dir / "config.json").read_text())
    _edit_config(hf_dir, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "plain")]) == 0
    assert (kiln_logits(tmp_path / "plain", ids) - ours).abs().max() > 1e-3
    (hf_dir / "config.json").write_text(json.dumps(config))

    assert main(["export", str(tmp_path / "a"), "--to", "hf", str(tmp_path / "hf2")]) == 0
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    # transformers < 5 reads rope_scaling and a top-level rope_theta; >= 5 rope_parameters
    assert exported["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert exported["rope_theta"] == 1000.0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"))
    torch.testing.assert_close(hf_logits(again, ids), ours, atol=1e-4, rtol=1e-4)


def test_legacy_rope_scaling_key_and_top_level_theta_import(tmp_path):
    """transformers < 5 config.json files (the hub's Llama 3.1/3.2) keep the scaling in rope_scaling."""
    hf_dir = tmp_path / "hf"
    tiny_llama(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, max_position_embeddings=64,
                  rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    (hf_dir / "config.json").write_text(json.dumps(config))
    from kiln.interop.hf import model_config_from_hf

    cfg = model_config_from_hf(config, "config.json")
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_scaling_factor) == ("llama3", 500000.0, 32.0)
    assert cfg.rope_original_max_seq_len == 64  # absent: transformers takes max_position_embeddings


def _imports_and_round_trips(model, tmp_path, exported_class):
    """Save `model` (with a tokenizer) to tmp_path/hf, import it, check kiln's logits against it,
    export the run and check transformers' reload (`exported_class`) too; returns the kiln model."""
    from kiln.eval.load import load_run

    model.save_pretrained(str(tmp_path / "hf"))
    train_bpe(iter([SAMPLE * 50]), 290).save(tmp_path / "hf" / "tokenizer.json")
    assert main(["import-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "a")]) == 0
    ids = tokens(300)
    torch.testing.assert_close(kiln_logits(tmp_path / "a", ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert main(["export", str(tmp_path / "a"), "--to", "hf", str(tmp_path / "hf2")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"))
    assert type(again).__name__ == exported_class
    torch.testing.assert_close(hf_logits(again, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    return load_run(tmp_path / "a").model


def test_mistral_without_a_window_imports_as_llama(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=None, tie_word_embeddings=False, initializer_range=0.2)
    _imports_and_round_trips(transformers.MistralForCausalLM(cfg), tmp_path, "LlamaForCausalLM")


WINDOWED = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
                sliding_window=4)
ALTERNATING = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("family", ["mistral", "ministral", "qwen2", "qwen3", "qwen3_alternating"])
def test_sliding_window_models_import_with_transformers_logits_and_round_trip(family, tmp_path):
    """A window of 4 on 20-token inputs (every position past the window): Mistral (every layer),
    Ministral and Qwen3 with windowed and global layers alternating (layer_types), Qwen2/Qwen3 with
    use_sliding_window on every layer (max_window_layers 0). Exported back to the same HF class."""
    torch.manual_seed(0)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**WINDOWED))
    elif family == "ministral":
        # head_dim given: MinistralConfig's default None fails in its own attention
        config = transformers.MinistralConfig(**WINDOWED, head_dim=8, layer_types=ALTERNATING)
        model = transformers.MinistralForCausalLM(config)
    else:
        config_class = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
        layers = {"layer_types": ALTERNATING} if family.endswith("alternating") else {"max_window_layers": 0}
        model = (transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.Qwen3ForCausalLM)(
            config_class(**WINDOWED, use_sliding_window=True, **layers))
    exported_class = type(model).__name__
    imported = _imports_and_round_trips(model, tmp_path, exported_class)
    every = 2 if "ministral" in family or "alternating" in family else 0
    assert (imported.cfg.sliding_window, imported.cfg.full_attention_every) == (4, every)
    # the window matters on these inputs: the same weights with full attention give other logits
    ids = tokens(300)
    windowed = kiln_logits(tmp_path / "a", ids)
    imported.cfg.sliding_window, imported.cfg.full_attention_every = 0, 0
    for layer in imported.layers:
        layer.attention.window = 0
    with torch.no_grad():
        assert (imported(ids) - windowed).abs().max() > 1e-3


def test_a_window_at_least_the_context_is_full_attention(tmp_path):
    from kiln.interop.hf import model_config_from_hf

    config = {**WINDOWED, "model_type": "mistral", "hidden_act": "silu", "sliding_window": 64}
    assert model_config_from_hf(config, "config.json").sliding_window == 0
    qwen = {**WINDOWED, "model_type": "qwen2", "hidden_act": "silu", "use_sliding_window": False}
    assert model_config_from_hf(qwen, "config.json").sliding_window == 0  # the window is off
    llama = {**WINDOWED, "model_type": "llama", "hidden_act": "silu"}
    assert model_config_from_hf(llama, "config.json").sliding_window == 0  # transformers' Llama ignores it


def test_bf16_weights_import_as_fp32(tmp_path):
    hf_dir = tmp_path / "hf"
    model = tiny_llama(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(str(hf_dir))
    (tmp_path / "fp32" / "tokenizer.json").rename(hf_dir / "tokenizer.json")
    assert json.loads((hf_dir / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "run")]) == 0
    from kiln.eval.load import load_run

    assert load_run(tmp_path / "run").model.tok_embeddings.weight.dtype == torch.float32
    # transformers' own fp32 load of the bf16 file (model.float() would keep bf16-rounded RoPE buffers)
    upcast = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ids = tokens(300)
    torch.testing.assert_close(kiln_logits(tmp_path / "run", ids), hf_logits(upcast, ids), atol=1e-4, rtol=1e-4)


def test_absent_keys_take_the_transformers_class_defaults(tmp_path, capsys):
    from kiln.interop.hf import model_config_from_hf

    llama = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    cfg = model_config_from_hf(llama, "config.json")
    assert not cfg.tie_embeddings and cfg.n_kv_heads == 4 and cfg.rope_theta == 10000.0 and cfg.norm_eps == 1e-6
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="config.json: vocab_size is missing; expected a positive int"):
        model_config_from_hf({k: v for k, v in llama.items() if k != "vocab_size"}, "config.json")
    # GPT-2 without activation_function means gelu_new (tanh): kiln's gelu_tanh.
    gpt2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    assert model_config_from_hf(gpt2, "config.json").activation == "gelu_tanh"
    assert model_config_from_hf({**gpt2, "activation_function": "gelu"}, "config.json").activation == "gelu"


def test_eos_disagreement_is_reported(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    _edit_config(hf_dir, eos_token_id=7)
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "run")]) == 0
    assert "note: config.json has eos_token_id=7 but kiln will" in capsys.readouterr().out


def _refused(hf_dir, run, capsys, named):
    capsys.readouterr()  # drop save_pretrained's progress bars
    assert main(["import-hf", str(hf_dir), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not run.exists()
    assert not [p for p in run.parent.iterdir() if p.name.startswith(f".{run.name}.tmp")]


def _edit_config(hf_dir, **changes):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,named", [
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_parameters and rope_scaling disagree"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1000.0, "factor": 2.0}},
     "rope_parameters.rope_type='longrope' (RoPE scaling) is not supported by kiln; expected one of"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 2.0}},
     "rope_parameters: low_freq_factor is missing"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": "2"}}, "rope_parameters: factor='2'"),
    ({"rope_parameters": {**LLAMA3_ROPE, "factor": 0.5}}, "model.rope_scaling_factor=0.5 must be >= 1"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"rope_parameters": {**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 0.5}}, "rope_parameters.mscale=1.0 with"),
    ({"rope_parameters": {**YARN_ROPE, "truncate": False}}, "rope_parameters.truncate=False is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported by kiln's RoPE"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mistral", "sliding_window": "16"}, "sliding_window='16'; expected a positive integer or null"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0; expected a positive integer or null"),
    ({"model_type": "ministral", "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types=['full_attention', 'sliding_attention'] makes layers [0] global among sliding-window ones"),
    ({"model_type": "ministral", "sliding_window": 4, "layer_types": 5}, "layer_types=5; expected a list of 2 layer"),
    ({"model_type": "ministral", "sliding_window": 4, "layer_types": ["chunked_attention"] * 2},
     "layer_types=['chunked_attention', 'chunked_attention']; expected a list of 2 layer kinds"),
    ({"hidden_size": "32"}, "hidden_size='32'"),
    ({"num_hidden_layers": None}, "num_hidden_layers=None; expected a positive int"),
    ({"head_dim": [8]}, "head_dim=[8]"),
    ({"head_dim": 0}, "head_dim=0; expected a positive int"),
    ({"head_dim": 2**62}, "head_dim=4611686018427387904, vocab_size=300 make tensors too large to describe"),
    ({"intermediate_size": 2**62}, "intermediate_size=4611686018427387904, head_dim=8"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads='2'"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5'"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_parameters: rope_theta='big'"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
     "q_proj.weight has shape [32, 32]; expected [30, 32]"),
    ({"num_key_value_heads": 3}, "invalid kiln config: model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    ({"vocab_size": 100}, "vocab_size=100"),  # fewer than the tokenizer's 290 tokens
])
def test_unsupported_llama_features_are_refused_by_key(changes, named, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_llama(hf_dir)
    _edit_config(hf_dir, **changes)
    _refused(hf_dir, tmp_path / "run", capsys, named)


def test_unknown_gpt2_activation_is_refused(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    _edit_config(hf_dir, activation_function="relu")
    _refused(hf_dir, tmp_path / "run", capsys, "activation_function='relu'")


def test_missing_files_are_named(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    (hf_dir / "tokenizer.json").unlink()
    _refused(hf_dir, tmp_path / "run", capsys, "tokenizer.json not found")
    byte_level_tokenizer().save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "config.json").unlink()
    _refused(hf_dir, tmp_path / "run", capsys, "config.json not found")
    _refused(tmp_path / "nothing", tmp_path / "run", capsys, "is not a directory")


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create a file: proof that pickle was run
        return (open, (self.path, "w"))


def test_pickle_weights_are_never_loaded(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    (hf_dir / "model.safetensors").unlink()
    sentinel = tmp_path / "pwned"
    (hf_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(sentinel))))
    _refused(hf_dir, tmp_path / "run", capsys, "never pytorch_model.bin")
    assert not sentinel.exists()


def test_index_cannot_name_files_outside_the_model_directory(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir, max_shard_size="40KB")
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    outside = tmp_path / "outside.safetensors"
    first = next(iter(index["weight_map"]))
    (outside).write_bytes((hf_dir / index["weight_map"][first]).read_bytes())
    for bad in ("../outside.safetensors", str(outside)):
        index["weight_map"][first] = bad
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        _refused(hf_dir, tmp_path / "run", capsys, f"weight_map[{first!r}]")


def test_symlinked_shards_like_the_hf_cache_are_read(tmp_path):
    hf_dir, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    model = tiny_gpt2(hf_dir, max_shard_size="40KB")
    blobs.mkdir()
    for shard in hf_dir.glob("*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    assert main(["import-hf", str(hf_dir), "--run-dir", str(tmp_path / "run")]) == 0
    ids = tokens(256)
    torch.testing.assert_close(kiln_logits(tmp_path / "run", ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("changes,named", [
    ({"num_hidden_layers": 10**9}, "1000000000 layers but only"),
    ({"max_position_embeddings": 10**9}, "max_position_embeddings=1000000000"),
])
def test_absurd_sizes_are_refused_before_allocating(changes, named, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_llama(hf_dir)
    _edit_config(hf_dir, **changes)
    _refused(hf_dir, tmp_path / "run", capsys, named)


def test_wrong_shapes_and_stray_tensors_are_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    good = dict(tensors)
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"].t().contiguous()
    save_file(tensors, str(hf_dir / "model.safetensors"))
    _refused(hf_dir, tmp_path / "run", capsys, "tensor transformer.h.1.mlp.c_fc.weight has shape [128, 32]")
    save_file({**good, "transformer.h.0.attn.q_norm.weight": torch.ones(8)}, str(hf_dir / "model.safetensors"))
    _refused(hf_dir, tmp_path / "run", capsys, "tensor transformer.h.0.attn.q_norm.weight has no place")
    save_file({**good, "transformer.ln_f.bias": torch.zeros(32, dtype=torch.int64)}, str(hf_dir / "model.safetensors"))
    _refused(hf_dir, tmp_path / "run", capsys, "tensor transformer.ln_f.bias has dtype I64")
    del good["transformer.ln_f.bias"]
    save_file(good, str(hf_dir / "model.safetensors"))
    _refused(hf_dir, tmp_path / "run", capsys, "tensor transformer.ln_f.bias is missing")
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _refused(hf_dir, tmp_path / "run", capsys, "not a readable safetensors file")


def test_existing_run_directory_is_left_alone(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_gpt2(hf_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["import-hf", str(hf_dir), "--run-dir", str(run)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in run.iterdir()] == ["notes.txt"]


def test_qwen2_imports_with_its_q_k_v_biases_and_round_trips(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=1000.0, tie_word_embeddings=True, initializer_range=0.2,
                                   use_sliding_window=False, sliding_window=64)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers initializes biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    imported = _imports_and_round_trips(model, tmp_path, "Qwen2ForCausalLM")
    attention = imported.layers[0].attention
    assert attention.wq.bias is not None and attention.wo.bias is None and imported.layers[0].feed_forward.w1.bias is None

    # windowed layers from max_window_layers on: the first global, the second windowed, is no kiln pattern
    _edit_config(hf_dir, use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None)
    _refused(hf_dir, tmp_path / "windowed", capsys, "max_window_layers=1 makes layers [0] global")


@pytest.mark.parametrize("head_dim", [8, 16], ids=["heads_of_dim_over_n_heads", "wider_heads"])
def test_qwen3_imports_with_its_qk_norm_and_round_trips(head_dim, tmp_path, capsys):
    """QK-norm, and (16) Qwen3-0.6B's heads wider than hidden_size / heads: 16 x 128 on 1024, here 4 x 16 on 32."""
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=64, rope_theta=1000.0, tie_word_embeddings=True,
                                   initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norm gains start at 1: make the QK-norm ones matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.2, 3.0)
    imported = _imports_and_round_trips(model, tmp_path, "Qwen3ForCausalLM")
    assert imported.cfg.qk_norm and imported.cfg.head_dim == (0 if head_dim == 8 else head_dim)
    assert imported.layers[0].attention.wq.weight.shape == (4 * head_dim, 32)

    for changes, named in (({"attention_bias": True}, "attention_bias=True is not supported"),
                           ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                             "layer_types": None},
                            "max_window_layers=1 makes layers [0] global among sliding-window ones"),
                           ({"head_dim": 7}, "model.head_dim=7 must be even for rope positions")):
        config = json.loads((hf_dir / "config.json").read_text())
        _edit_config(hf_dir, **changes)
        _refused(hf_dir, tmp_path / "refused", capsys, named)
        (hf_dir / "config.json").write_text(json.dumps(config))
