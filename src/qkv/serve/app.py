"""The HTTP side of ``qkv serve``: OpenAI's API on Starlette, run by uvicorn.

    GET  /health                  {"status": "ok"}
    GET  /v1/models               the one model served
    POST /v1/completions          continue a prompt
    POST /v1/chat/completions     reply to a conversation, laid out by the model's own chat template
    POST /v1/embeddings           sentence vectors (a sentence encoder served instead of a language model)

Both POSTs answer whole, or, with ``"stream": true``, as server-sent events: one ``data: {chunk}`` per piece of
text as it is decoded, then one with the ``finish_reason`` (and, asked with ``stream_options.include_usage``, one
with the token counts), then ``data: [DONE]``. Requests are decoded together (the engine's continuous batching);
a client that goes away, mid-stream or before a whole answer, ends its continuation between two tokens and frees
its place in the batch.

Every refusal is OpenAI's error object with its status: 400 a bad field (named), 401 a wrong or missing key, 403 a
foreign Host or Origin, 404 an unknown model or path, 408 a body that does not arrive in time, 413 a body too
large, 429 too many requests running or waiting (with ``Retry-After``), 500 a failure inside (its message logged,
no traceback sent), 503 the model still loading. Requests must name this server in ``Host`` (a loopback name, or
the address it was started on), so that a web page cannot reach it through a DNS name rebound to 127.0.0.1; a page
from another origin cannot POST to it; with ``api_key`` every /v1 request must carry ``Authorization: Bearer <key>``
(compared in constant time). A request's headers must arrive within 10 s, at most 256 connections are open at once
(:mod:`qkv.serve.connections`), a body must arrive within 30 s, and a streamed client take each piece within 30 s.
Each request is logged in one line once answered (:mod:`qkv.serve.access`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..tokenizers import encode_prompt
from . import tools
from .access import AccessLog, Tally, tally
from .embedder import Embedder, texts
from .engine import Continuation, Engine, Entry
from .protocol import (
    MAX_BODY,
    APIError,
    Settings,
    check_model,
    flag,
    messages,
    parse_body,
    prompts,
    settings,
    token_ids,
)
from .tools import Call, CallReader

log = logging.getLogger("qkv")

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
BODY_SECONDS = 30.0  # a request body must arrive whole within this
MAX_WAITING = 32  # requests running or waiting for the model; one more is answered 429
POLL_SECONDS = 0.5  # how often a request answered whole checks that its client is still there
SEND_SECONDS = 30.0  # a streamed client must take each piece within this (its buffers full), or it is cut off


class Server:
    """The API around one served model, a language model (:class:`~qkv.serve.engine.Engine`) or a sentence encoder
    (:class:`~qkv.serve.embedder.Embedder`): ``hosts`` are the names the Host header may give (loopback ones and
    the address bound), ``api_key`` the bearer token /v1 requests need (None: none)."""

    def __init__(self, served: Engine | Embedder | None, *, hosts: frozenset[str] = LOOPBACK,
                 api_key: str | None = None, max_waiting: int = MAX_WAITING) -> None:
        self.served, self.hosts, self.api_key, self.max_waiting = served, hosts, api_key, max_waiting
        self.waiting = 0
        self._mailbox: _Mailbox | None = None  # made on the event loop's first continuation

    @property
    def engine(self) -> Engine:
        """The language model, or 400 for a request that needs one when a sentence encoder is served."""
        if not isinstance(self.model, Engine):
            raise APIError(400, f"{self.model.name} is a sentence encoder: it answers /v1/embeddings only")
        return self.model

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/tokenizer_info", self.tokenizer_info)]
        return Starlette(routes=routes, middleware=[Middleware(AccessLog)],
                         exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                             Exception: _internal_error})

    async def health(self, request: Request) -> Response:
        self._guard(request, key=False)
        self.model  # noqa: B018 -- 503 while loading
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self._guard(request)
        entry = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "qkv"}
        if isinstance(self.model, Engine):  # the context (vLLM's field), and a reply's tokens when none are asked
            entry |= {"max_model_len": self.model.context, "default_max_tokens": self.model.max_tokens}
        return JSONResponse({"object": "list", "data": [entry]})

    @property
    def model(self) -> Engine | Embedder:
        """What is served, or 503 while it is still loading."""
        if self.served is None:
            raise APIError(503, "the model is still loading; try again shortly", kind="server_error",
                           code="model_loading")
        return self.served

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        engine = self.engine
        given = prompts(body, engine.model.config.vocab_size)
        asked = settings(body, chat=False)
        ids = [engine.prompt_ids(prompt) for prompt in given]
        echoed = None
        if asked.echo:  # each prompt's text, and its tokens' log-probabilities when asked: one pass each
            texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in given]
            scored = [None] * len(ids) if asked.logprobs is None else \
                [await self._run(lambda i=i: engine.scored(i, asked.logprobs)) for i in ids]
            echoed = list(zip(texts, scored, strict=True))
        return await self._answer(request, ids, asked, chat=False, echoed=echoed)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        engine, offered = self.engine, tools.request(body)
        asked = settings(body, chat=True)
        fmt = engine.tool_format[0]
        if offered is not None and offered.forced:  # decoding kept to calls of the tools
            if asked.grammar is not None:
                raise APIError(400, f"{asked.constrains} and a tool_choice that requires a call both constrain the "
                                    "reply; give one", param=asked.constrains)
            asked = replace(asked, grammar=("lark", tools.call_grammar(offered, fmt)), constrains="tools")
        prompt = engine.chat_prompt(messages(body), offered)
        reading = None if offered is None or offered.choice == "none" else (fmt, set(offered.functions))
        return await self._answer(request, [engine.prompt_ids(prompt)], asked, chat=True, tools=reading)

    async def embeddings(self, request: Request) -> Response:
        body = await self._body(request)
        embedder = self.model
        if not isinstance(embedder, Embedder):
            raise APIError(400, f"{embedder.name} is a language model; /v1/embeddings needs a sentence encoder "
                                "(qkv serve --pretrained minilm)", param="model")
        items = texts(body)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise APIError(400, "encoding_format must be float or base64", param="encoding_format")
        if body.get("dimensions") not in (None, embedder.dimensions):
            raise APIError(400, f"{embedder.name} makes vectors of {embedder.dimensions} dimensions only",
                           param="dimensions")
        vectors, tokens = await self._run(lambda: embedder.vectors(items))
        tally(request).prompt = tokens
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": embedder.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    # vLLM's tokenizer endpoints, which evaluation harnesses use to count and cut prompts in the model's own tokens
    async def tokenize(self, request: Request) -> Response:
        """``{"prompt", "add_special_tokens"}`` (or ``{"messages"}``: laid out by the chat template) ->
        ``{"count", "max_model_len", "tokens"}``."""
        body = await self._body(request, model_required=False)
        engine = self.engine
        if "messages" in body:
            text, special = engine.chat_prompt(messages(body)), True
        else:
            text, special = body.get("prompt"), flag(body, "add_special_tokens", True)
            if not isinstance(text, str):
                raise APIError(400, "prompt must be a string (or give messages)", param="prompt")
        ids = encode_prompt(engine.tokenizer, text) if special else engine.tokenizer.encode(text)
        return JSONResponse({"count": len(ids), "max_model_len": engine.context, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        """``{"tokens"}`` -> ``{"prompt"}``: the text of token ids (special tokens left out)."""
        body = await self._body(request, model_required=False)
        engine = self.engine
        tokens = body.get("tokens")
        if not token_ids(tokens, engine.model.config.vocab_size):
            raise APIError(400, f"tokens must be a list of token ids from 0 to {engine.model.config.vocab_size - 1}",
                           param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        """The tokenizer's special tokens as text, its chat template and the context, as vLLM describes them."""
        self._guard(request)
        engine = self.engine
        tokenizer = engine.tokenizer
        text = (lambda i: None if i is None else tokenizer.hf.id_to_token(i)) if hasattr(tokenizer, "hf") else \
            (lambda i: None)
        return JSONResponse({"tokenizer_class": type(tokenizer).__name__, "model_max_length": engine.context,
                             "bos_token": text(getattr(tokenizer, "bos_id", None)),
                             "eos_token": text(getattr(tokenizer, "eos_id", None)),
                             "pad_token": text(getattr(tokenizer, "pad_id", None)),
                             "chat_template": engine.chat_template})

    def _guard(self, request: Request, *, key: bool = True) -> None:
        """Host and Origin name this server; the key, where one is set."""
        host = request.headers.get("host", "")
        if _hostname(host) not in self.hosts:
            raise APIError(403, f"this server does not answer for Host {host[:100]!r}; call it by its own address",
                           kind="permission_error")
        origin = request.headers.get("origin")
        if origin is not None and _hostname(urlsplit(origin).netloc) not in self.hosts:
            raise APIError(403, f"requests from pages of {origin[:100]!r} are not accepted", kind="permission_error")
        if key and self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "a missing or wrong API key: send Authorization: Bearer <the --api-key given "
                                    "to qkv serve>", code="invalid_api_key", kind="authentication_error")

    async def _body(self, request: Request, *, model_required: bool = True) -> dict[str, Any]:
        """The request's JSON object, read no further than MAX_BODY bytes and within BODY_SECONDS; its model
        checked (where ``model_required`` is False, only when it names one)."""
        self._guard(request)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY:
            raise APIError(413, f"the request body is {int(length):,} bytes; at most {MAX_BODY:,} are read")
        try:
            raw = await asyncio.wait_for(_read(request), BODY_SECONDS)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {BODY_SECONDS:g} s") from None
        body = parse_body(raw)
        if model_required or body.get("model") is not None:
            check_model(body, self.model.name)
        return body

    async def _answer(self, request: Request, prompts: list[list[int]], settings: Settings, *, chat: bool,
                      echoed: list[tuple[str, list[Entry] | None]] | None = None,
                      tools: tuple[str, set[str]] | None = None) -> Response:
        """The answer to ``n`` continuations of each prompt (choice ``p · n + j``: prompt p's j-th), whole or
        streamed; ``echoed``: each prompt's text and scored tokens, put before its continuations; ``tools``: the
        format calls are written in and the functions' names, to read calls out of the replies."""
        for ids in prompts:
            self.engine.room(ids, settings)  # a max_tokens beyond the context is refused now, not when it is reached
        if settings.grammar is not None:  # a schema the library refuses: 400 now, not in the middle of a stream
            await self._run(lambda: self.engine.constraint(settings.grammar, settings.constrains))
        reply = _Reply(self.engine.name, chat, sum(map(len, prompts)), settings.n, echoed, tools)
        counted = tally(request)
        counted.prompt = reply.prompt_tokens
        if settings.stream:
            self._check_queue()  # a 429 as the answer's status; its events check again when they begin
            return _Stream(self._events(prompts, settings, reply, counted), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})
        done: dict[int, Continuation] = {}
        async for i, piece in self._continue(prompts, settings, counted, request=request):
            if isinstance(piece, Continuation):
                done[i] = piece
        if len(done) < len(prompts) * settings.n:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        return JSONResponse(reply.whole([done[i] for i in range(len(done))]))

    def _check_queue(self) -> None:
        if self.waiting >= self.max_waiting:
            raise APIError(429, f"{self.waiting} requests are already running or waiting for the model; try again "
                                "shortly", kind="rate_limit_error", code="busy")

    async def _run(self, work: Callable[[], Any]) -> Any:
        """``work()`` on a worker thread (the encoder may be a while), counted among the requests waiting."""
        self._check_queue()
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(None, work)
        finally:
            self.waiting -= 1

    async def _continue(self, prompts: list[list[int]], settings: Settings, counted: Tally, *,
                        request: Request | None = None) -> AsyncIterator[tuple[int, Any]]:
        """The ``n`` continuations of ``ids`` as they grow: ``(choice, (text, entries))`` for each piece of text and
        ``(choice, Continuation)`` once it ends (its tokens ``counted``). They end early if the consumer stops (a
        stream's client went away) or, given the ``request`` (an answer sent whole: no pieces, only the ends), once
        its client disconnects (checked every :data:`POLL_SECONDS`)."""
        queue: asyncio.Queue = asyncio.Queue()
        mailbox = self._mailbox or _Mailbox(asyncio.get_running_loop())
        self._mailbox = mailbox

        def push(item: Any) -> None:
            mailbox.put(queue, item)

        self._check_queue()
        self.waiting += 1
        rows = []
        choices = len(prompts) * settings.n
        try:
            for i in range(choices):  # a choice refused (400) ends those already started
                ids, j = prompts[i // settings.n], i % settings.n
                if settings.max_tokens == 0:  # an echo alone: the prompt scored, nothing continued
                    push((i, Continuation("", "length", 0, None if settings.logprobs is None else [])))
                    continue
                rows.append(self.engine.start(
                    ids, settings, seed=_seed(settings, j), on_end=lambda end, i=i: push((i, end)),
                    on_text=None if request else lambda text, entries, i=i: push((i, (text, entries)))))
            ended = 0
            while ended < choices:
                try:
                    i, piece = await asyncio.wait_for(queue.get(), POLL_SECONDS)
                except TimeoutError:
                    if request is not None and await request.is_disconnected():
                        return
                    continue
                if isinstance(piece, Exception):
                    raise piece
                if isinstance(piece, Continuation):
                    ended += 1
                    counted.generated += piece.tokens
                yield i, piece
        finally:
            for row in rows:  # nothing more is read: whatever still runs ends at its next token
                row.cancel()
            self.waiting -= 1

    async def _events(self, prompts: list[list[int]], settings: Settings, reply: _Reply,
                      counted: Tally) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer; the continuations stop if the client goes away."""
        for i in range(len(prompts) * settings.n):
            yield _event(reply.chunk(i, *reply.echo(i)))  # the role (or the echoed prompt) first, as OpenAI's
        finished: list[Continuation] = []
        try:
            async for i, piece in self._continue(prompts, settings, counted):
                if isinstance(piece, Continuation):
                    finished.append(piece)
                    yield _event(reply.chunk(i, None, finish_reason=piece.finish_reason))
                else:
                    yield _event(reply.chunk(i, *piece))
        except Exception as err:
            yield _event((err if isinstance(err, APIError) else _logged(err)).body())
        if settings.include_usage and len(finished) == len(prompts) * settings.n:
            yield _event(reply.usage_chunk(finished))
        yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """Server-sent events to a client that reads them: one that takes more than :data:`SEND_SECONDS` to take the next
    piece (its connection's buffers full) is cut off, and its continuation ends."""

    async def stream_response(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        async def timed(message: dict[str, Any]) -> None:
            await asyncio.wait_for(send(message), SEND_SECONDS)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.warning("qkv serve: a client read nothing for %g s; its stream was cut off", SEND_SECONDS)
        finally:
            await self.body_iterator.aclose()


class _Mailbox:
    """What the engine's thread hands to requests (pieces of text, ends), delivered on the event loop: everything
    one decoding step hands over arrives in one wake-up of the loop, not one per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a delivery is on its way already
                return
        with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped): nobody waits any more
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


class _Reply:
    """The JSON of one answer: the whole object, or its stream's chunks; a chat's tool calls read out of its text
    (``tools``: their format and the functions' names)."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, n: int = 1,
                 echoed: list[tuple[str, list[Entry] | None]] | None = None,
                 tools: tuple[str, set[str]] | None = None) -> None:
        self.model, self.chat, self.prompt_tokens, self.n, self.echoed = model, chat, prompt_tokens, n, echoed
        self.tools = tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.offsets: dict[int, int] = {}  # per choice of a streamed completion: characters sent so far
        self.readers: dict[int, CallReader] = {}  # per choice of a streamed chat with tools
        self.called: dict[int, int] = {}  # per choice of a streamed chat: calls sent so far

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, done: list[Continuation]) -> dict[str, int]:
        completion = sum(c.tokens for c in done)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def echo(self, index: int) -> tuple[str, list[Entry] | None]:
        """What choice ``index`` begins with: its prompt's text and scored tokens when echoed, else nothing."""
        return ("", None) if self.echoed is None else self.echoed[index // self.n]

    def whole(self, done: list[Continuation]) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(done):
            text, entries = self.echo(i)
            entries = None if c.entries is None else (entries or []) + c.entries
            choice = {"index": i, "finish_reason": c.finish_reason, "logprobs": self._logprobs(entries, 0)}
            if self.chat:
                content, calls = self._read(CallReader(*self.tools), c.text, True) if self.tools else (c.text, [])
                choice["message"] = {"role": "assistant", "content": content or (None if calls else content)}
                if calls:
                    choice["message"]["tool_calls"] = [call.json() for call in calls]
                    choice["finish_reason"] = _finish(c.finish_reason, called=True)
            else:
                choice["text"] = text + c.text
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": self.usage(done)}

    def chunk(self, index: int, text: str | None, entries: list[Entry] | None = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        """A piece of choice ``index``'s text with its tokens' log-probabilities (None: its end, with
        ``finish_reason``); a chat's tool calls each in the piece that closes it."""
        logprobs = self._logprobs(entries or None, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(text or "")
        if not self.chat:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice]}
        if text == "" and not entries:  # the first piece: the role alone
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
        else:
            content, calls = text or "", []
            if self.tools:
                reader = self.readers.setdefault(index, CallReader(*self.tools))
                content, calls = self._read(reader, content, text is None)
            delta = {"content": content} if content or entries else {}
            if calls:
                sent = self.called.get(index, 0)
                delta["tool_calls"] = [call.json(sent + k) for k, call in enumerate(calls)]
                self.called[index] = sent + len(calls)
        if finish_reason is not None:
            finish_reason = _finish(finish_reason, called=self.called.get(index, 0) > 0)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    @staticmethod
    def _read(reader: CallReader, text: str, last: bool) -> tuple[str, list[Call]]:
        """The content and calls ``text`` makes final (``last``: and whatever the reader held, at the end)."""
        content, calls = reader.feed(text)
        if last:
            rest, more = reader.end()
            content, calls = content + rest, calls + more
        return content, calls

    def usage_chunk(self, done: list[Continuation]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(done)}

    def _logprobs(self, entries: list[Entry] | None, offset: int) -> dict[str, Any] | None:
        """Log-probabilities as OpenAI shapes them: for a chat, ``content``, one object per token; for a completion,
        parallel lists (``text_offset``: where each token's text begins, counted from ``offset``)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**_token(e.text, e.logprob), "top_logprobs": [_token(t, v) for t, v in e.top]}
                                for e in entries]}
        starts = [offset + sum(len(e.text) for e in entries[:i]) for i in range(len(entries))]
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else dict(e.top) for e in entries], "text_offset": starts}


def _finish(reason: str, *, called: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` for a reply that ended (not cut short) with calls."""
    return "tool_calls" if called and reason == "stop" else reason


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _seed(settings: Settings, choice: int) -> int | None:
    """Choice ``choice``'s seed: the request's plus its index, so that n choices differ and each is repeatable."""
    return None if settings.seed is None else settings.seed + choice


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    """A vector as JSON numbers, or as base64 of its little-endian float32 bytes (what the openai client asks for)."""
    if encoding == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _read(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is over {MAX_BODY:,} bytes; at most that many are read")
        chunks.append(chunk)
    return b"".join(chunks)


def _hostname(host: str) -> str:
    """``name`` of a Host header ``name:port`` (``[::1]:8000`` gives ``::1``); "" where the port is not a number
    (``127.0.0.1:notaport`` names no server, as the explorer has it)."""
    parts = urlsplit(f"//{host}")
    try:
        parts.port  # noqa: B018 (read for its check: a port that is not a number in 0-65535 raises)
    except ValueError:
        return ""
    return parts.hostname or ""


def _logged(err: Exception) -> APIError:
    log.error("qkv serve: %s: %s", type(err).__name__, " ".join(str(err).split())[:300])
    return APIError(500, "the server failed while answering; its log says why", kind="server_error")


async def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, APIError)
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    message = {404: f"no such path: {request.url.path[:100]}", 405: f"{request.method} is not allowed here"}
    return await _api_error(request, APIError(err.status_code, message.get(err.status_code, str(err.detail))))


async def _internal_error(request: Request, err: Exception) -> Response:
    return await _api_error(request, _logged(err))


def serve(load: Callable[[], Engine | Embedder], *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None) -> None:
    """Answer on ``host``:``port`` (0: any free port) until interrupted: 503 while ``load()`` makes the model, then the
    model; says where on stdout once it is ready. A language model decodes on this, the main thread (PyTorch's
    fastest); HTTP is answered on another."""
    import uvicorn

    from .connections import config, listen

    sock = listen(host, port)  # from now on a client is queued, not refused, while uvicorn starts
    server = Server(None, hosts=LOOPBACK | {host}, api_key=api_key)
    http = uvicorn.Server(config(server.app()))
    answering = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="qkv-http", daemon=True)
    answering.start()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        served = load()
        if isinstance(served, Engine):  # this thread decodes: claimed before the first request can come
            served.claim()
        server.served = served
        shown = f"[{host}]" if ":" in host else host
        print(f"qkv serve: {served.name} at http://{shown}:{sock.getsockname()[1]}/v1  (Ctrl-C stops)", flush=True)
        if isinstance(served, Engine):
            _decode(served)
        else:
            threading.Event().wait()  # the encoder runs on the HTTP side's worker threads
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        pass
    finally:
        http.should_exit = True
        answering.join(BODY_SECONDS)


def _decode(engine: Engine) -> None:
    """Run the engine until interrupted; then every continuation ends, its client told so."""
    try:
        engine.run()
    except KeyboardInterrupt:
        engine.close()
        engine.run()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
