"""What the server runs: a language model continuing every request's prompt together, by continuous batching.

A request's continuation (each of its ``n`` choices) is a :class:`~qkv.batching.Row`: it joins the running
:class:`~qkv.batching.Batch` between two steps, at most ``rows`` of them decode together, the rest wait in the
order they came, and a row leaves the moment it ends, freeing its place and its cache. One thread runs the batch;
the server hands it rows and hears back through callbacks. A row is decoded as it would be alone (greedy: the
tokens ``qkv generate`` gives; sampled: those of the same seed alone), whatever else is running. The engine adds
what an API needs around the tokens:

* the text as it grows (:class:`~qkv.detokenize.TextStream`, as ``qkv generate`` has it), decoded incrementally
  (each new token with the few before it, so a character split over byte-level tokens appears once whole), with
  stop strings found in the text, not in tokens: nothing after a stop string is sent, and no text that might be the
  start of one is sent before the next token shows whether it is;
* why it ended: ``stop`` (an end-of-turn token or a stop string) or ``length`` (``max_tokens``, the server's
  ``max_tokens`` where the request gives none, or the context);
* log-probabilities of the chosen tokens and the most probable others, when asked;
* a way to end it between two tokens (a client that went away), which frees its row at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..batching import Batch, Logprob, Row
from ..detokenize import TextStream
from ..footprint import check_decoding
from ..sampling import GREEDY, Sampling
from ..speculative import Speculation
from ..tokenizers import encode_prompt
from .protocol import REPLY_TOKENS, ROWS, APIError, Settings
from .tools import Tools, conversation, format_of

log = logging.getLogger("qkv")
GRAMMARS = 64  # compiled schemas kept (a request's is checked when it comes, then used by each of its choices)


@dataclass(frozen=True)
class Entry:
    """A chosen token's log-probability, as text: the token's ``text``, its ``logprob``, and the most probable
    tokens of that step (``top``: text and log-probability); None for a prompt's first token, which nothing
    predicts."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass
class Continuation:
    """One finished continuation: its text, why it ended, how many tokens it took, and (asked for) the
    log-probabilities of its tokens."""

    text: str
    finish_reason: str  # "stop" or "length"
    tokens: int
    entries: list[Entry] | None = None


OnText = Callable[[str, list[Entry]], None]  # a piece of text, and the log-probabilities of the tokens it adds
OnEnd = Callable[[Continuation | Exception], None]


@dataclass(eq=False)
class _Job:
    row: Row
    text: _Text
    on_end: OnEnd


