"""Constrained decoding: only the tokens that keep the text inside a grammar may come next.

A JSON schema, a grammar (Lark's syntax, or llama.cpp's GBNF) or a regular expression is compiled by
``llguidance`` (the library llama.cpp, vLLM and TensorRT-LLM use; no dependencies of its own) against the model's
token table; at each step it says which tokens may follow the text so far, and decoding sets every other logit to
-inf before it chooses:

    logits_t[v] = -inf  for every token v that no text of the grammar continues with     (the mask)
    x_t = choose(logits_t)                                                                 (greedy, sampled, ...)

so that sampling, temperature and top-k/top-p compose with it unchanged. When the grammar is complete the
end-of-sequence token is allowed (the only one, once nothing else can follow). ``python benchmarks/bench_grammar.py``
measures a mask on SmolLM2's tokenizer: tens of microseconds, a small part of a decoding step.

The token table comes from the tokenizer: a pretrained model's ``tokenizers`` JSON (byte-level BPE, SentencePiece
with byte fallback) as it is; qkv's own character vocabularies as each token's UTF-8 bytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

KINDS = ("json_schema", "lark", "regex")
NAMES = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regular expression"}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("constrained decoding needs the llguidance package: pip install llguidance") from None
    return llguidance


class _CharTable:
    """A character vocabulary as llguidance's tokenizer interface wants it: each token's bytes, the specials marked."""

    def __init__(self, tokenizer, eos: int) -> None:
        specials = set(getattr(tokenizer, "special_ids", ()))
        self.tokens = [b"\xff" + tok.encode() if i in specials else tok.encode()
                       for i, tok in enumerate(tokenizer.itos)]
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = sorted(specials)
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def token_table(tokenizer, vocab_size: int, eos: int):
    """llguidance's view of ``tokenizer``: ``vocab_size`` rows (a model's table may be longer than its tokenizer),
    ``eos`` the token that ends the text.

    Raises:
        ValueError: llguidance missing, or a tokenizer it cannot be given (named)."""
    llg = _llguidance()
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return llg.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "itos"):
        return llg.LLTokenizer(_CharTable(tokenizer, eos), n_vocab=vocab_size)
    raise ValueError(f"constrained decoding needs a tokenizer with a token table; a {type(tokenizer).__name__} has "
                     "none")


def grammar(kind: str, source: str | dict[str, Any]) -> str:
    """llguidance's grammar of a JSON schema (a dict or its JSON text), a grammar (``lark``: Lark's syntax, or
    llama.cpp's GBNF) or a regular expression.

    Raises:
        ValueError: an unknown kind, a schema that is not JSON, or what llguidance refuses in it, in its words
            (the keyword or the place named)."""
    llg = _llguidance()
    if kind not in KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError as err:
                raise ValueError(f"the JSON schema is not JSON: {err}") from None
        if not isinstance(source, dict):
            raise ValueError(f"a JSON schema is a JSON object, got {type(source).__name__}")
        text = llg.LLMatcher.grammar_from_json_schema(json.dumps(source))
    elif kind == "lark":
        text = llg.LLMatcher.grammar_from_lark(_lark(source))
    else:
        text = llg.LLMatcher.grammar_from_regex(source)
    message = llg.LLMatcher.validate_grammar(text)
    if message and not message.startswith("WARNING"):
        reason = message.split("\n   1 | ")[0]  # the grammar's lines that follow are the caller's own text
        raise ValueError(f"the {NAMES[kind]} cannot be used: {' '.join(reason.split())[:300]}")
    return text


def _lark(source: str) -> str:
    """A grammar in Lark's syntax as llguidance reads it, or in llama.cpp's GBNF (``root ::= ...``) turned into it."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return any_to_lark(source)
    except GbnfToLarkError as err:
        raise ValueError(f"the GBNF grammar cannot be read: {' '.join(str(err).split())[:300]}") from None


class Constraint:
    """One sequence's constraint as it decodes: :meth:`mask` the tokens that may come next, :meth:`take` the one
    chosen, :attr:`done` once the grammar is complete and nothing may follow.

    Args:
        table: :func:`token_table`'s tokenizer.
        compiled: :func:`grammar`'s text.
    """

    def __init__(self, table, compiled: str) -> None:
        llg = _llguidance()
        self.matcher = llg.LLMatcher(table, compiled)
        self.vocab = table.vocab_size
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()[:300]}")

    def mask(self) -> Tensor:
        """``(vocab,)`` bool: True where a token may come next."""
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8)
        return ((bits[:, None] >> shifts) & 1).bool().flatten()[: self.vocab]

    def take(self, token: int) -> None:
        """The token chosen (one :meth:`mask` allowed).

        Raises:
            ValueError: a token the grammar does not allow there."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not continue the grammar: {self.matcher.get_error()[:200]}")

    @property
    def done(self) -> bool:
        """The text is complete: the grammar accepts it and nothing may follow (the end-of-sequence token was taken, or
        is all that is left)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The text so far is a whole sentence of the grammar (more may still follow)."""
        return self.matcher.is_accepting()


def end_token(tokenizer, stop_ids) -> int:
    """The token a constrained text ends with: the tokenizer's end-of-sequence token where it is one of the model's
    stop tokens, else the least of them."""
    eos = getattr(tokenizer, "eos_id", None)
    return eos if eos in stop_ids else min(stop_ids)


def masked(logits: Tensor, constraints) -> Tensor:
    """``logits`` ``(B, V)`` with each row's disallowed tokens at -inf, row ``i`` by ``constraints[i]`` (None: the row
    as it is); ``logits`` itself where no row has a constraint."""
    if all(c is None for c in constraints):
        return logits
    return torch.stack([x if c is None else apply(x, c) for x, c in zip(logits, constraints, strict=True)])


def apply(logits: Tensor, constraint: Constraint) -> Tensor:
    """``logits`` ``(..., V)`` with every token the constraint does not allow at -inf (a copy); rows of a table
    longer than the tokenizer's stay disallowed."""
    allowed = constraint.mask().to(logits.device)
    out = torch.full_like(logits, float("-inf"))
    width = min(allowed.numel(), logits.size(-1))
    keep = allowed[:width]
    out[..., :width] = torch.where(keep, logits[..., :width], out[..., :width])
    return out


__all__ = ["KINDS", "Constraint", "apply", "end_token", "grammar", "masked", "token_table"]
