"""Tokenizers: a byte-level BPE trained with HF `tokenizers`, any `tokenizer.json`, or raw bytes.

All three share one small interface (`encode`, `encode_batch`, `decode`, `vocab_size`, `eos_id`,
`save`). The byte tokenizer is saved as a tiny JSON of our own (`{"kiln_byte_tokenizer": 1}`);
everything else is a standard HF `tokenizer.json` that other tools load too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from kiln.errors import DataError

EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255. Byte 0 (NUL), absent from real text, doubles as end-of-document."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eos_id).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kiln_byte_tokenizer": 1}), encoding="utf-8")


class HFTokenizer:
    """Wraps a `tokenizers.Tokenizer`; EOS is `<|endoftext|>` when the vocabulary has it."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        eos = tok.token_to_id(EOS_TOKEN)
        if eos is None:  # a foreign tokenizer: use its first special token, else the last id
            specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
            eos = tok.token_to_id(specials[0]) if specials else self.vocab_size - 1
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # Rust-side batching uses every core; encode_batch_fast skips the offsets we never use.
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


Tokenizer = ByteTokenizer | HFTokenizer


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFTokenizer:
    """Train a GPT-2-style byte-level BPE (no unknown tokens: every byte is in the base alphabet)."""
    from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok)


def build_tokenizer(spec: str, vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """The one tokenizer builder of `kiln train` and `kiln prep`: `spec` is "bpe" (trained on
    `texts`, which is read only in that case), "byte", or the path of a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        return train_bpe(iter(texts), vocab_size)
    return load_tokenizer(spec)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} not found")
    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a valid tokenizer.json ({e})") from None
    if isinstance(head, dict) and head.get("kiln_byte_tokenizer"):
        return ByteTokenizer()
    from tokenizers import Tokenizer as _Tok

    try:
        return HFTokenizer(_Tok.from_file(str(path)))
    except Exception as e:  # tokenizers raises plain Exception subclasses for bad files
        raise DataError(f"{path}: not a valid HF tokenizer.json ({e})") from None


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits-per-byte.

    Byte-level BPE tokens are strings over GPT-2's byte-to-unicode alphabet, so each character
    maps back to exactly one byte; other tokenizers fall back to decoding ids one by one.
    """
    if isinstance(tokenizer, ByteTokenizer):
        lengths = np.ones(256, dtype=np.int64)
        lengths[tokenizer.eos_id] = 0
        return lengths
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = {t.content for t in tokenizer.tok.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for token, i in tokenizer.tok.get_vocab().items():
        if i >= tokenizer.vocab_size or token in special:
            continue
        if all(c in alphabet for c in token):
            lengths[i] = len(token)
        else:
            lengths[i] = len(tokenizer.tok.decode([i]).encode("utf-8"))
    return lengths
