"""What the server runs: a language model continuing one prompt at a time, as ``qkv generate`` does.

Each continuation goes through :func:`qkv.tasks.language_model.complete`, the function ``qkv generate`` and
``qkv chat`` call, so a greedy answer is theirs token for token. The engine adds what an API needs around it:

* the text as it grows, decoded from all the tokens so far (a character split over byte-level tokens appears once
  whole), with stop strings found in the text, not in tokens: nothing after a stop string is sent, and no text
  that might be the start of one is sent before the next token shows whether it is;
* why it ended: ``stop`` (an end-of-turn token or a stop string) or ``length`` (``max_tokens``, or the context);
* a way to stop it between two tokens (a client that went away), which frees the model at once.

One continuation runs at a time (a lock); requests wait for the model in the order they came.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..generation import GREEDY, Sampling
from ..tasks.language_model import complete
from ..tokenizers import encode_prompt
from .protocol import APIError, Settings


@dataclass
class Continuation:
    """One finished continuation: its text, why it ended and how many tokens it took."""

    text: str
    finish_reason: str  # "stop" or "length"
    tokens: int


class _Halt(Exception):
    """Raised between two tokens to end a continuation early (a stop string, or the client went away)."""


class Engine:
    """A language model served: ``model``, its ``tokenizer``, the token ids that end a reply (``stop_ids``), its chat
    template (None: completions only) and the ``name`` clients call it by."""

    def __init__(self, model, tokenizer, *, name: str, stop_ids: set[int], chat_template: str | None) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.stop_ids, self.chat_template = set(stop_ids), chat_template
        self.context = model.config.max_seq_len
        self.lock = threading.Lock()

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The conversation laid out by the model's own chat template, ready for the assistant's turn."""
        from ..interop.chat import render_chat, template_tokens

        if self.chat_template is None or not self.stop_ids:
            raise APIError(400, f"{self.name} has no chat template; use /v1/completions", param="messages")
        try:
            return render_chat(self.chat_template, messages, **template_tokens(self.tokenizer))
        except ValueError as err:  # the template refused the conversation, or it was too large to lay out
            raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt's tokens, refused (400) when it leaves no room in the context for a reply."""
        ids = encode_prompt(self.tokenizer, text)
        if not ids:
            raise APIError(400, "the prompt has no tokens; give some text", param="prompt")
        if len(ids) >= self.context:
            raise APIError(400, f"the prompt is {len(ids):,} tokens; {self.name} reads at most {self.context:,}, "
                                "a reply included", param="prompt", code="context_length_exceeded")
        return ids

    def room(self, ids: list[int], settings: Settings) -> int:
        """How many tokens the reply may take: ``max_tokens``, or what the context leaves (400 for a ``max_tokens``
        beyond the whole context)."""
        if settings.max_tokens is not None and settings.max_tokens > self.context:
            raise APIError(400, f"max_tokens is {settings.max_tokens:,}; {self.name} reads at most {self.context:,} "
                                "tokens, the prompt included", param="max_tokens")
        left = self.context - len(ids)
        return left if settings.max_tokens is None else min(settings.max_tokens, left)

    def continue_prompt(self, prompt: str, ids: list[int], settings: Settings, *, seed: int | None,
                        on_text: Callable[[str], None] | None = None,
                        cancelled: threading.Event | None = None) -> Continuation:
        """Continue ``prompt`` (whose tokens are ``ids``), handing each new piece of text to ``on_text`` as it is
        final; stops between two tokens once ``cancelled`` is set."""
        limit = self.room(ids, settings)
        sampling = GREEDY if settings.greedy else Sampling(temperature=settings.temperature,
                                                           top_p=None if settings.top_p == 1 else settings.top_p)
        text = _Text(self.tokenizer, settings.stop, on_text)
        tokens: list[int] = []

        def on_token(row: int, token: int) -> None:  # every token but a stop token
            tokens.append(token)
            if text.add(token):  # a stop string
                raise _Halt
            if cancelled is not None and cancelled.is_set():
                raise _Halt

        halted = False
        with self.lock, torch.inference_mode():
            try:
                complete(self.model, self.tokenizer, [prompt], max_new_tokens=limit, sampling=sampling,
                         stop_ids=self.stop_ids, seed=seed, on_token=on_token)
            except _Halt:
                halted = True
            except ValueError as err:  # what decoding refuses (a cache beyond the memory there is)
                raise APIError(400, str(err)) from None
        ended = not halted and len(tokens) < limit  # the model wrote a stop token (which on_token is not given)
        return Continuation(text.finish(), "stop" if text.stopped or ended else "length", len(tokens) + ended)


class _Text:
    """A continuation's text, decoded from all its tokens so far, with the stop strings applied; ``on_text`` gets
    each piece once it is final."""

    def __init__(self, tokenizer, stops: tuple[str, ...], on_text: Callable[[str], None] | None) -> None:
        self.tokenizer, self.stops, self.on_text = tokenizer, stops, on_text
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def add(self, token: int) -> bool:
        """Take one more token; True once a stop string has been reached."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character split over tokens: wait for the rest
            return False
        self.text = text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
        self._send(len(self.text) if self.stopped else len(self.text) - self._held())
        return self.stopped

    def _held(self) -> int:
        """How many characters at the end might begin a stop string: kept back until the next token."""
        return max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            if self.on_text is not None:
                self.on_text(self.text[self.sent : upto])
            self.sent = upto

    def finish(self) -> str:
        """The whole text; whatever was held back is sent."""
        self._send(len(self.text))
        return self.text
