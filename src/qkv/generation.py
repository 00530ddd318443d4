"""Decoding: turning next-token distributions into sequences, one token at a time.

Every model is seen the same way, as an :class:`IncrementalDecoder`: give it the newest tokens, get the
logits of the next one; it keeps whatever it needs between steps (the encoder output, the KV cache) and can
reorder its batch rows (beam search keeps the best hypotheses). The search strategies below know nothing
else about the model, so the translator and the language model share them. An encoder-decoder model makes
its own adapter (``model.start_decoding(src)``); :class:`LMDecoder` is the decoder-only one.

* greedy: take the most probable token every step.
* sampling: draw from the filtered distribution (:class:`qkv.sampling.Sampling`: temperature, top-k, top-p, a
  repetition penalty; temperature 0 is greedy).
* speculative decoding (:mod:`qkv.speculative`): greedy decoding or sampling with several drafted tokens checked in
  one step, the same text (greedy) or the same distribution (sampling), sooner.
* beam search: keep the ``k`` best partial sequences by total log-probability; finished hypotheses are
  compared by score / lp(length) with lp(n) = ((5 + n) / 6)^α (Wu et al. 2016), so α > 0 counters the bias
  towards short outputs. With ``k = 1`` it is exactly greedy.

Each search starts by feeding ``start``: ``<s>`` for a translation, the (left-padded) prompts for a language
model; after that, only the newest token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .constrained import masked
from .ending import take
from .sampling import GREEDY, Sampling, choose
from .speculative import accept, agreed, lay_out


class IncrementalDecoder(Protocol):
    """A model seen one step at a time, with whatever it keeps between steps.

    Every encoder-decoder model gives one for a source batch with ``model.start_decoding(src, use_cache=True)``
    (:class:`~qkv.models.transformer.TransformerDecoding`, :class:`~qkv.models.rnn.LSTMDecoding`); a
    decoder-only model continuing prompts is wrapped in :class:`LMDecoder`.
    """

    batch_size: int
    device: torch.device  # where its tensors live; the search makes its own there

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(B, t)``: the newest tokens -> logits ``(B, vocab)`` of the next one."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Keep (and duplicate) batch rows ``index``."""
        ...


