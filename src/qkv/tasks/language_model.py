"""Language modelling: predict every next token of a text.

The corpus is one long stream of token ids. A training batch is ``batch_size`` windows of ``context + 1``
tokens cut at random places; the model reads the first ``context`` and is scored on predicting tokens 2 to
``context + 1``, every position at once (the causal mask keeps each position from seeing its answer).
Validation cuts the held-out stream into consecutive windows and reports the mean cross-entropy per token and
its exponential, the perplexity.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import DataError, read_text
from ..device import device_of, to_device
from ..distributed import SINGLE, Group
from ..footprint import check_decoding
from ..generation import LMDecoder, generate
from ..sampling import Sampling
from ..tokenizers import Tokenizer, encode_all, encode_prompt

log = logging.getLogger(__name__)


def read_corpus(paths: Sequence[str]) -> str:
    """The files' texts, joined by a blank line (each file ends a document)."""
    texts = [read_text(p) for p in paths]
    if not any(t.strip() for t in texts):
        raise DataError(f"{', '.join(map(str, paths))}: no text to train on")
    return "\n\n".join(t.rstrip("\n") for t in texts) + "\n"


def split_text(text: str, valid_fraction: float) -> tuple[str, str]:
    """First ``1 - valid_fraction`` for training, the rest for validation (a contiguous tail, so validation
    text is never seen in training, not even as the other half of a sentence)."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {valid_fraction}")
    cut = int(len(text) * (1 - valid_fraction))
    return text[:cut], text[cut:]


def training_text(paths: Sequence[str], valid_paths: Sequence[str] | None, valid_fraction: float, *,
                  sep: str = "") -> tuple[str, str]:
    """(training, validation) text: the files of ``paths`` (:func:`read_corpus`), and for validation the files of
    ``valid_paths`` joined by ``sep``, else the last ``valid_fraction`` of the text (:func:`split_text`)."""
    if not paths:
        raise ValueError("no training text: give --text FILE [FILE ...]")
    text = read_corpus(paths)
    if valid_paths:
        return text, sep.join(read_text(p) for p in valid_paths)
    return split_text(text, valid_fraction)


def encode_text(tokenizer: Tokenizer, text: str) -> Tensor:
    """A long text as one id stream. A subword tokenizer encodes it line by line, in parallel (a byte-level BPE
    keeps the line ends, so nothing is lost)."""
    if tokenizer.kind == "char":
        ids = tokenizer.encode(text)
    else:
        ids = [i for line in encode_all(tokenizer, text.splitlines(keepends=True)) for i in line]
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class WindowBatch:
    """Where a batch's windows start; cut from the stream when the loss is computed."""

    offsets: Tensor  # (B,)
    n_tokens: int


def windows(stream: Tensor, offsets: Tensor, length: int) -> Tensor:
    """``(B, length)`` slices of ``stream`` starting at ``offsets``."""
    return stream[offsets[:, None] + torch.arange(length)]


