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
  with the special-token ids its authors chose, read from a Hugging Face ``tokenizer.json`` or rebuilt from
  the vocabulary and merges stored in a GGUF file.

and a fourth is BERT's, trained here or read with a pretrained encoder:

* :class:`WordPieceTokenizer`: WordPiece subwords ("playing" -> "play" "##ing") with BERT's five special
  tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]``; :meth:`~WordPieceTokenizer.wrap` frames a sentence as
  ``[CLS] tokens [SEP]``, cut to the model's length.

A tokenizer saves to one JSON file and loads back without executing anything.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

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
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, min_frequency: int = 2,
              byte_level: bool = False) -> BPETokenizer:
        """Learn merges from ``texts``.

        ``byte_level=True`` gives GPT-2's flavour instead, for language models: the text is seen as UTF-8 bytes
        (no ``<unk>`` ever, and spaces, tabs and line breaks survive exactly), split by GPT-2's rule into words,
        numbers, punctuation and whitespace runs, with digits first split one by one.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

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


# Tokens that end a turn or a document in common pretrained vocabularies. A chat model ends its answer with its
# end-of-turn marker, which need not be the tokenizer's eos (SmolLM2's base model's eos is <|endoftext|>, its
# chat model writes <|im_end|>), so generation stops at any of those the vocabulary has.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")

# llama.cpp's token types (tokenizer.ggml.token_type). CONTROL tokens are special: matched whole in the text
# and dropped when decoding. USER_DEFINED ones are matched whole but are ordinary text when decoded.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def _digits_then_bytelevel():
    """SmolLM2's pre-tokenizer, as in its ``tokenizer.json`` (and StarCoder's): every digit alone, then GPT-2's.

    The digit split runs first, so it also cuts a run of spaces off the number that follows: "a  1" is
    ``a ĠĠ 1``, where GPT-2's rule alone gives ``a Ġ Ġ1`` and then, for lack of a merge, ``a Ġ Ġ 1``.
    llama.cpp's "smollm" pre-tokenizer does the same with the regex ``\\p{N}`` ahead of GPT-2's.
    """
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _gpt2_bytelevel():
    """GPT-2's pre-tokenizer: its regex (words, numbers, punctuation runs, spaces) inside ``ByteLevel``."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre (llama.cpp's name for how text is split before BPE; the split itself is C++ code there)
# -> the same split in `tokenizers`. "smollm" is checked against SmolLM2's tokenizer in the tests; "gpt2" is
# llama.cpp's copy of the GPT-2 regex that ByteLevel runs. Another name is an error, not a guess.
GGUF_PRE_TOKENIZERS = {"smollm": _digits_then_bytelevel, "gpt2": _gpt2_bytelevel}


def _default_stop_ids(hf_tokenizer, eos_id: int | None) -> set[int]:
    """eos and the END_MARKERS the vocabulary has."""
    markers = (hf_tokenizer.token_to_id(token) for token in END_MARKERS)
    return {i for i in (eos_id, *markers) if i is not None}


