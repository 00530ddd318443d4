"""Tokenizers: text <-> token ids, with the special tokens every qkv model shares.

Two kinds, one interface:

* :class:`CharTokenizer`: one token per character. No training beyond collecting the alphabet; good for small
  or synthetic data (the demo) and for character-level language models.
* :class:`BPETokenizer`: subword byte-pair encoding learnt from the training text with Hugging Face
  ``tokenizers``. Spaces become "▁" (the SentencePiece convention), so languages without spaces, such as
  Chinese, need no word segmenter: merges are learnt inside the space-free runs. Punctuation and digits are
  split off first, so "bushes." shares its tokens with "bushes" and numbers are spelt digit by digit.

Ids 0-3 are always ``<pad> <s> </s> <unk>``. ``encode`` returns the bare tokens; the task adds ``<s>``/``</s>``.
A tokenizer saves to one JSON file and loads back without executing anything.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class Tokenizer(Protocol):
    """What qkv needs of a tokenizer."""

    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def tokens(self, text: str) -> list[str]: ...

    def to_dict(self) -> dict: ...


class CharTokenizer:
    """One token per character seen in training; unseen characters become ``<unk>``."""

    kind = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        self.itos = list(SPECIALS) + [c for c in chars if c not in SPECIALS]
        self.stoi = {s: i for i, s in enumerate(self.itos)}

    @classmethod
    def train(cls, texts: Iterable[str], *, min_count: int = 1) -> CharTokenizer:
        counts = Counter(c for text in texts for c in text)
        return cls(sorted(c for c, n in counts.items() if n >= min_count))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, UNK_ID) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(SPECIALS) or i == UNK_ID)

    def tokens(self, text: str) -> list[str]:
        return [self.itos[i] for i in self.encode(text)]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.itos[len(SPECIALS) :]}


class BPETokenizer:
    """Subword BPE (Sennrich et al. 2016) backed by a Hugging Face ``tokenizers.Tokenizer``."""

    kind = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        for i, special in enumerate(SPECIALS):
            if hf_tokenizer.token_to_id(special) != i:
                raise ValueError(f"BPE vocabulary must start with {list(SPECIALS)}; {special!r} is not id {i}")

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, min_frequency: int = 2) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        # NFC only: NFKC would turn full-width Chinese punctuation (，？) into ASCII and no longer match references.
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
            pre_tokenizers.Punctuation(behavior="isolated"),  # "bushes." -> "bushes" "." : fewer rare tokens
            pre_tokenizers.Digits(individual_digits=True),  # numbers spelt digit by digit generalise
        ])
        hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS), show_progress=False
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        # Drop padding and sentence markers but keep <unk> visible, as the character tokenizer does.
        return self.hf.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)], skip_special_tokens=False)

    def tokens(self, text: str) -> list[str]:
        return self.hf.encode(text, add_special_tokens=False).tokens

    def to_dict(self) -> dict:
        return {"kind": self.kind, "hf": json.loads(self.hf.to_str())}


def encode_all(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Encode many texts, in parallel where the tokenizer can."""
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def train_tokenizer(kind: str, texts: Sequence[str], *, vocab_size: int = 8000) -> Tokenizer:
    """``kind`` is ``"bpe"`` or ``"char"``."""
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size=vocab_size)
    if kind == "char":
        return CharTokenizer.train(texts)
    raise ValueError(f"tokenizer must be 'bpe' or 'char', got {kind!r}")


def tokenizer_from_dict(data: dict) -> Tokenizer:
    kind = data.get("kind")
    if kind == "char":
        return CharTokenizer(data["chars"])
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_str(json.dumps(data["hf"])))
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'bpe' or 'char'")


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    Path(path).write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")


def load_tokenizer(path: str | Path) -> Tokenizer:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read tokenizer {path}: {err}") from None
    try:
        return tokenizer_from_dict(data)
    except Exception as err:  # wrong shape, or a tokenizers-library error: either way not a usable file
        raise ValueError(f"{path} is not a qkv tokenizer file: {err}") from None