class Engine:
    """A language model served: ``model``, its ``tokenizer``, the token ids that end a reply (``stop_ids``), its chat
    template (None: completions only), the ``name`` clients call it by, how many sequences decode together
    (``rows``), the tokens a reply may take when its request does not say (``max_tokens``: a small model left to
    run fills its whole context) and the autocast context decoding runs in (``--precision``'s; entered on the
    engine's thread)."""

    def __init__(self, model, tokenizer, *, name: str, stop_ids: set[int], chat_template: str | None,
                 rows: int = ROWS, max_tokens: int = REPLY_TOKENS,
                 autocast: contextlib.AbstractContextManager | None = None,
                 speculation: Speculation | None = None) -> None:
        if rows < 1:
            raise ValueError(f"rows must be at least 1, got {rows}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.stop_ids, self.chat_template, self.rows = frozenset(stop_ids), chat_template, rows
        self.context = model.config.max_seq_len
        self.autocast = autocast or contextlib.nullcontext()  # --precision's, as qkv generate decodes under it
        # qkv's own tokenizers reserve ids for padding, sentence markers and <unk>: never text, never sampled
        self.suppress = frozenset(getattr(tokenizer, "special_ids", ())) - self.stop_ids
        self.speculation = speculation  # drafts each step checks (--draft), or None
        self.batch = Batch(model, suppress_ids=self.suppress, speculation=speculation)  # the rows decoding now (run
        # by the engine's thread)
        self._waiting: deque[_Job] = deque()
        self._running: dict[Row, _Job] = {}
        self._wake = threading.Condition()
        self._model = threading.Lock()  # the batch's steps, and a prompt scored (echo) between them
        self._table = None  # the token table constrained replies are masked with (made at the first)
        self._grammars: dict[str, str] = {}  # the latest schemas' compiled grammars
        self._thread: threading.Thread | None = None
        self._closed = False

    def chat_prompt(self, messages: list[dict[str, Any]], tools: Tools | None = None) -> str:
        """The conversation laid out by the model's own chat template, ready for the assistant's turn; the
        ``tools`` and the calls and answers in it as the template lays them out, or in the default format
        (:func:`~qkv.serve.tools.conversation`)."""
        from ..chat import render_chat, template_tokens

        if self.chat_template is None or not self.stop_ids:
            raise APIError(400, f"{self.name} has no chat template; use /v1/completions", param="messages")
        messages, offered = conversation(messages, tools, self.tool_format[1])
        try:
            return render_chat(self.chat_template, messages, tools=offered, **template_tokens(self.tokenizer))
        except ValueError as err:  # the template refused the conversation, or it was too large to lay out
            raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None

    def scored(self, ids: list[int], top: int) -> list[Entry]:
        """Each token of the prompt ``ids`` with its log-probability after those before it and the ``top`` most
        probable tokens there (the first token's None): one pass of the model, taken between two of the batch's
        steps."""
        with self._model, self.autocast, torch.inference_mode():
            logits = self.model(torch.tensor([ids], device=self.batch.device))[0, :-1]
        logp = logits.float().log_softmax(dim=-1)
        chosen = logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist()
        best = logp.topk(top, dim=-1) if top else None
        decode = self.tokenizer.decode
        entries = [Entry(decode(ids[:1]), None, None)]
        for i, token in enumerate(ids[1:]):
            pairs = [] if best is None else list(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True))
            entries.append(Entry(decode([token]), chosen[i], [(decode([t]), v) for t, v in pairs]))
        return entries

    @property
    def tool_format(self) -> tuple[str, bool]:
        """The format the model writes tool calls in, and whether its template lays tools out itself."""
        return format_of(self.chat_template)

    def constraint(self, grammar: tuple[str, Any], param: str = "response_format"):
        """A :class:`~qkv.constrained.Constraint` of ``(kind, source)`` for one row (400 naming what the library
        refuses, as a fault of the request's field ``param``); the model's token table is made once."""
        from .. import constrained

        if not self.stop_ids:
            raise APIError(400, f"{self.name} has no end-of-text token to end a constrained reply", param=param)
        key = json.dumps(grammar, sort_keys=True)  # a request's schema, checked before it runs, compiled once
        try:
            if self._table is None:
                self._table = constrained.token_table(self.tokenizer, self.model.config.vocab_size,
                                                      constrained.end_token(self.tokenizer, self.stop_ids))
            if key not in self._grammars:
                if len(self._grammars) >= GRAMMARS:
                    self._grammars.clear()
                self._grammars[key] = constrained.grammar(*grammar)
            return constrained.Constraint(self._table, self._grammars[key])
        except ValueError as err:
            raise APIError(400, f"{param}: {err}", param=param) from None

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's tokens (a text's, or the ids as given), refused (400) when it leaves no room in the context
        for a reply."""
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt has no tokens; give some text", param="prompt")
        if len(ids) >= self.context:
            raise APIError(400, f"the prompt is {len(ids):,} tokens; {self.name} reads at most {self.context:,}, "
                                "a reply included", param="prompt", code="context_length_exceeded")
        return ids

    def room(self, ids: list[int], settings: Settings) -> int:
        """How many tokens the reply may take: ``max_tokens`` (the server's where the request gives none), at most
        what the context leaves (400 for a ``max_tokens`` beyond the whole context)."""
        if settings.max_tokens is not None and settings.max_tokens > self.context:
            raise APIError(400, f"max_tokens is {settings.max_tokens:,}; {self.name} reads at most {self.context:,} "
                                "tokens, the prompt included", param="max_tokens")
        asked = self.max_tokens if settings.max_tokens is None else settings.max_tokens
        return min(asked, self.context - len(ids))

    def start(self, ids: list[int], settings: Settings, *, seed: int | None, on_end: OnEnd,
              on_text: OnText | None = None) -> Row:
        """Queue a continuation of the prompt ``ids``: ``on_text`` gets each piece of its text once it is final,
        ``on_end`` the whole :class:`Continuation` (or the exception that ended it). Both are called on the engine's
        thread. The row returned can be cancelled (``row.cancel()``) from any thread."""
        sampling = GREEDY if settings.greedy else Sampling(temperature=settings.temperature,
                                                           top_p=None if settings.top_p == 1 else settings.top_p)
        generator = torch.Generator(next(self.model.parameters()).device)
        if seed is None:
            generator.seed()  # a fresh random seed: unseeded requests must not all draw alike
        else:
            generator.manual_seed(seed)
        limit = self.room(ids, settings)
        try:  # its cache must fit, as qkv generate checks it
            check_decoding(self.model.config, sequences=1, beams=1, length=len(ids) + limit, device=self.batch.device)
        except ValueError as err:
            raise APIError(400, f"{err}; ask for fewer max_tokens", param="max_tokens") from None
        text = _Text(self.tokenizer, settings.stop, on_text)
        row = Row(ids, limit, sampling, generator, self.stop_ids, settings.logprobs,
                  on_token=lambda token, logprob: text.add(token, self._entry(token, logprob)),
                  constraint=None if settings.grammar is None else self.constraint(settings.grammar,
                                                                                   settings.constrains))
        with self._wake:
            if self._closed:
                raise APIError(503, "the server is shutting down", kind="server_error")
            self._waiting.append(_Job(row, text, on_end))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="qkv-batch", daemon=True)
                self._thread.start()
            self._wake.notify()
        return row

    @property
    def busy(self) -> int:
        """Continuations running or waiting to."""
        with self._wake:
            return len(self._waiting) + len(self._running)

    def claim(self) -> None:
        """Make this thread the one that will decode (:meth:`run` follows): a request that comes before then waits
        for it, rather than starting a thread of the engine's own."""
        with self._wake:
            if self._thread not in (None, threading.current_thread()):
                raise RuntimeError("the engine is running on another thread already")
            self._thread = threading.current_thread()

    def run(self) -> None:
        """Decode on this thread (rather than one of the engine's own) until :meth:`close`: ``qkv serve`` gives the
        model its main thread (where its steps measured up to 15% faster than on a thread of its own) and answers
        HTTP on another."""
        with self._wake:
            if self._thread not in (None, threading.current_thread()):
                raise RuntimeError("the engine is running on another thread already")
            self._thread = threading.current_thread()
        self._serve()

    def close(self) -> None:
        """End every continuation; the engine's thread ends once they have (waited for, unless it is this one)."""
        with self._wake:
            self._closed = True
            for job in [*self._waiting, *self._running.values()]:
                job.row.cancel()
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.speculation is not None:  # what --draft did over the server's life, as qkv generate's closing line
            log.info("qkv serve: %s", self.speculation.summary())

    def _entry(self, token: int, logprob: Logprob | None) -> Entry | None:
        if logprob is None:
            return None
        return Entry(self.tokenizer.decode([token]), logprob.value,
                     [(self.tokenizer.decode([t]), value) for t, value in logprob.top])

    def _serve(self) -> None:
        """The engine's thread: admit waiting rows between steps, step the batch, report the rows that end."""
        batch = self.batch
        while True:
            with self._wake:
                while not self._waiting and not batch.rows and not self._closed:
                    self._wake.wait()
                if self._closed and not batch.rows and not self._waiting:
                    return
                joining = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.rows - len(batch)))]
                self._running.update((job.row, job) for job in joining)
            gone = [job.row for job in joining if job.row.cancelled]  # cancelled while they waited
            for row in gone:
                row.finish = "cancelled"
            lost = None
            try:
                with self._model, self.autocast, torch.inference_mode():
                    ended = gone + batch.join([job.row for job in joining if not job.row.cancelled])
                    ended += batch.step() if batch.rows else []
            except Exception as err:  # the batch is lost: every row in it ends with the error, the engine goes on
                log.error("qkv serve: decoding failed: %s: %s", type(err).__name__, str(err)[:300])
                lost, ended = err, [*self._running]
                batch = self.batch = Batch(self.model, suppress_ids=self.suppress, speculation=self.speculation)
                for row in ended:
                    row.finish, row.error = "error", err
            for row in ended:
                with self._wake:
                    job = self._running.pop(row)
                if row.finish != "error":
                    self._end(job)
                    continue
                if row.error is not lost:  # the row's own failure: the others went on
                    log.error("qkv serve: a continuation failed: %s: %s", type(row.error).__name__,
                              str(row.error)[:300])
                job.on_end(row.error)

    @staticmethod
    def _end(job: _Job) -> None:
        """Hand a finished row's continuation on; a failure there ends that request alone (500), not the engine."""
        try:
            job.on_end(job.text.finish(job.row))
        except Exception as err:
            log.error("qkv serve: ending a continuation failed: %s: %s", type(err).__name__, str(err)[:300])
            job.on_end(err)