class LanguageModelTask:
    """Next-token prediction on a token stream, validated by loss and perplexity."""

    selection_metric = "val_loss"
    higher_is_better = False
    unit = "tokens"  # what a batch's n_tokens counts

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        train: Tensor,
        valid: Tensor,
        *,
        context: int,
        batch_size: int,
        seed: int = 0,
        eval_windows: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if len(train) < context + 2:
            raise ValueError(f"the training text has {len(train)} tokens, fewer than one window of {context + 1}; "
                             "give more text or a smaller --context")
        if len(valid) < 2:
            raise ValueError("the validation text is empty; give more text or a larger --valid-fraction")
        if eval_windows is not None and eval_windows < 1:
            raise ValueError(f"eval_windows must be >= 1 (None: every window), got {eval_windows}")
        self.model, self.tokenizers = model, {"text": tokenizer}
        self.train, self.valid = train, valid
        self.context, self.batch_size, self.seed, self.eval_windows = context, batch_size, seed, eval_windows
        self.meta = {"task": "language_model", **(meta or {})}
        self._epoch: tuple[int, list[WindowBatch]] | None = None

    def batches(self, epoch: int) -> list[WindowBatch]:
        """An epoch is as many random windows as it takes to cover the training stream once on average."""
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            n = max(1, len(self.train) // (self.context * self.batch_size))
            offsets = torch.randint(0, len(self.train) - self.context, (n, self.batch_size), generator=g)
            self._epoch = (epoch, [WindowBatch(o, self.batch_size * self.context) for o in offsets])
        return self._epoch[1]

    def loss(self, model: nn.Module, batch: WindowBatch) -> tuple[Tensor, int]:
        chunk = to_device(windows(self.train, batch.offsets, self.context + 1), device_of(model))  # (B, T + 1)
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
        balance = getattr(model, "balance_loss", lambda: None)()  # a mixture of experts: spread the tokens
        if balance is not None:
            loss = loss + balance * batch.n_tokens  # a mean over the batch's tokens, as the loss becomes
        return loss, batch.n_tokens

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Mean loss over consecutive validation windows (each position predicted once), or over
        ``eval_windows`` of them spread evenly over the text; in a distributed run each rank takes a share of the
        windows and the sums are added up."""
        n = (len(self.valid) - 1) // self.context
        tail = (len(self.valid) - 1) % self.context
        starts = torch.arange(n) * self.context
        if self.eval_windows is not None and self.eval_windows < n + bool(tail):
            starts, tail = starts[torch.linspace(0, n - 1, self.eval_windows).round().long().unique()], 0
        total, tokens, balance = 0.0, 0, 0.0
        routing = getattr(model, "routing_balance", lambda: None)  # a mixture of experts: how evenly it routes
        for chunk_starts in group.shard(starts.split(max(1, self.batch_size))):
            chunk = to_device(windows(self.valid, chunk_starts, self.context + 1), device_of(model))
            logits = model(chunk[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
            tokens += chunk[:, 1:].numel()
            balance += float(routing() or 0.0) * chunk[:, 1:].numel()
        if tail and group.rank == group.world - 1:  # the last, shorter window
            chunk = to_device(self.valid[n * self.context :][None], device_of(model))
            logits = model(chunk[:, :-1])
            total += F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum").item()
            tokens += tail
            balance += float(routing() or 0.0) * tail
        sums = group.sum({"loss": total, "tokens": tokens, "balance": balance})
        loss = sums["loss"] / max(sums["tokens"], 1)
        metrics = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        if routing() is not None:  # k when the experts share the tokens evenly (see GPT.routing_balance)
            metrics["val_balance"] = sums["balance"] / max(sums["tokens"], 1)
        return metrics


@torch.no_grad()
def complete(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    beam_size: int = 1,
    stop_ids: set[int] | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token=None,
    grammar: tuple[str, Any] | None = None,
    speculation=None,
) -> list[str]:
    """Continue each prompt; returns only the continuations. Keyword arguments as for
    :func:`qkv.generation.generate` (``beam_size > 1`` runs beam search instead); ``grammar``: ``(kind, source)``
    of :func:`qkv.constrained.grammar`, each continuation kept within it (the first of ``stop_ids`` ends it once
    complete); ``speculation``: a :class:`qkv.speculative.Speculation` (not with beam search)."""
    from ..generation import beam_search
    from ..sampling import GREEDY

    model.eval()
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    if any(not i for i in ids):
        raise ValueError("a prompt is empty (or has no known tokens); give some text to continue")
    check_decoding(model.config, sequences=len(ids), beams=beam_size, device=device_of(model),
                   length=min(model.config.max_seq_len, max(map(len, ids)) + max_new_tokens))
    decoder = LMDecoder(model, ids, use_cache=use_cache)
    stops = set(stop_ids or ())
    # qkv's own tokenizers reserve ids for padding, sentence markers and <unk>: never text, never sampled
    suppress = set(getattr(tokenizer, "special_ids", ())) - stops
    constraints = None if grammar is None else _constraints(tokenizer, model, grammar, len(ids), stops)
    if beam_size > 1:
        if constraints is not None:
            raise ValueError("a grammar constrains greedy decoding and sampling, not beam search: drop --beam")
        if speculation is not None:
            raise ValueError("speculative decoding drafts for greedy decoding and sampling, not beam search: drop "
                             "--beam or --draft")
        if not stops:
            raise ValueError("beam search needs a stop token; this model has none (use sampling or greedy)")
        out = beam_search(decoder, start=decoder.start, max_new_tokens=max_new_tokens, beam_size=beam_size,
                          stop_ids=stops, suppress_ids=suppress)
    else:
        generator = torch.Generator(device_of(model)).manual_seed(seed) if seed is not None else None
        out = generate(decoder, start=decoder.start, max_new_tokens=max_new_tokens, sampling=sampling or GREEDY,
                       stop_ids=stops, context=ids, generator=generator, on_token=on_token, suppress_ids=suppress,
                       constraints=constraints, speculation=speculation)
    return [tokenizer.decode(o) for o in out]


def _constraints(tokenizer: Tokenizer, model: nn.Module, grammar: tuple[str, Any], rows: int, stops: set[int]):
    """One :class:`~qkv.constrained.Constraint` a row, the grammar compiled once against the model's table."""
    from .. import constrained

    if not stops:
        raise ValueError("a grammar needs a token that ends the text; this model has none")
    table = constrained.token_table(tokenizer, model.config.vocab_size, constrained.end_token(tokenizer, stops))
    compiled = constrained.grammar(*grammar)
    return [constrained.Constraint(table, compiled) for _ in range(rows)]