def _special_token_text(value: Any) -> str | None:
    """A token in ``tokenizer_config.json``: a string, or an AddedToken written as a dict with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
    ) -> None:
        self.hf = hf_tokenizer
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.stop_ids = set(_default_stop_ids(hf_tokenizer, eos_id) if stop_ids is None else stop_ids)
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary of {self.vocab_size} tokens")
        outside = sorted(i for i in self.stop_ids if not 0 <= i < self.vocab_size)
        if outside:
            raise ValueError(f"stop_ids {outside} are outside the vocabulary of {self.vocab_size} tokens")

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> PretrainedTokenizer:
        """Rebuild a byte-level BPE tokenizer from the metadata of a GGUF file.

        A GGUF file has no ``tokenizer.json``, but it stores what one is made of: the vocabulary
        (``tokenizer.ggml.tokens``, already spelt in GPT-2's byte alphabet), the merges in priority order
        (``tokenizer.ggml.merges``, ``"Ġ t"``), each token's type (``tokenizer.ggml.token_type``), the special
        ids, and the name of the pre-tokenizer (``tokenizer.ggml.pre``), which is code in llama.cpp and is
        rebuilt here from :data:`GGUF_PRE_TOKENIZERS`.

        Args:
            metadata: ``GGUFContents.metadata`` (see :func:`qkv.interop.read_gguf`).

        Raises:
            ValueError: for a tokenizer other than byte-level BPE (``tokenizer.ggml.model`` ``"gpt2"``), an
                unknown pre-tokenizer, or missing tokens/merges.
        """
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model={model!r} is not supported; qkv rebuilds byte-level BPE ('gpt2') only"
            )
        # No default: a file without the key gets llama.cpp's "default" split, which is not GPT-2's.
        pre = metadata.get("tokenizer.ggml.pre")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"tokenizer.ggml.pre={pre!r} is not supported; expected one of {sorted(GGUF_PRE_TOKENIZERS)}"
            )
        tokens, merges = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise ValueError("the GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        hf = HFTokenizer(
            models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
        )
        hf.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
        hf.decoder = decoders.ByteLevel()
        types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Tokens already in the vocabulary keep their ids; being "added" makes them match whole in the text.
        # normalized=False: matched as written, not after the normalizer.
        hf.add_special_tokens([
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=True) if kind == _GGUF_CONTROL
        ])
        hf.add_tokens([
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=True) if kind == _GGUF_USER_DEFINED
        ])
        return cls(
            hf,
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
            pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> PretrainedTokenizer:
        """Load ``tokenizer.json`` from a Hugging Face model folder.

        ``tokenizer.json`` holds the whole pipeline but not which token is bos, eos or padding: those come from
        ``tokenizer_config.json`` (as token strings), else from ``config.json`` (as ids). A list of eos ids
        (LLaMA 3) gives eos and further stop ids.

        Raises:
            ValueError: if ``tokenizer.json`` is missing or unreadable.
        """
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own exception type for any bad file
            raise ValueError(f"cannot read {path}: {err}") from None
        config = _read_json_if_present(folder / "config.json")
        ids: dict[str, Any] = {name: config.get(f"{name}_token_id") for name in ("bos", "eos", "pad")}
        extra_stops: set[int] = set()
        if isinstance(ids["eos"], list):  # LLaMA 3: end of text, end of turn, ... all end generation
            extra_stops, ids["eos"] = set(ids["eos"]), (ids["eos"][0] if ids["eos"] else None)
        tokenizer_config = _read_json_if_present(folder / "tokenizer_config.json")
        for name in ("bos", "eos", "pad"):
            text = _special_token_text(tokenizer_config.get(f"{name}_token"))
            if text is not None and hf.token_to_id(text) is not None:
                ids[name] = hf.token_to_id(text)
        stop_ids = _default_stop_ids(hf, ids["eos"]) | extra_stops
        try:
            return cls(hf, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], stop_ids=stop_ids)
        except ValueError as err:
            raise ValueError(f"{folder}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos (special tokens written in the text are kept)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, special tokens left out.

        Byte-level tokens can end inside a multi-byte character (an emoji is four bytes, often two tokens);
        decoding only part of it gives the replacement character "�", so decode whole sequences, not one token
        at a time.
        """
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        return self.hf.encode(text, add_special_tokens=False).tokens

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "hf": json.loads(self.hf.to_str()), "bos_id": self.bos_id, "eos_id": self.eos_id,
            "pad_id": self.pad_id, "stop_ids": sorted(self.stop_ids),
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
        """Learn a WordPiece vocabulary from ``texts`` with BERT's normalizer and pre-tokenizer."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

        hf = HFTokenizer(models.WordPiece(unk_token=WORDPIECE_SPECIALS["unk"]))
        hf.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=list(WORDPIECE_SPECIALS.values()), show_progress=False)
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> WordPieceTokenizer:
        """``tokenizer.json`` of a Hugging Face BERT folder; special tokens named in ``tokenizer_config.json``
        (or ``special_tokens_map.json``) if they differ from BERT's.

        Raises:
            ValueError: if ``tokenizer.json`` is missing, unreadable, or lacks ``[PAD]``/``[CLS]``/``[SEP]``.
        """
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (qkv reads the fast-tokenizer file, not vocab.txt)")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own exception type for any bad file
            raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
        specials = {}
        for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the later wins
            config = _read_json_if_present(folder / file)
            for name in WORDPIECE_SPECIALS:
                text = _special_token_text(config.get(f"{name}_token"))
                if text is not None:
                    specials[name] = text
        try:
            return cls(hf, specials=specials)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

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
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def wrap(self, ids: Sequence[int], max_length: int) -> list[int]:
        """``[CLS] ids [SEP]``, the ids cut so that the whole is at most ``max_length`` tokens (as Hugging Face
        truncates a single sentence: the end goes, the frame stays)."""
        if max_length < 3:
            raise ValueError(f"max_length must leave room for [CLS], one token and [SEP]: >= 3, got {max_length}")
        return [self.cls_id, *ids[: max_length - 2], self.sep_id]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        return self.hf.encode(text, add_special_tokens=False).tokens

    def id_to_token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "hf": json.loads(self.hf.to_str()), "specials": self.specials}


def _read_json_if_present(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def encode_all(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Encode many texts, in parallel where the tokenizer can."""
    if isinstance(tokenizer, BPETokenizer | PretrainedTokenizer | WordPieceTokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def train_tokenizer(kind: str, texts: Sequence[str], *, vocab_size: int = 8000, byte_level: bool = False) -> Tokenizer:
    """``kind`` is ``"bpe"`` (``byte_level`` as for :meth:`BPETokenizer.train`) or ``"char"``."""
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size=vocab_size, byte_level=byte_level)
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
    if kind == "pretrained":
        from tokenizers import Tokenizer as HFTokenizer

        return PretrainedTokenizer(
            HFTokenizer.from_str(json.dumps(data["hf"])), bos_id=data["bos_id"], eos_id=data["eos_id"],
            pad_id=data["pad_id"], stop_ids=data["stop_ids"],
        )
    if kind == "wordpiece":
        from tokenizers import Tokenizer as HFTokenizer

        return WordPieceTokenizer(HFTokenizer.from_str(json.dumps(data["hf"])), specials=data["specials"])
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'bpe', 'char', 'pretrained' or 'wordpiece'")


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
