"""kiln export --to hf: transformers loads the result with the same logits and tokens."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.cli import main  # noqa: E402
from kiln.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402

from hf_testlib import GPT2, LLAMA, SAMPLE, hf_logits, kiln_logits, tokens, train_tiny  # noqa: E402

CASES = {
    # GQA, tied embeddings, byte tokenizer, non-default rope_theta
    "llama-gqa-tied-byte": (LLAMA + ["model.n_kv_heads=2", "model.tie_embeddings=true", "data.tokenizer=byte",
                                     "model.rope_theta=500.0"], "LlamaForCausalLM"),
    # untied head, biases (attention_bias + mlp_bias), explicit ffn size, BPE tokenizer
    "llama-untied-bias-bpe": (LLAMA + ["model.tie_embeddings=false", "model.bias=true", "model.ffn_hidden=48",
                                       "data.tokenizer=bpe", "data.vocab_size=300"], "LlamaForCausalLM"),
    "gpt2-tied-byte": (GPT2 + ["model.tie_embeddings=true", "data.tokenizer=byte"], "GPT2LMHeadModel"),
    # GPT-2's own tanh GELU (HF gelu_new)
    "gpt2-tanh-gelu": (GPT2 + ["model.activation='gelu_tanh'", "data.tokenizer=byte"], "GPT2LMHeadModel"),
    "gpt2-untied-bpe": (GPT2 + ["model.tie_embeddings=false", "data.tokenizer=bpe", "data.vocab_size=300",
                                "model.dropout=0.1"], "GPT2LMHeadModel"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_the_export_with_equal_logits(case, text_file, tmp_path, capsys):
    overrides, hf_class = CASES[case]
    run = tmp_path / "run"
    train_tiny(run, text_file, overrides)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", str(out)]) == 0
    assert hf_class in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == hf_class
    assert next(model.parameters()).dtype == torch.float32

    kiln_tok = load_tokenizer(run / "tokenizer.json")
    ids = tokens(kiln_tok.vocab_size)
    torch.testing.assert_close(hf_logits(model, ids), kiln_logits(run, ids), atol=1e-4, rtol=1e-4)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == ("untied" not in case)

    config = json.loads((out / "config.json").read_text())
    if hf_class == "LlamaForCausalLM":  # also the pre-transformers-5 key, so older readers get theta right
        assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok(SAMPLE, add_special_tokens=False)["input_ids"] == kiln_tok.encode(SAMPLE)
    assert hf_tok.eos_token_id == kiln_tok.eos_id == model.config.eos_token_id
    assert hf_tok.decode(kiln_tok.encode(SAMPLE), skip_special_tokens=True) == SAMPLE


def test_byte_tokenizer_export_keeps_every_byte_id(tmp_path):
    from kiln.interop.hf_tokenizer import save_hf_tokenizer

    save_hf_tokenizer(ByteTokenizer(), tmp_path, 64)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    # byte 0's stand-in character (U+0100) in the text stays two ordinary bytes, as in kiln
    text = "Ā\x00\U0001f600 tab\t" + "".join(chr(c) for c in range(1, 600, 7))
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert hf_tok.eos_token_id == 0 and len(hf_tok) == 256


def test_a_non_special_eos_in_input_text_keeps_kiln_ids(tmp_path):
    from kiln.data.tokenizer import HFTokenizer
    from kiln.interop.hf_tokenizer import byte_level_tokenizer, save_hf_tokenizer

    kiln_tok = HFTokenizer(byte_level_tokenizer())  # no special tokens: kiln's EOS is the last id, "ÿ"
    save_hf_tokenizer(kiln_tok, tmp_path, 64)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "ÿ and ÿÿ"
    assert hf_tok.eos_token_id == kiln_tok.eos_id == 255
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == kiln_tok.encode(text)


REFUSED = [
    (LLAMA + ["model.norm_placement=post"], "model.norm_placement='post'"),
    (LLAMA + ["model.activation=geglu"], "model.activation='geglu'"),
    (LLAMA + ["model.norm=none"], "model.norm='none'"),
    (LLAMA + ["model.norm=layernorm"], "model.norm='layernorm'"),
    (GPT2 + ["model.activation=swiglu"], "model.activation='swiglu'"),
    (GPT2 + ["model.bias=false"], "model.bias=False"),
    (GPT2 + ["model.n_kv_heads=2"], "model.n_kv_heads=2"),
]


@pytest.mark.parametrize("overrides,named", REFUSED)
def test_options_without_an_hf_equivalent_are_refused_by_name(overrides, named, tmp_path, capsys):
    from kiln.config import load_config, to_toml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, overrides + ["model.dim=32", "model.n_heads=4"])))
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_export_never_overwrites_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(tmp_path / "missing"), "--to", "hf", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_of_a_run_without_checkpoints_says_so(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_export_without_transformers_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import now raises ImportError
    assert main(["export", str(tmp_path), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "pip install 'kiln-lm[hf]'" in capsys.readouterr().err
