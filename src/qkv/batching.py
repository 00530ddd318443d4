"""Continuous batching: sequences that join a running decode between two steps and leave it as soon as they end.

:func:`~qkv.generation.generate` decodes one batch from start to end. A server's requests come and go: each should
start at once, share every step with the others (one forward for eight rows costs about three of one row, on
SmolLM2-135M: docs/serving.md), and leave the moment it is done. :class:`Batch` keeps the rows decoding now, one KV
cache row each, aligned on the right as :class:`~qkv.generation.LMDecoder` aligns its left-padded prompts::

    <pad> <pad> The  cat  sat        starts at column 2
    Once  upon  a    time ,          starts at column 0

Each step feeds every row its newest token in one forward: the products of every layer for all rows at once, the
attention of each row over its own keys (:meth:`~qkv.nn.attention.MultiHeadAttention._rows_alone`), positions
counting its own tokens. A row that joins has its prompt read alone, as generate reads it, and its cache appended
(the shorter side padded on the left); a row that ends is dropped at once, and columns that no row uses any more
are trimmed off the left. So each row is decoded with the numbers it would get alone, token for token.

Every row has its own sampling settings, random generator, token limit and stop tokens, so a sampled row draws the
tokens it would draw alone with the same seed: a request's output never depends on what else is running.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .constrained import masked
from .ending import take
from .generation import LMDecoder, _suppressor
from .sampling import GREEDY, Sampling, choose
from .speculative import Speculation, accept, agreed, lay_out


@dataclass(frozen=True)
class Logprob:
    """A chosen token's log-probability under the model, and the ``top`` most probable tokens with theirs."""

    value: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Row:
    """One sequence to continue: its ``prompt`` tokens and at most ``limit`` new ones.

    ``on_token(token, logprob)`` is called with each new token but a stop token, on the thread that runs the batch;
    it returns True to end the row there (a stop string found in the text). ``logprobs``: None, or how many of the
    most probable tokens to report beside each chosen one (its :class:`Logprob` goes to ``on_token``). ``cancel()``
    ends the row before the next step, from any thread. Once it has ended, ``finish`` says why: ``"stop"`` (a stop
    token, or ``on_token`` said so), ``"length"`` (``limit`` tokens), ``"cancelled"``, or ``"error"`` (reading its
    prompt, its ``on_token`` or its constraint failed: ``error`` is the exception, and the other rows go on);
    ``tokens`` are the new tokens, a final stop token included.
    """

    prompt: Sequence[int]
    limit: int
    sampling: Sampling = GREEDY
    generator: torch.Generator | None = None
    stop_ids: Collection[int] = ()
    logprobs: int | None = None
    on_token: Callable[[int, Logprob | None], bool] | None = None
    constraint: Any = None  # a qkv.constrained.Constraint: only the tokens it allows; the row ends once it is done
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: Exception | None = None
    cancelled: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("every prompt needs at least one token")
        if self.limit < 1:
            raise ValueError(f"a row's limit must be at least one token, got {self.limit}")
        if self.sampling.repetition_penalty != 1.0:
            raise ValueError("a batch's rows take no repetition penalty (it needs each row's whole context)")

    def cancel(self) -> None:
        self.cancelled = True


