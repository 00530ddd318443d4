"""A GGUF file's tokenizer, rebuilt from its metadata with the ``tokenizers`` library.

A GGUF file has no ``tokenizer.json``, but it stores what one is made of: the vocabulary
(``tokenizer.ggml.tokens``), each token's type (``tokenizer.ggml.token_type``: normal, control, user-defined,
byte), the special ids, and, by ``tokenizer.ggml.model``:

* ``"gpt2"``: byte-level BPE (SmolLM2, Llama 3, Qwen2 and Qwen3). The merges in priority order
  (``tokenizer.ggml.merges``, ``"Ġ t"``; none in qkv's character vocabularies), and the name of the pre-tokenizer
  (``tokenizer.ggml.pre``), which is code in llama.cpp and is rebuilt here from :data:`GGUF_PRE_TOKENIZERS`.
  Normal tokens are spelt in GPT-2's byte alphabet (a space is ``Ġ``); a user-defined token is text as written,
  matched whole and written back as it is (llama.cpp's rule).
* ``"llama"``: SentencePiece BPE (LLaMA 1 and 2, Mistral 7B, TinyLlama). No merges: a score per token
  (``tokenizer.ggml.scores``), and the pair whose joined piece scores highest joins first. Spaces are written
  ``▁`` with one added in front of the text; a character outside the vocabulary is spelt in byte tokens
  (``<0xE7>``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from ..tokenizers import PretrainedTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type). CONTROL tokens are special: matched whole in the text
# and dropped when decoding. USER_DEFINED ones are matched whole but are ordinary text when decoded.
_GGUF_NORMAL, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 3, 4


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


# The splits of Llama 3 and Qwen2, as their tokenizer.json files write them: contractions, letters with one
# leading non-letter, numbers (Qwen2: one digit at a time; Llama 3: up to three), punctuation runs, line breaks,
# spaces. They differ only in how digits are grouped.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(pattern: str):
    """A regex split (each match a piece of its own), then GPT-2's bytes-to-characters mapping without its own
    regex: how Llama 3 and Qwen2 pre-tokenize."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre (llama.cpp's name for how text is split before BPE; the split itself is C++ code there)
# -> the same split in `tokenizers`. "smollm" is checked against SmolLM2's tokenizer in the tests, "qwen2"
# against transformers' own (slow, Python) Qwen2 tokenizer; "gpt-2" is llama.cpp's copy of the GPT-2 regex that
# ByteLevel runs ("gpt2", which llama.cpp does not know, is read as it: written by qkv before, never now). Another
# name is an error, not a guess.
GGUF_PRE_TOKENIZERS = {"smollm": _digits_then_bytelevel, "gpt-2": _gpt2_bytelevel, "gpt2": _gpt2_bytelevel,
                       "llama-bpe": functools.partial(_split_then_bytes, _LLAMA3_SPLIT),
                       "qwen2": functools.partial(_split_then_bytes, _QWEN2_SPLIT)}


def pre_tokenizer_name(hf) -> str | None:
    """The ``tokenizer.ggml.pre`` name of ``hf``'s pre-tokenizer (a ``tokenizers.Tokenizer``): the name in
    :data:`GGUF_PRE_TOKENIZERS` whose split is the same, compared as the library writes them; None if none is."""
    import json

    from tokenizers import Tokenizer, models

    def written(pre_tokenizer) -> Any:
        probe = Tokenizer(models.BPE())
        probe.pre_tokenizer = pre_tokenizer
        return json.loads(probe.to_str())["pre_tokenizer"]

    ours = json.loads(hf.to_str())["pre_tokenizer"]
    return next((name for name, build in GGUF_PRE_TOKENIZERS.items() if written(build()) == ours), None)


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> PretrainedTokenizer:
    """Rebuild the tokenizer a GGUF file describes (see the module's text for the two kinds).

    Args:
        metadata: ``GGUFContents.metadata`` (see :func:`~qkv.interop.gguf.read_gguf`).

    Returns:
        The tokenizer, with the bos, eos and padding ids the file names (None for those it does not).

    Raises:
        ValueError: for another ``tokenizer.ggml.model``, an unknown pre-tokenizer, missing tokens, merges or
            scores, a merge that is not two tokens of the vocabulary (named), or types or scores that do not
            match the tokens.
    """
    from tokenizers import AddedToken

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported; qkv rebuilds byte-level BPE ('gpt2') "
                         "and SentencePiece BPE ('llama')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF metadata lacks tokenizer.ggml.tokens")
    vocab = _vocabulary(tokens)
    types = metadata.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type must give a type for each of the {len(tokens)} tokens")
    hf = _BUILDERS[kind](metadata, vocab, types)
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
    return PretrainedTokenizer(
        hf,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        # llama.cpp's defaults when the key is absent: SentencePiece files start with bos, byte-level ones do not
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def _byte_level_bpe(metadata: Mapping[str, Any], vocab: dict[str, int], types: list[int]):
    """GPT-2's byte-level BPE: the vocabulary already spelt in its byte alphabet, merges in priority order, and
    the file's pre-tokenizer."""
    from tokenizers import Tokenizer, models

    # No default: a file without the key gets llama.cpp's "default" split, which is not GPT-2's.
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre={pre!r} is not supported; expected one of {sorted(GGUF_PRE_TOKENIZERS)}"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:  # llama.cpp refuses such a file too; an empty list is a vocabulary of whole tokens
        raise ValueError("the GGUF metadata lacks tokenizer.ggml.merges, which byte-level BPE needs")
    hf = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(merges, vocab)))
    hf.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    hf.decoder = _byte_level_decoder([token for token, i in vocab.items() if types[i] == _GGUF_USER_DEFINED])
    return hf


