"""Sampling: turning a step's logits into the next token.

* greedy: take the most probable token.
* sampling (:class:`Sampling`): divide the logits by a temperature, keep the k most probable tokens (top-k)
  and/or the smallest set whose probability reaches p (top-p, "nucleus"), renormalise and draw. A repetition
  penalty first makes tokens already in the context less likely. Temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How to choose the next token from the logits.

    Args:
        temperature: logits are divided by it; < 1 sharpens, > 1 flattens; 0 means greedy (argmax).
        top_k: keep only the k most probable tokens (None: all).
        top_p: keep the smallest set of most probable tokens whose probabilities sum to at least p (None: all).
        repetition_penalty: > 1 makes every token already in the context less likely (CTRL, Keskar et al.
            2019): a positive logit is divided by it, a negative one multiplied. Applies to greedy too.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = none), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling(temperature=0.0)
_TINY = torch.finfo(torch.float32).tiny


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits ``(B, V)``; seen ``(B, V)`` bool: tokens already in each row's context."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th are kept)."""
    if k >= logits.size(-1):
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most probable tokens whose total probability is at least ``p``.

    Sorted by probability, a token is dropped when the tokens before it already reach ``p``; the most probable
    token is always kept, however small ``p`` (below float32's smallest number, 1e-300 compares as 0, which the mass
    before the first token reaches).
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more probable tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def next_token_logits(logits: Tensor, sampling: Sampling, seen: Tensor | None = None) -> Tensor:
    """The logits that are actually sampled from: repetition penalty, temperature, top-k, top-p, in that
    order (the order Hugging Face uses too)."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, sampling.repetition_penalty)
    if sampling.greedy:
        return logits
    # Shifted so the largest logit is 0 and every other < 0: divided by however small a temperature they stay
    # <= 0 (at worst -inf, probability 0), never +inf or nan. The temperature is kept above float32's smallest
    # normal number, which it is rounded to in the division: 1e-300 would become 0, and 0/0 is nan. In the
    # limit the draw is uniform among the tied largest logits, as the softmax's limit is.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(sampling.temperature, _TINY)
    if sampling.top_k is not None:
        logits = top_k_filter(logits, sampling.top_k)
    if sampling.top_p is not None:
        logits = top_p_filter(logits, sampling.top_p)
    return logits


def choose(logits: Tensor, sampling: Sampling, *, seen: Tensor | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """logits ``(B, V)`` -> next tokens ``(B,)``: argmax when greedy, else a draw from the filtered softmax."""
    logits = next_token_logits(logits, sampling, seen)
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


__all__ = ["GREEDY", "Sampling", "apply_repetition_penalty", "choose", "next_token_logits", "top_k_filter",
           "top_p_filter"]
