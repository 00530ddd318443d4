"""Tokenizers: text <-> token ids, with the special tokens every qkv model shares.

Two kinds, one interface:

* :class:`CharTokenizer`: one token per character. No training beyond collecting the alphabet; good for small
  or synthetic data (the demo) and for character-level language models.
* :class:`BPETokenizer`: subword byte-pair encoding learnt from the training text with Hugging Face
  ``tokenizers``. Spaces become "▁" (the SentencePiece convention), so languages without spaces, such as
  Chinese, need no word segmenter: merges are learnt inside the space-free runs. Punctuation and digits are
  split off first, so "bushes." shares its tokens with "bushes" and numbers are spelt digit by digit.

Ids 0-3 are always ``<pad> <s> </s> <unk>``. ``encode`` returns the bare tokens; the task adds ``<s>``/``</s>``.

A third kind is not trained here but comes with a pretrained model:

* :class:`PretrainedTokenizer`: the model's own tokenizer (usually byte-level BPE, as in GPT-2 and SmolLM2)
  with the special-token ids its authors chose. The readers of other projects' files build it:
  :func:`qkv.interop.hf_folder.tokenizer_from_hf_folder` from a Hugging Face ``tokenizer.json``, and
  :func:`qkv.interop.gguf_tokenizer.tokenizer_from_gguf` from the vocabulary and merges stored in a GGUF file.

and a fourth is BERT's, trained here or read with a pretrained encoder:

* :class:`WordPieceTokenizer`: WordPiece subwords ("playing" -> "play" "##ing") with BERT's five special
  tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]``; :meth:`~WordPieceTokenizer.wrap` frames a sentence as
  ``[CLS] tokens [SEP]``, cut to the model's length. A pretrained encoder's comes from its Hugging Face folder
  (:func:`qkv.interop.hf_folder.wordpiece_tokenizer_from_hf_folder`).

A trained vocabulary is at most ``vocab_size`` tokens; a size too small for the special tokens and the
alphabet is an error, not a larger vocabulary. A tokenizer saves to one JSON file and loads back without
executing anything.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from .files import quoted, read_json

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
# The largest vocabulary qkv trains: four times the largest in use (Gemma's 256,000), a few MB of tables.
MAX_VOCAB = 2**20
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def utf8_checked(text: str, what: str) -> str:
    """``text``, which must be valid Unicode to reach a tokenizer: a lone surrogate (half of a character: a JSON
    ``"\\ud800"``, or a byte that is not UTF-8 in a command-line argument, which Python decodes with
    ``surrogateescape``) is refused here naming ``what`` and the byte or the surrogate. Every text the tokenizers
    below encode passes this check, so the Hugging Face library's own error ("TextInputSequence must be str") is
    never the one a user reads.

    Raises:
        ValueError: ``"{what} is not valid UTF-8 (...); convert it to UTF-8"``, one line.
    """
    if text.isascii():  # O(1) in CPython: most texts need no more
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        detail = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise ValueError(f"{what} is not valid UTF-8 ({detail}); convert it to UTF-8") from None
    return text


def _encoding(hf, text: str):
    """``hf``'s encoding of ``text`` (checked, :func:`utf8_checked`), without the tokenizer's own special tokens."""
    return hf.encode(utf8_checked(text, "the text"), add_special_tokens=False)


def _encodings(hf, texts: Sequence[str]) -> list[list[int]]:
    """The ids of each of ``texts`` (each checked, :func:`utf8_checked`), encoded in parallel."""
    checked = [utf8_checked(text, f"text {i}") for i, text in enumerate(texts, 1)]
    return [e.ids for e in hf.encode_batch(checked, add_special_tokens=False)]


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
    special_ids = frozenset((PAD_ID, BOS_ID, EOS_ID, UNK_ID))  # tokens that are never text

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
    special_ids = frozenset((PAD_ID, BOS_ID, EOS_ID, UNK_ID))  # tokens that are never text

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        for i, special in enumerate(SPECIALS):
            if hf_tokenizer.token_to_id(special) != i:
                raise ValueError(f"BPE vocabulary must start with {list(SPECIALS)}; {quoted(special)} is not id {i}")

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, min_frequency: int = 2,
              byte_level: bool = False) -> BPETokenizer:
        """Learn merges from ``texts``.

        ``byte_level=True`` gives GPT-2's flavour instead, for language models: the text is seen as UTF-8 bytes
        (no ``<unk>`` ever, and spaces, tabs and line breaks survive exactly), split by GPT-2's rule into words,
        numbers, punctuation and whitespace runs, with digits first split one by one.

        Args:
            texts: the training text, one string per line or document.
            vocab_size: the most tokens to learn, the 4 special tokens and the alphabet (the 256 bytes, or the
                characters of ``texts``) included.
            min_frequency: a pair must occur this often to be merged.
            byte_level: GPT-2's byte-level flavour (above).

        Raises:
            ValueError: if ``vocab_size`` < 1, or is smaller than the special tokens and the alphabet need.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

        _check_vocab_size(vocab_size)
        if byte_level:
            hf = HFTokenizer(models.BPE())
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
            hf.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                          special_tokens=list(SPECIALS), show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
            hf.train_from_iterator(texts, trainer=trainer)
            _check_learnt_size(hf, vocab_size, len(SPECIALS), "bytes")
            return cls(hf)
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
        _check_learnt_size(hf, vocab_size, len(SPECIALS), "characters")
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return _encoding(self.hf, text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return _encodings(self.hf, texts)

    def decode(self, ids: Iterable[int]) -> str:
        # Drop padding and sentence markers but keep <unk> visible, as the character tokenizer does.
        return self.hf.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)], skip_special_tokens=False)

    def tokens(self, text: str) -> list[str]:
        return _encoding(self.hf, text).tokens

    def to_dict(self) -> dict:
        return {"kind": self.kind, "hf": json.loads(self.hf.to_str())}


