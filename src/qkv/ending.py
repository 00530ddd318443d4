"""Where a sequence being decoded ends: the one rule :func:`qkv.generation.generate` and :mod:`qkv.batching` apply
to every token they choose.

A token is added to the sequence; then the sequence ends

* at a stop token (the model's end of text or of turn), which is not handed on: it is no text;
* where the token's receiver says so (a stop string found in the text, :mod:`qkv.detokenize`);
* where a constraint's text is complete (:mod:`qkv.constrained`);
* at its limit of new tokens.

The first three are a ``"stop"``, the last a ``"length"``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any


def take(tokens: list[int], token: int, *, stop_ids: Collection[int], limit: int, constraint: Any = None,
         on_token: Callable[[int], bool | None] | None = None) -> str | None:
    """Add ``token`` to ``tokens`` (and to ``constraint``, a :class:`~qkv.constrained.Constraint`, if any), hand it
    to ``on_token`` unless it is a stop token, and say why the sequence ends there: ``"stop"``, ``"length"`` (its
    ``limit`` of new tokens reached), or None (it goes on)."""
    tokens.append(token)
    if constraint is not None:
        constraint.take(token)
    if token in stop_ids or (on_token is not None and on_token(token)) or \
            (constraint is not None and constraint.done):
        return "stop"
    return "length" if len(tokens) >= limit else None


__all__ = ["take"]
