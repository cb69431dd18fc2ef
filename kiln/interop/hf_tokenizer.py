"""kiln tokenizers <-> files `transformers.AutoTokenizer` loads.

A kiln BPE tokenizer already is an HF `tokenizers` file; it is wrapped in
`PreTrainedTokenizerFast` (transformers' class) so `save_pretrained` writes `tokenizer.json` and
`tokenizer_config.json` with the EOS token set. kiln's byte tokenizer (ids 0..255 = UTF-8 bytes)
has no HF file of its own: it is exported as a real byte-level `tokenizers` BPE with no merges,
whose vocabulary maps GPT-2's byte-to-unicode character of byte b to id b, so every text gets the
same ids as in kiln.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kiln.errors import KilnError


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table, from transformers (its home moved).
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers < 4.41
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    return bytes_to_unicode()


def byte_level_tokenizer():
    """A `tokenizers.Tokenizer` giving each UTF-8 byte b the id b, like kiln's ByteTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so the ids are exactly the bytes in order.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> int:
    """Write tokenizer.json + tokenizer_config.json for AutoTokenizer; returns the EOS id."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, ByteTokenizer):
        tok, eos_id = byte_level_tokenizer(), tokenizer.eos_id
    elif isinstance(tokenizer, HFTokenizer):
        tok, eos_id = tokenizer.tok, tokenizer.eos_id
    else:
        raise KilnError(f"cannot export a tokenizer of type {type(tokenizer).__name__}")
    eos = tok.id_to_token(eos_id)
    if eos is None:
        raise KilnError(f"tokenizer has no token for its EOS id {eos_id}")
    # When EOS is an ordinary vocabulary entry (the byte tokenizer's byte 0, or a tokenizer.json
    # without special tokens), declaring it would make transformers match its string in input
    # text; split_special_tokens keeps such text the same ids as in kiln.
    special = any(t.special and t.content == eos for t in tok.get_added_tokens_decoder().values())
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False, split_special_tokens=not special)
    fast.save_pretrained(str(out_dir))
    # transformers >= 5 names its class TokenizersBackend, which older versions cannot resolve;
    # PreTrainedTokenizerFast is the name both load.
    config_path = Path(out_dir) / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return eos_id