class LMDecoder:
    """A decoder-only model (:class:`~qkv.models.GPT`) continuing a batch of prompts of different lengths.

    The prompts are *left*-padded, so every row's next token sits in the same last column::

        <pad> <pad> The  cat        mask 0 0 1 1
        Once  upon  a    time       mask 1 1 1 1

    The attention mask hides the padding, and positions count real tokens only, so a row is continued exactly
    as it would be alone. ``start`` is the padded prompt batch: feed it as the first step.

    A model with absolute positions cannot see beyond ``max_len`` tokens. When the sequence would grow past
    it, the decoder keeps only the last ``max_len // 2`` tokens and goes on from those (re-reading them once:
    the cache is rebuilt). The rule depends only on the length, so cached and uncached decoding still agree.
    """

    def __init__(self, model, prompts: Sequence[Sequence[int]], *, use_cache: bool = True, pad_id: int = 0,
                 max_len: int | None = None) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.model = model
        self.max_len = max_len or model.config.max_seq_len
        longest = max(len(p) for p in prompts)
        if longest > self.max_len:
            raise ValueError(f"a prompt has {longest} tokens; this model reads at most {self.max_len}")
        start = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            start[row, longest - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, longest - len(prompt) :] = True
        self.device = next(model.parameters()).device
        self.start, self.mask = start.to(self.device), mask.to(self.device)
        self.padded = any(len(p) < longest for p in prompts)  # else no mask is needed: the fused causal path
        self.use_cache = use_cache
        self.capacity = min(self.max_len, longest + 128)  # room the KV cache starts with; it grows if needed
        self.cache = model.new_cache(self.capacity) if use_cache else None
        self.tokens = self.start[:, :0]  # everything read so far, (B, T); the mask covers it
        self.batch_size = len(prompts)

    def step(self, tokens: Tensor) -> Tensor:
        return self.read(tokens, every=False)[:, -1]

    def read(self, tokens: Tensor, *, every: bool = True) -> Tensor:
        """tokens ``(B, t)`` -> the logits after each of them ``(B, t, vocab)`` (``every``; else after the last
        only, ``(B, 1, vocab)``): speculative decoding checks t - 1 drafted tokens in one step."""
        if self.tokens.size(1):  # the first step's tokens are `start`, whose mask is already known
            self.mask = torch.cat([self.mask, self.mask.new_ones(tokens.shape)], dim=1)
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        t = tokens.size(1)
        if self.tokens.size(1) > self.max_len:  # out of positions: go on from the last half
            keep = self.max_len // 2
            self.tokens, self.mask = self.tokens[:, -keep:], self.mask[:, -keep:]
            if self.cache is not None:
                self.cache = self.model.new_cache(self.capacity)
            tokens = self.tokens
        if self.cache is None or len(self.cache) == 0:
            tokens = self.tokens  # no cache, or a fresh one: read everything
        # Without padding the cached steps need no mask: the causal one is implied (the fused kernel's path).
        mask = self.mask if self.padded or self.cache is None else None
        if not every:
            return self.model(tokens, attention_mask=mask, cache=self.cache, last_only=True)
        return self.model(tokens, attention_mask=mask, cache=self.cache)[:, -min(t, tokens.size(1)) :]

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` tokens read (drafts that were not accepted), as if they had never been fed."""
        if n:
            self.tokens, self.mask = self.tokens[:, :-n], self.mask[:, :-n]
            if self.cache is not None:
                self.cache.drop_right(n)

    def reorder(self, index: Tensor) -> None:
        self.tokens, self.mask = self.tokens.index_select(0, index), self.mask.index_select(0, index)
        self.padded = self.padded and not bool(self.mask.all())
        if self.cache is not None:
            self.cache.reorder(index)
        self.batch_size = index.numel()


def _strip(tokens: list[int], stop_ids: Collection[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i]
    return tokens


def _limits(max_new_tokens: int | Sequence[int], n: int, device: torch.device) -> torch.Tensor:
    """One token budget per row, so a row's output never depends on which rows share its batch."""
    if isinstance(max_new_tokens, int):
        return torch.full((n,), max_new_tokens, device=device)
    if len(max_new_tokens) != n:
        raise ValueError(f"{len(max_new_tokens)} token budgets for {n} rows")
    return torch.as_tensor(list(max_new_tokens), device=device)


def _start(decoder: IncrementalDecoder, start: Tensor | None, bos_id: int | None) -> Tensor:
    if start is not None:
        return start
    if bos_id is None:
        raise ValueError("give the first tokens: start=... or bos_id=...")
    return torch.full((decoder.batch_size, 1), bos_id, dtype=torch.long, device=decoder.device)


def _stop_set(eos_id: int | None, stop_ids: Collection[int] | None) -> set[int]:
    return set(stop_ids or ()) | ({eos_id} if eos_id is not None else set())


def _suppressor(ids: Collection[int] | None, device: torch.device) -> Callable[[Tensor], Tensor]:
    """A function making ``ids`` impossible in a step's logits: tokens that are never text (padding, a start
    marker, <unk>). The index is made once, not at every step."""
    if not ids:
        return lambda logits: logits
    index = torch.tensor(sorted(ids), dtype=torch.long, device=device)
    return lambda logits: logits.index_fill(-1, index, float("-inf"))


@torch.no_grad()
def generate(
    decoder: IncrementalDecoder,
    *,
    max_new_tokens: int | Sequence[int],
    start: Tensor | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    stop_ids: Collection[int] | None = None,
    sampling: Sampling = GREEDY,
    context: Sequence[Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int, int], None] | None = None,
    suppress_ids: Collection[int] | None = None,
    constraints: Sequence[Any] | None = None,
    speculation: Any = None,
) -> list[list[int]]:
    """Greedy decoding or sampling, until a stop token or the row's ``max_new_tokens``.

    Rows that have finished are dropped from the batch, so a long output does not make the short ones in its
    batch keep paying for decoding.

    Args:
        start: the first tokens ``(B, t)``, fed in one step (default: a column of ``bos_id``).
        eos_id, stop_ids: tokens that end a row (not included in the output).
        sampling: how to choose each token; the default is greedy.
        context: per row, the tokens before the output: what the repetition penalty counts as already seen and what
            speculation drafts from (default: the ``start`` rows; pass the unpadded prompts when ``start`` is padded).
        generator: the random source of sampling, for reproducible draws.
        on_token: called as ``on_token(row, token)`` for every produced token that is not a stop token, as it
            is produced: for streaming; True from it ends the row there (a stop string found in its text).
        suppress_ids: tokens never to produce (special tokens that have no text, such as padding or ``<unk>``).
        constraints: per input row, a :class:`qkv.constrained.Constraint` (or None): only the tokens it allows are
            chosen, and the row ends once its text is complete.
        speculation: a :class:`qkv.speculative.Speculation` (a decoder with ``read`` and ``rewind``, such as
            :class:`LMDecoder`): each step checks the drafted tokens of every row in one forward; greedy output is
            unchanged, sampled output distributed as without it. Rows with a constraint, and every row under a
            repetition penalty, draft nothing.

    Returns:
        per input row, the generated ids (without the start and the stop token).
    """
    n, device = decoder.batch_size, decoder.device
    limits = _limits(max_new_tokens, n, device).tolist()
    if not n or max(limits) < 1:
        return [[] for _ in range(n)]
    stops = _stop_set(eos_id, stop_ids)
    last = _start(decoder, start, bos_id)
    context = context if context is not None else last.tolist()
    outputs: list[list[int]] = [[] for _ in range(n)]
    active = torch.arange(n, device=device)  # which original rows are still decoding
    seen: Tensor | None = None  # (B_active, V), only with a repetition penalty
    suppress = _suppressor(suppress_ids, device)
    drafting = speculation is not None and sampling.repetition_penalty == 1.0
    if drafting:
        speculation.start(context)
    unread: list[list[int]] | None = None  # with drafts, after the first step: each row's tokens not yet read
    while True:
        rows = active.tolist()
        conditions = [None] * len(rows) if constraints is None else [constraints[row] for row in rows]
        if unread is None:
            logits = masked(suppress(decoder.step(last)), conditions)  # (B_active, V)
            if sampling.repetition_penalty != 1.0 and seen is None:
                seen = _seen(logits, context)
            tokens = choose(logits, sampling, seen=seen, generator=generator)  # (B_active,)
            if seen is not None:
                seen[torch.arange(len(tokens), device=device), tokens] = True
            chosen, width, unread_now = [[t] for t in tokens.tolist()], 0, [[] for _ in rows]
        else:
            texts = [[*context[row], *outputs[row]] for row in rows]
            space = decoder.max_len - decoder.tokens.size(1)  # positions before the decoder would start over
            room = [min(limits[row] - len(outputs[row]) - 1, space - len(u)) if c is None else 0
                    for row, u, c in zip(rows, unread, conditions, strict=True)]
            drafts = speculation.propose(texts, room)
            fed, width = lay_out(unread, drafts, device)
            logits = suppress(decoder.read(fed))  # (B_active, width, V)
            chosen = [accept(masked(logits[i, len(u) - 1 : len(u) + len(d)], [c]), d, sampling, generator)
                      for i, (u, d, c) in enumerate(zip(unread, drafts, conditions, strict=True))]
            speculation.settle(drafts, chosen)
            unread_now = unread
        going = [_emit(outputs[row], tokens, stops, limits[row], on_token, row, c)
                 for row, tokens, c in zip(rows, chosen, conditions, strict=True)]
        if not any(going):
            break
        kept = [i for i, g in enumerate(going) if g]
        if drafting:  # the columns every remaining row accepted stay read; the rest is read again
            agreed_now = agreed([unread_now[i] for i in kept], [chosen[i] for i in kept])
            decoder.rewind(width - agreed_now)
            unread = [[*unread_now[i], *chosen[i]][agreed_now:] for i in kept]
        if len(kept) < len(rows):
            index = torch.tensor(kept, device=device)
            decoder.reorder(index)
            active = active[index]
            seen = seen[index] if seen is not None else None
            if drafting:
                speculation.keep(kept)
        last = torch.tensor([chosen[i][-1] for i in kept], device=device)[:, None]
    return [_strip(o, stops) for o in outputs]


def _emit(output: list[int], tokens: list[int], stops: Collection[int], limit: int,
          on_token: Callable[[int, int], bool | None] | None, row: int, constraint: Any) -> bool:
    """A row's new tokens onto its output, each by :func:`qkv.ending.take`, up to the one that ends the row; whether
    the row goes on."""
    handed = None if on_token is None else partial(on_token, row)
    return not any(take(output, token, stop_ids=stops, limit=limit, constraint=constraint, on_token=handed)
                   for token in tokens)


def _seen(logits: Tensor, rows: Sequence[Sequence[int]]) -> Tensor:
    """``(B, V)``: True where a row's token has been seen, for the repetition penalty."""
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for row, tokens in enumerate(rows):
        seen[row, list(tokens)] = True
    return seen


def greedy(decoder: IncrementalDecoder, *, max_new_tokens: int | Sequence[int], **kwargs) -> list[list[int]]:
    """The most probable token at every step: :func:`generate` with its default sampling."""
    return generate(decoder, max_new_tokens=max_new_tokens, **kwargs)


def length_penalty(lengths: Tensor, alpha: float) -> Tensor:
    """GNMT's lp(n) = ((5 + n) / 6)^α."""
    return ((5.0 + lengths.float()) / 6.0) ** alpha


@torch.no_grad()
def pooled_beam_search(
    decoder: IncrementalDecoder,
    *,
    max_new_tokens: int | Sequence[int],
    beam_size: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = False,
    end_at_limit: bool = False,
    start: Tensor | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    stop_ids: Collection[int] | None = None,
    suppress_ids: Collection[int] | None = None,
) -> list[list[int]]:
    """Beam search as transformers runs it (and so as Marian models were published with): ``beam_size`` live
    hypotheses always, and a pool of the ``beam_size`` best finished ones beside them.

    Each step ranks the 2k best extensions by total log-probability. One of the first k that ends (or reaches
    the length limit) goes to the pool, scored ``log p / n^length_penalty`` over its ``n`` new tokens; the k best
    that do not end live on. A row stops when its pool is full and, with ``early_stopping``, at once, without,
    once its best live hypothesis, scored at its present length, cannot beat the pool's worst. The answer is the
    pool's best. (:func:`beam_search` keeps finished hypotheses in the beam instead, with GNMT's penalty.)
    ``suppress_ids`` are removed from the log-probabilities, which are not normalised again (as transformers'
    processors do); ``end_at_limit`` makes the last token a row may add ``eos_id``, at no cost (transformers'
    ``forced_eos_token_id``, which Marian models set). Other arguments as for :func:`beam_search`.

    Returns:
        per input row, the best hypothesis (without its start and end tokens).
    """
    b, k, device = decoder.batch_size, beam_size, decoder.device
    stops = _beam_stops(beam_size, eos_id, stop_ids)
    stop_tensor = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    first = _start(decoder, start, bos_id).repeat_interleave(k, dim=0)
    limits = _limits(max_new_tokens, b, device)  # (B,)
    decoder.reorder(torch.arange(b, device=device).repeat_interleave(k))
    live = torch.zeros((b, k, 0), dtype=torch.long, device=device)
    live_scores = torch.full((b, k), -1e9, device=device)
    live_scores[:, 0] = 0.0  # all beams start identical: expand only the first
    pool = torch.zeros((b, k, 0), dtype=torch.long, device=device)
    pool_scores, pooled = torch.full((b, k), -1e9, device=device), torch.zeros((b, k), dtype=torch.bool, device=device)
    searching = torch.ones((b, 1), dtype=torch.bool, device=device)
    first_k = torch.arange(2 * k, device=device) < k
    suppress = _suppressor(suppress_ids, device)
    for step in range(int(limits.max()) if b else 0):
        logits = decoder.step(live[..., -1].reshape(-1, 1) if step else first).float()
        logp = suppress(F.log_softmax(logits, dim=-1)).view(b, k, -1)
        n = step + 1
        if end_at_limit and eos_id is not None:  # as transformers forces it: eos at no cost, nothing else
            forced = torch.full_like(logp, float("-inf")).index_fill(-1, torch.tensor([eos_id], device=device), 0.0)
            logp = torch.where((n >= limits)[:, None, None], forced, logp)
        totals = logp + live_scores[..., None]
        vocab = totals.size(-1)
        top_scores, top = totals.view(b, -1).topk(2 * k, dim=-1)  # (B, 2K)
        origin = top // vocab
        candidates = torch.cat([live.gather(1, origin[..., None].expand(-1, -1, step)), (top % vocab)[..., None]], 2)
        ends = torch.isin(top % vocab, stop_tensor) | (n >= limits)[:, None]  # (B, 2K)
        # the k best that go on
        going = top_scores - ends.float() * 1e9
        keep = going.topk(k, dim=-1).indices
        live, live_scores = candidates.gather(1, keep[..., None].expand(-1, -1, n)), going.gather(1, keep)
        decoder.reorder((origin.gather(1, keep) + torch.arange(b, device=device)[:, None] * k).view(-1))
        # the pool: the best k of what it held and what ended among the first k
        arriving = ends & first_k & searching & ~(pooled.all(-1, keepdim=True) & early_stopping)
        scores = top_scores / n ** length_penalty - (~arriving).float() * 1e9
        pool = torch.cat([F.pad(pool, (0, n - pool.size(-1)), value=min(stops)), candidates], 1)
        merged, pooled = torch.cat([pool_scores, scores], 1), torch.cat([pooled, arriving], 1)
        best = merged.topk(k, dim=-1).indices
        pool, pool_scores, pooled = pool.gather(1, best[..., None].expand(-1, -1, n)), merged.gather(1, best), \
            pooled.gather(1, best)
        worst = torch.where(pooled, pool_scores.min(-1, keepdim=True).values, -1e9)
        searching = searching & (live_scores[:, :1] / n ** length_penalty > worst).any(-1, keepdim=True)
        if not searching.any() or (early_stopping and pooled.all()) or ends.all():
            break
    return [_strip(row, stops) for row in pool[:, 0].tolist()]


def _beam_stops(beam_size: int, eos_id: int | None, stop_ids: Collection[int] | None) -> set[int]:
    """The tokens that end a hypothesis, checked with the beam's size: beam search needs at least one."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    stops = _stop_set(eos_id, stop_ids)
    if not stops:
        raise ValueError("beam search needs an end token: give eos_id or stop_ids")
    return stops


@torch.no_grad()
def beam_search(
    decoder: IncrementalDecoder,
    *,
    max_new_tokens: int | Sequence[int],
    beam_size: int = 4,
    alpha: float = 0.6,
    start: Tensor | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    stop_ids: Collection[int] | None = None,
    suppress_ids: Collection[int] | None = None,
) -> list[list[int]]:
    """Batched beam search: every input row keeps ``beam_size`` hypotheses, all decoded in one batch.

    A finished hypothesis stays in its beam with a frozen score (it can only be extended by ``</s>`` at no
    cost), so it competes with the unfinished ones by length-normalised score until something better appears.
    A hypothesis that reaches its row's ``max_new_tokens`` is frozen the same way (truncated, as greedy is).
    ``start``, ``bos_id``, ``eos_id``, ``stop_ids`` and ``suppress_ids`` as for :func:`generate`.

    Returns:
        per input row, the best hypothesis (without ``<s>`` and ``</s>``).
    """
    b, k, device = decoder.batch_size, beam_size, decoder.device
    stops = _beam_stops(beam_size, eos_id, stop_ids)
    filler = min(stops)  # what a finished hypothesis is extended with
    stop_tensor = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    first = _start(decoder, start, bos_id).repeat_interleave(k, dim=0)
    limits = _limits(max_new_tokens, b, device).repeat_interleave(k)  # (B*K,)
    decoder.reorder(torch.arange(b, device=device).repeat_interleave(k))  # (B*K) rows: row r belongs to input r // K
    ys = torch.zeros((b * k, 0), dtype=torch.long, device=device)  # generated tokens
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished = torch.zeros(b * k, dtype=torch.bool, device=device)
    lengths = torch.zeros(b * k, device=device)
    row_base = (torch.arange(b, device=device) * k)[:, None]  # (B, 1)
    suppress = _suppressor(suppress_ids, device)
    for _ in range(int(limits.max()) if b else 0):
        logits = suppress(decoder.step(ys[:, -1:] if ys.size(1) else first).float())
        logp = F.log_softmax(logits, dim=-1)  # (B*K, V)
        vocab = logp.size(-1)
        logp[finished] = float("-inf")
        logp[finished, filler] = 0.0  # a finished hypothesis carries on unchanged
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
        finished = finished[rows] | torch.isin(tokens.squeeze(1), stop_tensor) | (lengths >= limits)
        if finished.all():
            break
    best = (scores / length_penalty(lengths, alpha).view(b, k)).argmax(dim=-1)  # (B,)
    chosen = ys.view(b, k, -1)[torch.arange(b, device=device), best]
    return [_strip(row, stops) for row in chosen.tolist()]