class Batch:
    """The rows a decoder-only ``model`` (:class:`~qkv.models.GPT`) is continuing now. :meth:`join` adds rows and
    reads their prompts; :meth:`step` gives every row one more token; both return the rows that ended.
    ``suppress_ids``: tokens never to produce (special tokens with no text). ``speculation``: a
    :class:`~qkv.speculative.Speculation` whose drafts each step checks, several tokens a row at once (rows with a
    constraint draft nothing)."""

    def __init__(self, model, *, suppress_ids: Collection[int] = (), speculation: Speculation | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.max_len = model.config.max_seq_len
        self.rows: list[Row] = []
        self.cache = model.new_cache()
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,): each row's positions so far
        self.last = torch.zeros(0, 1, dtype=torch.long, device=self.device)  # (B, 1): each row's newest token
        self.suppress = _suppressor(suppress_ids, self.device)
        self.speculation = speculation  # drafts checked each step (qkv.speculative), or None
        # with drafts: each row's chosen tokens the cache has not read yet (its newest, and any the others refused)
        self.unread: list[list[int]] = []
        if speculation is not None:
            speculation.start([])

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def join(self, rows: Sequence[Row]) -> list[Row]:
        """Read each row's prompt (alone, as generate reads it), choose its first token and add it: one row at a
        time, so each hands on its first token as soon as its own prompt is read."""
        for row in rows:
            if len(row.prompt) + row.limit > self.max_len:
                raise ValueError(f"a prompt of {len(row.prompt):,} tokens and {row.limit:,} new ones do not fit in "
                                 f"this model's {self.max_len:,} positions")
        ended = []
        for row in rows:  # each prompt read alone, as generate reads it: the same products, the same numbers
            try:
                reader = LMDecoder(self.model, [row.prompt])
                logits = self.suppress(reader.step(reader.start))
            except Exception as err:  # this row's failure alone: it ends, and nothing of it was added
                row.finish, row.error = "error", err
                ended.append(row)
                continue
            self.cache.extend(reader.cache)
            self.lengths = torch.cat([self.lengths, self.lengths.new_tensor([len(row.prompt)])])
            self.rows = [*self.rows, row]
            if self.speculation is not None:
                self.speculation.join(row.prompt)
            ended += self._settle(logits, range(len(self.rows) - 1, len(self.rows)), self.last)
        return ended

    @torch.no_grad()
    def step(self) -> list[Row]:
        """One more token for every row (after dropping the rows cancelled since the last step)."""
        cancelled = [i for i, row in enumerate(self.rows) if row.cancelled]
        for i in cancelled:
            self.rows[i].finish = "cancelled"
        ended = [self.rows[i] for i in cancelled]
        self._keep([i for i, row in enumerate(self.rows) if not row.cancelled])
        if not self.rows:
            return ended
        if self.speculation is not None:
            return ended + self._checked_step()
        logits = self.model(self.last, positions=self.lengths[:, None], cache=self.cache, last_only=True)[:, -1]
        self.lengths += 1
        return ended + self._settle(self.suppress(logits), range(len(self.rows)), self.last[:0])

    def _checked_step(self) -> list[Row]:
        """A step with drafts: every row's unread tokens and drafts read at once, each row's accepted drafts and one
        token of the model's own handed on; the columns every remaining row accepted stay in the cache."""
        rows, unread = self.rows, self.unread
        room = [min(row.limit - len(row.tokens) - 1, self.max_len - int(n) - len(u)) if row.constraint is None else 0
                for row, u, n in zip(rows, unread, self.lengths.tolist(), strict=True)]
        drafts = self.speculation.propose([[*row.prompt, *row.tokens] for row in rows], room)
        fed, width = lay_out(unread, drafts, self.device)
        positions = self.lengths[:, None] + torch.arange(width, device=self.device)
        logits = self.suppress(self.model(fed, positions=positions, cache=self.cache))  # (B, width, V)
        chosen = []
        for i, (row, u, d) in enumerate(zip(rows, unread, drafts, strict=True)):
            at = masked(logits[i, len(u) - 1 : len(u) + len(d)], [row.constraint])
            tokens = accept(at, d, row.sampling, row.generator)
            logprobs = _logprobs(logits[i, len(u) - 1 : len(u) + len(tokens) - 1],
                                 torch.tensor(tokens, device=logits.device), [row] * len(tokens))
            chosen.append(tokens)
            for token, logprob in zip(tokens, logprobs, strict=True):
                if _take(row, token, logprob):
                    break
        self.speculation.settle(drafts, chosen)
        going = [i for i, row in enumerate(rows) if row.finish is None]
        if going:
            kept = agreed([unread[i] for i in going], [chosen[i] for i in going])
            self.cache.drop_right(width - kept)
            self.lengths += kept
            self.unread = [[*u, *c][kept:] for u, c in zip(unread, chosen, strict=True)]
            self.last = torch.tensor([c[-1:] for c in chosen], dtype=torch.long, device=self.device)
        ended = [row for row in rows if row.finish is not None]
        self._keep(going)
        return ended

    def _settle(self, logits: Tensor, which: range, earlier: Tensor) -> list[Row]:
        """Choose the next token of rows ``which`` (the last rows; ``earlier``: the newest tokens of those before),
        hand them on, and drop the rows that ended."""
        rows = [self.rows[i] for i in which]
        tokens = _chosen(masked(logits, [row.constraint for row in rows]), rows)
        self.last = torch.cat([earlier, tokens[:, None]])
        self.unread = self.unread[: which.start] + [[t] for t in tokens.tolist()]
        logprobs = _logprobs(logits, tokens, rows)  # the model's own, before any constraint
        ended = [row for row, token, logprob in zip(rows, tokens.tolist(), logprobs, strict=True)
                 if _take(row, token, logprob)]
        if ended:
            self._keep([i for i, row in enumerate(self.rows) if row.finish is None])
        return ended

    def _keep(self, index: list[int]) -> None:
        """Keep rows ``index`` only, and trim the cache's columns that none of them uses."""
        if len(index) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in index]
        self.unread = [self.unread[i] for i in index]
        if self.speculation is not None:
            self.speculation.keep(index)
        if not self.rows:  # an empty batch starts afresh
            self.cache, self.lengths, self.last = self.model.new_cache(), self.lengths[:0], self.last[:0]
            return
        keep = torch.tensor(index, dtype=torch.long, device=self.device)
        self.cache.reorder(keep)
        self.lengths, self.last = self.lengths.index_select(0, keep), self.last.index_select(0, keep)
        self.cache.drop_left(len(self.cache) - int(self.lengths.max()))


def _take(row: Row, token: int, logprob: Logprob | None) -> bool:
    """``token`` onto ``row`` by :func:`qkv.ending.take` (to its ``on_token`` with ``logprob``); whether it ended (a
    failure of its ``on_token`` or its constraint ends it alone, ``"error"``)."""
    handed = None if row.on_token is None else lambda t: row.on_token(t, logprob)
    try:
        row.finish = take(row.tokens, token, stop_ids=row.stop_ids, limit=row.limit, constraint=row.constraint,
                          on_token=handed)
    except Exception as err:
        row.finish, row.error = "error", err
    return row.finish is not None


def _chosen(logits: Tensor, rows: Sequence[Row]) -> Tensor:
    """Each row's next token ``(B,)``: the greedy rows' together, every sampled row by its own settings and generator,
    as :func:`~qkv.generation.generate` chooses a row decoded alone."""
    tokens = logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        if not row.sampling.greedy:
            tokens[i] = choose(logits[i : i + 1], row.sampling, generator=row.generator)[0]
    return tokens


def _logprobs(logits: Tensor, tokens: Tensor, rows: Sequence[Row]) -> list[Logprob | None]:
    """For the rows that asked, the chosen token's log-probability and the most probable tokens'."""
    if all(row.logprobs is None for row in rows):
        return [None] * len(rows)
    logp = logits.float().log_softmax(dim=-1)
    out: list[Logprob | None] = []
    for i, row in enumerate(rows):
        if row.logprobs is None:
            out.append(None)
            continue
        top = logp[i].topk(row.logprobs) if row.logprobs else None
        pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out.append(Logprob(float(logp[i, tokens[i]]), pairs))
    return out
