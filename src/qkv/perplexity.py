"""A language model's perplexity on a text, measured as llama.cpp's ``llama-perplexity`` measures it, so that the
two can be compared number for number.

The text's tokens are cut into consecutive chunks of ``n_ctx`` (what is left at the end is dropped); each chunk is
read from its start, with nothing before it, and only the predictions of its second half are scored: every token
from ``n_ctx / 2 + 1`` on, from the chunk before it, so that each scored token has at least half a context
behind it. Where the tokenizer puts a BOS token in front of a text, the chunk's first token is replaced by it, as
llama.cpp does. Over the N scored tokens, with ``ℓ_i`` each one's negative log-likelihood:

    PPL = exp(mean ℓ)          its standard error  PPL · √((mean ℓ² − (mean ℓ)²) / (N − 1))

(the second is llama.cpp's "±": the first-order error of exp of a mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Perplexity:
    """The result: ``value`` ± ``error`` over ``chunks`` chunks of ``n_ctx`` tokens, ``scored`` tokens in all, and
    the perplexity after each chunk (``running``, llama.cpp's ``[1]12.34,[2]...``)."""

    value: float
    error: float
    chunks: int
    n_ctx: int
    scored: int
    running: tuple[float, ...]


def perplexity(logits_of: Callable[[Tensor], Tensor], ids: Sequence[int], n_ctx: int, *, bos: int | None = None,
               on_chunk: Callable[[int, float], None] | None = None) -> Perplexity:
    """``llama-perplexity``'s measure of the text ``ids`` (see the module's text).

    Args:
        logits_of: ``(1, n_ctx)`` token ids -> ``(1, n_ctx, vocab)`` logits (a model).
        ids: the text's tokens.
        n_ctx: the chunk length: at least 4, even.
        bos: the token that replaces each chunk's first (None: the chunks as they are).
        on_chunk: called after each chunk with its number (from 1) and the perplexity so far.

    Raises:
        ValueError: a chunk length below 4 or odd, or a text shorter than two chunks (llama.cpp's own limit).
    """
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"the context must be an even number of tokens >= 4, got {n_ctx}")
    if len(ids) < 2 * n_ctx:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than two chunks of {n_ctx}: give a longer text or a "
                         "smaller --context")
    first = n_ctx // 2
    total, squares, scored, running = 0.0, 0.0, 0, []
    with torch.no_grad():
        for chunk_number, start in enumerate(range(0, len(ids) // n_ctx * n_ctx, n_ctx), 1):
            chunk = torch.tensor([list(ids[start : start + n_ctx])])
            targets = chunk[0, first + 1 :].clone()
            if bos is not None:
                chunk[0, 0] = bos
            logp = logits_of(chunk).float().log_softmax(-1)[0, first : n_ctx - 1]
            nll = -logp.gather(1, targets[:, None]).double().flatten()
            total, squares, scored = total + nll.sum().item(), squares + nll.square().sum().item(), scored + len(nll)
            running.append(math.exp(total / scored))
            if on_chunk is not None:
                on_chunk(chunk_number, running[-1])
    mean = total / scored
    spread = max(squares / scored - mean * mean, 0.0)
    value = math.exp(mean)
    return Perplexity(value, value * math.sqrt(spread / (scored - 1)), len(running), n_ctx, scored, tuple(running))


__all__ = ["Perplexity", "perplexity"]