def _byte_level_decoder(user_defined: list[str]):
    """The byte-level decoder, reading user-defined tokens as their text, as llama.cpp does. The library's reads
    a token whose every character is in the byte alphabet as those bytes (``"é"`` as the byte 0xE9), any other
    as its text: a user-defined token it would misread is first spelt in the alphabet (``"Ã©"``), matched whole,
    so no normal token is touched."""
    from tokenizers import Regex, decoders

    bytes_of = decoders.ByteLevel()
    respelt = [decoders.Replace(Regex(rf"\A{re.escape(token)}\z"), byte_level(token))
               for token in user_defined if bytes_of.decode([token]) != token]
    return decoders.Sequence([*respelt, bytes_of]) if respelt else bytes_of


def byte_level(text: str) -> str:
    """``text`` spelt in GPT-2's byte alphabet, one character per UTF-8 byte: printable bytes as themselves
    (``"a"``, ``"Ã"`` for 0xC3), the others moved past them (``" "`` is ``"Ġ"``, ``"é"`` is ``"Ã©"``)."""
    from tokenizers import pre_tokenizers

    return "".join(piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                   .pre_tokenize_str(text))


def _sentencepiece_bpe(metadata: Mapping[str, Any], vocab: dict[str, int], types: list[int]):
    """SentencePiece BPE: pieces join by score; ``▁`` for spaces, one in front of the text (unless the file
    says ``add_space_prefix`` false); characters outside the vocabulary as byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(vocab) or \
            not all(isinstance(x, (int, float)) for x in scores):
        raise ValueError(f"tokenizer.ggml.scores must give a number for each of the {len(vocab)} tokens")
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    names = list(vocab)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(vocab, scores, types), byte_fallback=True,
                              unk_token=names[unknown] if isinstance(unknown, int) and 0 <= unknown < len(names)
                              else None, fuse_unk=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # spaces as ▁, and (add_space_prefix) one in front of each stretch of text: at the start and after each special
    # token, however the text begins (llama.cpp's rule, and SentencePiece's dummy prefix)
    spaces = normalizers.Replace(" ", SPACE)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return hf


SPACE = "\u2581"  # ▁, SentencePiece's visible space


def _merges_by_score(vocab: Mapping[str, int], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges SentencePiece's scores imply: every way of cutting a normal piece into two pieces of the
    vocabulary is a merge, ranked by the joined piece's score, highest first (BPE's merge order, which
    SentencePiece wrote down as scores)."""
    ranked = []
    for piece, i in vocab.items():
        if types[i] != _GGUF_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _vocabulary(tokens: Any) -> dict[str, int]:
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("tokenizer.ggml.tokens must be a list of strings")
    return {token: i for i, token in enumerate(tokens)}


def _merge_pairs(merges: Any, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``"Ġ t"`` -> ``("Ġ", "t")``, each merge checked against the vocabulary: the tokenizers library would
    otherwise fail with its own exception, naming neither the file nor the merge. (One pass over all of them,
    then the first bad one named: a vocabulary has 50,000 to 150,000 merges.)"""
    merges = merges if isinstance(merges, list) else [merges]
    pairs = [merge.split(" ") if isinstance(merge, str) else [] for merge in merges]
    good = [len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab for p in pairs]
    if not all(good):
        i = good.index(False)
        if len(pairs[i]) != 2:
            raise ValueError(f"tokenizer.ggml.merges[{i}] = {merges[i]!r} is not two tokens separated by one space")
        unknown = next(t for t in (*pairs[i], "".join(pairs[i])) if t not in vocab)
        raise ValueError(f"tokenizer.ggml.merges[{i}] = {merges[i]!r} names {unknown!r}, which is not in "
                         "tokenizer.ggml.tokens")
    return [(a, b) for a, b in pairs]


__all__ = ["GGUF_PRE_TOKENIZERS", "byte_level", "pre_tokenizer_name", "tokenizer_from_gguf"]
