"""Speculative decoding: guess a few tokens cheaply, check them all in one forward of the model, keep what it agrees
with (Leviathan et al. 2023; Chen et al. 2023).

A decoding step on a CPU costs about the same for one new token as for a few: the weights are read once either way.
So a cheap *drafter* proposes the next tokens ``d1..dk``; the model reads the newest token and the drafts together
and gives the distribution after each of them, ``p0..pk``. Draft ``d1`` is checked against ``p0``, ``d2`` against
``p1`` and so on; the first one refused is replaced by the model's own choice there, and if none is refused ``pk``
gives one more token. A step yields between 1 and k + 1 tokens, and the text is the model's, not the drafter's:

* greedy: a draft is accepted when it is the most probable token: the output is plain greedy decoding's.
* sampling: the drafts are proposals with all their probability on one token; draft ``d`` is accepted with
  probability ``p(d)``, and a refused one is replaced by a draw from ``p`` without ``d`` (renormalised), the
  residual ``max(0, p - q)`` of the general rule. Each token is then distributed exactly as ``p`` (a different
  stream of random numbers than plain sampling, so the same seed gives other, equally likely, text).

Two drafters:

* :class:`Lookup` (prompt lookup, Saxena 2023; transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``): the
  tokens that followed the latest earlier occurrence of the text's last few tokens. Free to compute, and right
  whenever the output copies its input: rewriting, summarising, editing code.
* :class:`DraftModel`: a smaller or more quantized model with the same tokenizer, decoding greedily from its own
  KV cache.

The rows of a batch are checked together: each row is fed the tokens it has not been fed yet and its drafts, the
shorter rows padded at the end; after the check every cache keeps the columns all rows agree on and the rows whose
accepted tokens run further feed the rest again next step (:func:`lay_out`, :func:`agreed`). How many tokens a row
drafts adapts to how many it had accepted (:class:`Speculation`, as transformers' assistant does: two more after a
step that accepted them all, one fewer otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .sampling import Sampling, next_token_logits


class Lookup:
    """Drafts from the text itself: find the latest earlier place where the text's last ``n`` tokens occur (``n``
    from ``longest`` down to ``shortest``) and propose the tokens that followed them there."""

    def __init__(self, longest: int = 3, shortest: int = 1) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths must satisfy 1 <= shortest <= longest, got {shortest}, {longest}")
        self.longest, self.shortest = longest, shortest

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Nothing to read ahead: the drafts come from the text."""

    def join(self, prompt: Sequence[int]) -> None:
        """Nothing to read ahead for a new row either."""

    def keep(self, index: Sequence[int]) -> None:
        """Nothing kept per row."""

    def propose(self, texts: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[list[int]]:
        return [self.find(list(text), size) if size else [] for text, size in zip(texts, sizes, strict=True)]

    def find(self, text: list[int], size: int) -> list[int]:
        """At most ``size`` tokens following the latest earlier occurrence of ``text``'s longest matching tail."""
        for n in range(min(self.longest, len(text) - 1), self.shortest - 1, -1):
            tail = text[-n:]
            for start in range(len(text) - n - 1, -1, -1):
                if text[start] == tail[0] and text[start : start + n] == tail:
                    return text[start + n : start + n + size]
        return []


class DraftModel:
    """Drafts from another model with the same tokenizer (a smaller one of the family, or a 4-bit copy of the model):
    its greedy continuation, read from its own KV cache.

    Its rows are kept as :class:`qkv.batching.Batch` keeps them (each prompt read alone, the caches right-aligned,
    positions per row). Before drafting it compares what each row was fed with the row's text now, drops the columns
    the model did not accept, and feeds what it has not seen: column by column, a row's own tokens first and then
    its drafts.
    """

    def __init__(self, model) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_len = model.config.max_seq_len
        self.start([])

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Forget every row, then read each prompt (one row each)."""
        self.cache = self.model.new_cache()
        self.fed: list[list[int]] = []  # per row, the tokens in the cache
        for prompt in prompts:
            self.join(prompt)

    @torch.no_grad()
    def join(self, prompt: Sequence[int]) -> None:
        """A new last row: its prompt but the last token, read alone (that token is fed with the first drafts)."""
        row = self.model.new_cache()
        if len(prompt) > 1:
            self.model(torch.tensor([list(prompt[:-1])], device=self.device), cache=row, last_only=True)
        else:  # an empty row: one column of padding, which the row's start puts out of its reach
            self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=row, last_only=True)
            for layer in row.layers:
                layer.self_attn.starts = [1]
        self.cache.extend(row)
        self.fed.append(list(prompt[:-1]))

    def keep(self, index: Sequence[int]) -> None:
        """Keep rows ``index`` only, trimming the columns none of them uses."""
        if len(index) == len(self.fed) and list(index) == list(range(len(self.fed))):
            return
        self.fed = [self.fed[i] for i in index]
        if not self.fed:
            self.start([])
            return
        self.cache.reorder(torch.tensor(list(index), dtype=torch.long, device=self.device))
        self.cache.drop_left(len(self.cache) - max(map(len, self.fed)))

    @torch.no_grad()
    def propose(self, texts: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in texts]
        if not any(sizes):
            return drafts
        unread = self._rewind(texts)
        want = [len(u) + s for u, s in zip(unread, sizes, strict=True)]  # columns until a row has its drafts
        if len(self.cache) + max(want) > self.max_len:
            return drafts
        column, width = 0, min(map(len, unread))  # the first step reads every row's common share of unread tokens
        while any(len(d) < s for d, s in zip(drafts, sizes, strict=True)):
            ids = [_columns([*u, *d], column, width) for u, d in zip(unread, drafts, strict=True)]
            logits = self._read(ids)
            column += width
            best = logits.argmax(dim=-1).tolist()
            for row, (u, d) in enumerate(zip(unread, drafts, strict=True)):
                if column >= len(u) and len(d) < sizes[row]:
                    d.append(best[row])
            width = 1
        return drafts

    def _rewind(self, texts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drop the columns that some row's text no longer agrees with; each row's tokens not yet fed."""
        wrong = 0
        for fed, text in zip(self.fed, texts, strict=True):
            same = 0
            for a, b in zip(fed, text, strict=False):
                if a != b:
                    break
                same += 1
            wrong = max(wrong, len(fed) - same, len(fed) - len(text) + 1)  # the newest token is always unread
        if wrong > min(map(len, self.fed)):  # more than a row that joined since holds: read every row afresh
            self.start(texts)
        elif wrong:
            self.cache.drop_right(wrong)
            self.fed = [fed[: len(fed) - wrong] for fed in self.fed]
        return [list(text[len(fed) :]) for fed, text in zip(self.fed, texts, strict=True)]

    def _read(self, ids: list[list[int]]) -> Tensor:
        """Feed one token (or a few) to every row; the logits after each row's last ``(B, vocab)``."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor([len(f) for f in self.fed], device=self.device)[:, None]
        positions = positions + torch.arange(tokens.size(1), device=self.device)
        for fed, row in zip(self.fed, ids, strict=True):
            fed.extend(row)
        return self.model(tokens, positions=positions, cache=self.cache, last_only=True)[:, -1]


def _columns(tokens: list[int], start: int, width: int) -> list[int]:
    """``tokens[start : start + width]``, its last token repeated past its end: a row that has its drafts is fed
    along with the others (what it was fed beyond its text is dropped at the next rewind)."""
    part = tokens[start : start + width]
    return part + tokens[-1:] * (width - len(part))


@dataclass
class Speculation:
    """A drafter for the rows of one decoding, how many tokens each row drafts next (from ``first``, adapting to what
    it had accepted, at most ``most``), and the counts for the closing line."""

    drafter: Lookup | DraftModel
    most: int = 16
    first: int = 4
    sizes: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"the most drafted tokens a step must be at least 1, got {self.most}")
        self.first = min(self.first, self.most)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.drafter.start(prompts)
        self.sizes = [self.first] * len(prompts)

    def join(self, prompt: Sequence[int]) -> None:
        self.drafter.join(prompt)
        self.sizes.append(self.first)

    def keep(self, index: Sequence[int]) -> None:
        self.drafter.keep(index)
        self.sizes = [self.sizes[i] for i in index]

    def propose(self, texts: Sequence[Sequence[int]], room: Sequence[int]) -> list[list[int]]:
        """Each row's drafts from its text so far: at most its adaptive size and its ``room`` (tokens it may still
        produce beyond the one the check always gives)."""
        sizes = [max(0, min(s, r)) for s, r in zip(self.sizes, room, strict=True)]
        return self.drafter.propose(texts, sizes)

    def settle(self, drafts: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]]) -> None:
        """Count each row's accepted drafts (``chosen`` holds them and the model's own token) and adapt its size."""
        for row, (draft, got) in enumerate(zip(drafts, chosen, strict=True)):
            if not draft:
                continue
            taken = len(got) - 1
            self.drafted += len(draft)
            self.accepted += taken
            grown = self.sizes[row] + 2 if taken == len(draft) else self.sizes[row] - 1
            self.sizes[row] = max(1, min(self.most, grown))

    def summary(self) -> str:
        if not self.drafted:
            return "no tokens drafted"
        return f"{self.accepted} of {self.drafted} drafted tokens accepted ({self.accepted / self.drafted:.0%})"


def lay_out(unread: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], device: torch.device
            ) -> tuple[Tensor, int]:
    """The tokens every row is fed in one step ``(B, width)``: the chosen tokens it has not been fed yet, then its
    drafts, then (to the batch's width) its last token repeated, whose positions no row keeps (:func:`agreed`)."""
    rows = [[*u, *d] for u, d in zip(unread, drafts, strict=True)]
    width = max(map(len, rows))
    return torch.tensor([r + r[-1:] * (width - len(r)) for r in rows], dtype=torch.long, device=device), width


def agreed(unread: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]]) -> int:
    """How many of a step's fed columns every row keeps: a row keeps its unread tokens and the drafts it accepted
    (``chosen`` but the model's own last token); the fewest of those over the rows."""
    return min(len(u) + len(c) - 1 for u, c in zip(unread, chosen, strict=True))


