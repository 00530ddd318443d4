"""Decoding: turning next-token distributions into sequences, one token at a time.

Every model is seen the same way, as an :class:`IncrementalDecoder`: give it the newest tokens, get the
logits of the next one; it keeps whatever it needs between steps (the encoder output, the KV cache) and can
reorder its batch rows (beam search keeps the best hypotheses). The search strategies below know nothing
else about the model.

* greedy: take the most probable token every step.
* beam search: keep the ``k`` best partial translations by total log-probability; finished hypotheses are
  compared by score / lp(length) with lp(n) = ((5 + n) / 6)^α (Wu et al. 2016), so α > 0 counters the bias
  towards short outputs. With ``k = 1`` it is exactly greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class IncrementalDecoder(Protocol):
    batch_size: int

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(B, t)``: the newest tokens -> logits ``(B, vocab)`` of the next one."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Keep (and duplicate) batch rows ``index``."""
        ...


class Seq2SeqDecoder:
    """An encoder-decoder model with its source encoded once, decoding with (or without) its KV cache.

    Without the cache every step re-runs the decoder over the whole prefix: the reference the cache is
    checked against, and what the cache saves.
    """

    def __init__(self, model, src: Tensor, *, use_cache: bool = True) -> None:
        self.model = model
        self.memory = model.encode(src)  # (B, S, D)
        self.memory_mask = model.source_mask(src)  # (B, S)
        self.cache = model.new_cache() if use_cache else None
        self.prefix: Tensor | None = None
        self.batch_size = src.size(0)

    def step(self, tokens: Tensor) -> Tensor:
        if self.cache is None:
            self.prefix = tokens if self.prefix is None else torch.cat([self.prefix, tokens], dim=1)
            tokens = self.prefix
        logits = self.model.decode(tokens, self.memory, memory_mask=self.memory_mask, cache=self.cache)
        return logits[:, -1]

    def reorder(self, index: Tensor) -> None:
        self.memory = self.memory.index_select(0, index)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)
        if self.prefix is not None:
            self.prefix = self.prefix.index_select(0, index)
        self.batch_size = index.numel()


def _strip(tokens: list[int], eos_id: int) -> list[int]:
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def _limits(max_new_tokens: int | Sequence[int], n: int) -> torch.Tensor:
    """One token budget per row, so a row's output never depends on which rows share its batch."""
    if isinstance(max_new_tokens, int):
        return torch.full((n,), max_new_tokens)
    if len(max_new_tokens) != n:
        raise ValueError(f"{len(max_new_tokens)} token budgets for {n} rows")
    return torch.as_tensor(list(max_new_tokens))


@torch.no_grad()
def greedy(
    decoder: IncrementalDecoder, *, bos_id: int, eos_id: int, max_new_tokens: int | Sequence[int]
) -> list[list[int]]:
    """The most probable token at every step, until ``</s>`` or the row's ``max_new_tokens``.

    Rows that have finished are dropped from the batch, so a long sentence does not make the short ones
    in its batch keep paying for decoding.

    Returns:
        per input row, the generated ids (without ``<s>`` and ``</s>``).
    """
    n = decoder.batch_size
    limits = _limits(max_new_tokens, n)
    outputs: list[list[int]] = [[] for _ in range(n)]
    active = torch.arange(n)  # which original rows are still decoding
    last = torch.full((n, 1), bos_id, dtype=torch.long)
    for step in range(1, int(limits.max()) + 1 if n else 0):
        next_tokens = decoder.step(last).argmax(dim=-1)  # (B_active,)
        for row, token in zip(active.tolist(), next_tokens.tolist(), strict=True):
            outputs[row].append(token)
        going = (next_tokens != eos_id) & (limits[active] > step)
        if not going.any():
            break
        if not going.all():
            keep = going.nonzero().squeeze(1)
            decoder.reorder(keep)
            active, next_tokens = active[keep], next_tokens[keep]
        last = next_tokens[:, None]
    return [_strip(o, eos_id) for o in outputs]


def length_penalty(lengths: Tensor, alpha: float) -> Tensor:
    """GNMT's lp(n) = ((5 + n) / 6)^α."""
    return ((5.0 + lengths.float()) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    decoder: IncrementalDecoder,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int | Sequence[int],
    beam_size: int = 4,
    alpha: float = 0.6,
) -> list[list[int]]:
    """Batched beam search: every input row keeps ``beam_size`` hypotheses, all decoded in one batch.

    A finished hypothesis stays in its beam with a frozen score (it can only be extended by ``</s>`` at no
    cost), so it competes with the unfinished ones by length-normalised score until something better appears.
    A hypothesis that reaches its row's ``max_new_tokens`` is frozen the same way (truncated, as greedy is).

    Returns:
        per input row, the best hypothesis (without ``<s>`` and ``</s>``).
    """
    b, k = decoder.batch_size, beam_size
    limits = _limits(max_new_tokens, b).repeat_interleave(k)  # (B*K,)
    decoder.reorder(torch.arange(b).repeat_interleave(k))  # (B*K) rows: row r belongs to input r // K
    ys = torch.full((b * k, 1), bos_id, dtype=torch.long)
    scores = torch.full((b, k), float("-inf"))
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished = torch.zeros(b * k, dtype=torch.bool)
    lengths = torch.zeros(b * k)
    row_base = (torch.arange(b) * k)[:, None]  # (B, 1)
    for _ in range(int(limits.max()) if b else 0):
        logp = F.log_softmax(decoder.step(ys[:, -1:]).float(), dim=-1)  # (B*K, V)
        vocab = logp.size(-1)
        logp[finished] = float("-inf")
        logp[finished, eos_id] = 0.0  # a finished hypothesis carries on unchanged
        candidates = scores.view(-1, 1) + logp  # (B*K, V) total log-probability
        new_lengths = lengths + (~finished).float()
        ranked = candidates / length_penalty(new_lengths, alpha)[:, None]
        _, top = ranked.view(b, k * vocab).topk(k, dim=-1)  # (B, K)
        scores = candidates.view(b, k * vocab).gather(1, top)
        rows = (row_base + top // vocab).view(-1)  # which hypothesis each survivor extends
        tokens = (top % vocab).view(-1, 1)
        decoder.reorder(rows)
        ys = torch.cat([ys[rows], tokens], dim=1)
        lengths = new_lengths[rows]
        finished = finished[rows] | (tokens.squeeze(1) == eos_id) | (lengths >= limits)
        if finished.all():
            break
    best = (scores / length_penalty(lengths, alpha).view(b, k)).argmax(dim=-1)  # (B,)
    chosen = ys.view(b, k, -1)[torch.arange(b), best, 1:]
    return [_strip(row, eos_id) for row in chosen.tolist()]