class _Text:
    """A continuation's text (:class:`~qkv.detokenize.TextStream`: decoded incrementally, the stop strings applied);
    ``on_text`` gets each piece once it is final, with the log-probability entries of the tokens that came with it."""

    def __init__(self, tokenizer, stops: tuple[str, ...], on_text: OnText | None) -> None:
        self.stream, self.on_text = TextStream(tokenizer, stops), on_text
        self.sent = 0
        self.entries: list[Entry] = []
        self.entries_sent = 0

    def add(self, token: int, entry: Entry | None) -> bool:
        """Take one more token; True once a stop string has been reached."""
        if entry is not None:
            self.entries.append(entry)
        stopped = self.stream.add(token)
        self._send(self.stream.final)
        return stopped

    def _send(self, upto: int, *, last: bool = False) -> None:
        if upto > self.sent or (last and self.entries_sent < len(self.entries)):
            if self.on_text is not None:
                self.on_text(self.stream.text[self.sent : upto], self.entries[self.entries_sent :])
            self.sent, self.entries_sent = upto, len(self.entries)

    def finish(self, row: Row) -> Continuation:
        """The whole continuation of ``row``, ended; whatever was held back is sent."""
        text = self.stream.finish()
        self._send(len(text), last=True)
        reason = "length" if row.finish == "length" else "stop"
        return Continuation(text, reason, len(row.tokens), None if row.logprobs is None else self.entries)