def accept(logits: Tensor, drafts: Sequence[int], sampling: Sampling, generator: torch.Generator | None = None
           ) -> list[int]:
    """The accepted drafts, then the model's own next token.

    ``logits`` ``(len(drafts) + 1, vocab)``: the distribution before each draft and after the last one (the raw
    logits; ``sampling`` is applied here). Greedy: drafts are kept while each is the most probable token. Sampling:
    draft ``d`` is kept with probability ``p(d)``, else replaced by a draw from ``p`` without ``d``."""
    if sampling.greedy:
        best = next_token_logits(logits, sampling).argmax(dim=-1).tolist()
        n = 0
        while n < len(drafts) and best[n] == drafts[n]:
            n += 1
        return [*drafts[:n], best[n]]
    probs = next_token_logits(logits, sampling).softmax(dim=-1)
    draws = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    for n, (draft, u) in enumerate(zip(drafts, draws, strict=True)):
        if u >= float(probs[n, draft]):
            rest = probs[n].clone()
            rest[draft] = 0.0
            return [*drafts[:n], int(torch.multinomial(rest, 1, generator=generator))]
    return [*drafts, int(torch.multinomial(probs[-1], 1, generator=generator))]


__all__ = ["DraftModel", "Lookup", "Speculation", "accept", "agreed", "lay_out"]