# Tokens that end a turn or a document in common pretrained vocabularies. A chat model ends its answer with its
# end-of-turn marker, which need not be the tokenizer's eos (SmolLM2's base model's eos is <|endoftext|>, its
# chat model writes <|im_end|>), so generation stops at any of those the vocabulary has: ChatML's, Llama 3's, Gemma's
# and Phi-3's, as llama.cpp ends generation at each.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

def default_stop_ids(hf_tokenizer, eos_id: int | None) -> set[int]:
    """The ids that end generation when a model names no others: eos and the END_MARKERS the vocabulary has."""
    markers = (hf_tokenizer.token_to_id(token) for token in END_MARKERS)
    return {i for i in (eos_id, *markers) if i is not None}


class PretrainedTokenizer:
    """The tokenizer a pretrained model was trained with, and the ids of its special tokens.

    Its vocabulary is the model's, not qkv's: ids 0-3 are whatever the model's authors chose, so the special
    ids are attributes rather than the module's constants. Most pretrained decoders use byte-level BPE (GPT-2,
    SmolLM2, LLaMA 3): text is first turned into bytes, each byte spelt as one printable character (a space
    is ``Ġ``), so any text can be encoded without ``<unk>``, and decoding maps the characters back to bytes and
    the bytes back to UTF-8.

    Special tokens written in the text (``<|im_start|>``) are matched whole, which is how a chat prompt gets
    its markers; ``decode`` drops them.

    Attributes:
        hf: the Hugging Face ``tokenizers.Tokenizer``.
        bos_id, eos_id, pad_id: the begin/end-of-sequence and padding ids, None where the model has none.
        stop_ids: tokens that end generation: eos and the end-of-turn markers in the vocabulary (END_MARKERS).
        add_bos: whether the model reads every text after ``bos_id`` (LLaMA 1/2, Llama 3), as it was trained:
            :meth:`encode_prompt` puts it there.
    """

    kind = "pretrained"

    def __init__(
        self,
        hf_tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        stop_ids: Iterable[int] | None = None,
        add_bos: bool = False,
    ) -> None:
        self.hf = hf_tokenizer
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos and bos_id is not None
        self.stop_ids = set(default_stop_ids(hf_tokenizer, eos_id) if stop_ids is None else stop_ids)
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary of {self.vocab_size} tokens")
        outside = sorted(i for i in self.stop_ids if not 0 <= i < self.vocab_size)
        if outside:
            raise ValueError(f"stop_ids {quoted(outside)} are outside the vocabulary of {self.vocab_size} tokens")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos (special tokens written in the text are kept)."""
        return _encoding(self.hf, text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return _encodings(self.hf, texts)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text the model continues: :meth:`encode`, after ``bos_id`` where the model wants one
        (``add_bos``) and the text does not already begin with it (a chat template may write it)."""
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.add_bos and ids[:1] != [self.bos_id] else ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, special tokens left out.

        Byte-level tokens can end inside a multi-byte character (an emoji is four bytes, often two tokens);
        decoding only part of it gives the replacement character "�", so decode whole sequences, not one token
        at a time.
        """
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        return _encoding(self.hf, text).tokens

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "hf": json.loads(self.hf.to_str()), "bos_id": self.bos_id, "eos_id": self.eos_id,
            "pad_id": self.pad_id, "stop_ids": sorted(self.stop_ids), "add_bos": self.add_bos,
        }


WORDPIECE_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


class WordPieceTokenizer:
    """BERT's tokenizer: WordPiece subwords and the special tokens of an encoder.

    WordPiece (Schuster & Nakajima 2012; BERT) splits each word greedily into the longest pieces found in its
    vocabulary, continuation pieces marked ``##``: "embeddings" -> ``em ##bed ##ding ##s``. Before that, BERT's
    normalizer lower-cases (for uncased models), strips control characters and puts spaces around every CJK
    character, so Chinese is read one character at a time; its pre-tokenizer splits on spaces and punctuation.

    An encoder reads a whole sentence framed as ``[CLS] tokens [SEP]``: ``[CLS]``'s final state feeds the
    pooler, ``[SEP]`` ends a segment, ``[PAD]`` fills a batch, ``[MASK]`` hides the tokens that masked-language
    modelling predicts. :meth:`encode` gives the bare tokens (the :class:`Tokenizer` protocol); :meth:`wrap`
    adds the frame and truncates.

    The pipeline is a Hugging Face ``tokenizers.Tokenizer``; any padding or truncation stored in it is
    switched off (all-MiniLM-L6-v2's file pads every sentence to 128 tokens), because qkv batches sentences of
    similar length and pads each batch only to its longest.

    Attributes:
        hf: the Hugging Face tokenizer.
        pad_id, unk_id, cls_id, sep_id, mask_id: the special ids (``mask_id`` None if the vocabulary has none).
    """

    kind = "wordpiece"

    def __init__(self, hf_tokenizer, *, specials: Mapping[str, str] | None = None) -> None:
        self.hf = hf_tokenizer
        self.hf.no_padding()
        self.hf.no_truncation()
        self.specials = {**WORDPIECE_SPECIALS, **(specials or {})}
        ids = {name: hf_tokenizer.token_to_id(token) for name, token in self.specials.items()}
        missing = [self.specials[name] for name in ("pad", "cls", "sep") if ids[name] is None]
        if missing:
            raise ValueError(f"a BERT vocabulary needs the tokens {missing}, which this tokenizer lacks")
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            ids["pad"], ids["unk"], ids["cls"], ids["sep"], ids["mask"]
        )

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, min_frequency: int = 2,
              lowercase: bool = True) -> WordPieceTokenizer:
        """Learn a WordPiece vocabulary from ``texts`` with BERT's normalizer and pre-tokenizer.

        Args:
            texts: the training text, one string per sentence or document.
            vocab_size: the most tokens to learn, the 5 special tokens and the alphabet included (each character
                that starts a word, and each that continues one as ``##c``).
            min_frequency: a pair must occur this often to be merged.
            lowercase: lower-case the text first (an uncased model).

        Raises:
            ValueError: if ``vocab_size`` < 1, or is smaller than the special tokens and the alphabet need.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

        _check_vocab_size(vocab_size)
        hf = HFTokenizer(models.WordPiece(unk_token=WORDPIECE_SPECIALS["unk"]))
        hf.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=list(WORDPIECE_SPECIALS.values()), show_progress=False)
        hf.train_from_iterator(texts, trainer=trainer)
        _check_learnt_size(hf, vocab_size, len(WORDPIECE_SPECIALS), "characters, word-initial or ##-continued")
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        """Ids that are never text: padding, sentence frame, mask (and unknown)."""
        ids = (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)
        return {i for i in ids if i is not None}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without ``[CLS]``/``[SEP]``."""
        return _encoding(self.hf, text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return _encodings(self.hf, texts)

    def wrap(self, ids: Sequence[int], max_length: int) -> list[int]:
        """``[CLS] ids [SEP]``, the ids cut so that the whole is at most ``max_length`` tokens (as Hugging Face
        truncates a single sentence: the end goes, the frame stays)."""
        if max_length < 3:
            raise ValueError(f"max_length must leave room for [CLS], one token and [SEP]: >= 3, got {max_length}")
        return [self.cls_id, *ids[: max_length - 2], self.sep_id]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        return _encoding(self.hf, text).tokens

    def id_to_token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "hf": json.loads(self.hf.to_str()), "specials": self.specials}


def _check_vocab_size(vocab_size: int) -> None:
    # Checked before training: the tokenizers library takes 0 as "no limit", overflows on a negative size and
    # aborts the process (not an exception) when it cannot allocate tables for a huge one.
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size={vocab_size:,} is more tokens than qkv trains (at most {MAX_VOCAB:,}); choose "
                         "a smaller vocabulary")


def _check_learnt_size(hf_tokenizer, vocab_size: int, n_specials: int, alphabet: str) -> None:
    """The trainers keep every special token and every symbol of the alphabet, whatever ``vocab_size`` says, so
    a vocabulary larger than asked for means those alone did not fit."""
    learnt = hf_tokenizer.get_vocab_size(with_added_tokens=True)
    if learnt > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the {learnt} tokens this text needs ({n_specials} special "
            f"tokens and {learnt - n_specials} {alphabet}); choose vocab_size >= {learnt}"
        )


def encode_all(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Encode many texts, in parallel where the tokenizer can."""
    if isinstance(tokenizer, BPETokenizer | PretrainedTokenizer | WordPieceTokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a text a model continues: a tokenizer with an ``encode_prompt`` of its own puts what the model
    wants first (:meth:`PretrainedTokenizer.encode_prompt`: its bos); qkv's own encode the text alone."""
    own = getattr(tokenizer, "encode_prompt", None)
    return own(text) if own is not None else tokenizer.encode(text)


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text as attention pictures and the explorer label it (a word piece, a BPE piece, a byte-level
    piece decoded), with line breaks, tabs and a lone space or word boundary made visible."""
    if hasattr(tokenizer, "id_to_token"):
        text = tokenizer.id_to_token(token_id)
    elif hasattr(tokenizer, "itos"):
        text = tokenizer.itos[token_id]
    else:
        text = tokenizer.decode([token_id])
    if not text and hasattr(tokenizer, "hf"):  # a piece that decodes to nothing alone, such as a word boundary
        text = tokenizer.hf.id_to_token(token_id) or ""
    text = text.replace("\n", "↵").replace("\t", "⇥")
    return "␣" if text and not text.strip(" ▁Ġ") else text  # a space, or a word-boundary mark, alone


def train_tokenizer(kind: str, texts: Sequence[str], *, vocab_size: int = 8000, byte_level: bool = False) -> Tokenizer:
    """Train a tokenizer of ``kind`` on ``texts``.

    Args:
        kind: ``"bpe"`` or ``"char"``.
        texts: the training text.
        vocab_size: the most tokens BPE may learn, as for :meth:`BPETokenizer.train`; a character tokenizer
            takes every character seen, whatever the size.
        byte_level: for BPE, as for :meth:`BPETokenizer.train`.

    Raises:
        ValueError: for another kind, a ``vocab_size`` < 1, or a BPE ``vocab_size`` too small for the special
            tokens and the alphabet.
    """
    _check_vocab_size(vocab_size)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size=vocab_size, byte_level=byte_level)
    if kind == "char":
        return CharTokenizer.train(texts)
    raise ValueError(f"tokenizer must be 'bpe' or 'char', got {quoted(kind)}")


def tokenizer_from_dict(data: dict) -> Tokenizer:
    kind = data.get("kind")
    if kind == "char":
        return CharTokenizer(_checked_chars(data.get("chars")))
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_str(json.dumps(data["hf"])))
    if kind == "pretrained":
        from tokenizers import Tokenizer as HFTokenizer

        return PretrainedTokenizer(
            HFTokenizer.from_str(json.dumps(data["hf"])), bos_id=data["bos_id"], eos_id=data["eos_id"],
            pad_id=data["pad_id"], stop_ids=data["stop_ids"], add_bos=bool(data.get("add_bos", False)),
        )
    if kind == "wordpiece":
        from tokenizers import Tokenizer as HFTokenizer

        return WordPieceTokenizer(HFTokenizer.from_str(json.dumps(data["hf"])), specials=data["specials"])
    raise ValueError(f"unknown tokenizer kind {quoted(kind)}; expected 'bpe', 'char', 'pretrained' or 'wordpiece'")


def _checked_chars(chars) -> list[str]:
    """A character tokenizer's alphabet as saved: distinct one-character strings (a string in its place would
    pass as a list of characters; an id per duplicate would leave ids no text encodes to)."""
    if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
        raise ValueError(f"\"chars\" must be a list of one-character strings, got {type(chars).__name__}")
    if len(set(chars)) != len(chars):
        raise ValueError(f"\"chars\" lists {len(chars) - len(set(chars))} character(s) twice")
    return chars


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    Path(path).write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer that :func:`save_tokenizer` wrote to ``path``.

    Raises:
        ValueError: naming the file, if it is missing, not JSON, or not a qkv tokenizer.
    """
    data = read_json(path)
    try:
        return tokenizer_from_dict(data)
    except Exception as err:  # wrong shape, or a tokenizers-library error: either way not a usable file
        raise ValueError(f"{path} is not a qkv tokenizer file: {err}") from None
