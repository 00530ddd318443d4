"""The OpenAI API's requests as qkv reads them, and its error shape.

A request body is checked field by field before anything runs: every field qkv reads has its type and range
checked, and a wrong one is answered with status 400 and OpenAI's error object naming the field
(``{"error": {"message", "type", "param", "code"}}``), as the official clients expect::

    POST /v1/completions        {"model", "prompt" (a string, a list of token ids, or a list of either: one
                                 choice each), "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                                 "logprobs" (0-5), "echo" (the prompt's tokens and their log-probabilities
                                 before the completion's), "response_format" (or vLLM's "structured_outputs",
                                 llama.cpp's "json_schema" or "grammar"), "stream", "stream_options":
                                 {"include_usage"}}
    POST /v1/chat/completions   the same with "messages": [{"role": "system"|"user"|"assistant"|"tool", "content"}]
                                (an assistant's "tool_calls", a tool's "tool_call_id") instead of "prompt"
                                ("max_completion_tokens" as well as "max_tokens"), "logprobs": true with
                                "top_logprobs" (0-20), and "tools", "tool_choice", "parallel_tool_calls" (tools.py)

Fields a client may send that would change the answer and that qkv does not compute (``logit_bias``, penalties
other than 0, ...) are refused by name rather than ignored. A string that is not text (a lone surrogate, which JSON's
``\\ud800`` escape lets through) is refused wherever it is, naming its field: no tokenizer could read it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..detokenize import check_stops
from ..files import quoted

MAX_BODY = 1 << 20  # bytes of a request body: a prompt of a few hundred thousand characters
MAX_PROMPTS = 64  # prompts one completion request may give
MAX_CHOICES = 8  # n: continuations of one prompt
MAX_TOOLS = 128  # functions one request may offer, and calls one message may hold (OpenAI's limit)
ROWS = 8  # sequences a server decodes together unless told (llama.cpp's server: -np)
REPLY_TOKENS = 512  # a reply's tokens where the request gives no max_tokens, unless qkv serve --max-tokens says
MAX_TOP_CHAT, MAX_TOP_COMPLETION = 20, 5  # most probable tokens reported beside each chosen one (OpenAI's limits)
ROLES = ("system", "user", "assistant", "tool")

# Fields that change the answer and that qkv does not compute: refused rather than silently ignored (their neutral
# values pass). Fields that only describe the caller ("user", "metadata", "store", ...) are ignored.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None,), "logit_bias": (None, {}),
               "functions": (None,), "function_call": (None,),
               "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0)}


class APIError(Exception):
    """An answer other than success, in OpenAI's shape: ``status``, and a message that says what was wrong and
    what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Settings:
    """How to continue a prompt: the fields of a request that decoding reads."""

    max_tokens: int | None  # None: the server's default (qkv serve --max-tokens), at most what the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most probable tokens'
    echo: bool = False  # a completion's prompt first, its tokens' log-probabilities with the completion's
    grammar: tuple[str, Any] | None = None  # the text's grammar, (kind, source) of qkv.constrained.grammar
    constrains: str = "response_format"  # the request's field the grammar comes from ("tools": the calls')

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def parse_body(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an APIError (413 too large, 400 not a JSON object)."""
    if len(body) > MAX_BODY:
        raise APIError(413, f"the request body is {len(body):,} bytes; at most {MAX_BODY:,} are read")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise APIError(400, f"the request body is not JSON ({_short(err)}); send a JSON object") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    where = _not_text(value)
    if where is not None:
        raise APIError(400, f"{where} holds a lone surrogate (an escaped \\ud800-\\udfff with no pair), which is "
                            "not text; send UTF-8 text", param=where)
    return value


def _not_text(value: Any) -> str | None:
    """The field of ``value`` (a parsed body) holding a string UTF-8 cannot encode, a key or a value, or None: JSON
    lets ``"\\ud800"`` through, and such a string would fail in a tokenizer, or in the answer's own encoding."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _encodes(item):
            return path[:200] or "the request body"
        if isinstance(item, dict):
            for key, inner in item.items():
                if not _encodes(key):
                    return f"{path}[{quoted(key)}]"[:200]
                stack.append((f"{path}.{key}".lstrip("."), inner))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner) for i, inner in enumerate(item))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short(err: Exception) -> str:
    return " ".join(str(err).split())[:120]


def check_model(body: dict[str, Any], served: str) -> None:
    """The request names the served model (404 otherwise, as OpenAI answers an unknown model)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "model must be a string: the name GET /v1/models lists", param="model")
    if model != served:
        raise APIError(404, f"the model {model[:100]!r} is not served here; this server serves {served!r}",
                       param="model", code="model_not_found")


def prompts(body: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completion request, as OpenAI takes them: a string, a list of token ids, or a list of
    either (each token id checked against the vocabulary)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= MAX_PROMPTS:
        raise APIError(400, f"prompt must be a non-empty string, a list of token ids, or a list of at most "
                            f"{MAX_PROMPTS} of either", param="prompt")
    for i, one in enumerate(prompt):
        if not (isinstance(one, str) and one) and not _token_ids(one):
            raise APIError(400, f"prompt[{i}] must be a non-empty string or a non-empty list of token ids",
                           param="prompt")
        if not isinstance(one, str) and not token_ids(one, vocab_size):
            raise APIError(400, f"prompt[{i}] holds a token id outside the vocabulary (0 to {vocab_size - 1})",
                           param="prompt")
    return prompt


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def token_ids(value: Any, vocab_size: int) -> bool:
    """``value`` is a list of token ids of the vocabulary (0 to ``vocab_size - 1``)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                           for t in value)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a chat request, each ``{"role", "content"}`` with text content (a string, or a list of
    ``{"type": "text", "text"}`` parts, joined); an assistant's ``tool_calls`` (its content may then be null) and a
    tool's ``tool_call_id`` kept, as chat templates read them."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty list of {\"role\", \"content\"}", param="messages")
    out = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{param} must be an object with role and content", param=param)
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"{param}.role is {str(role)[:40]!r}; it must be one of {', '.join(ROLES)}",
                           param=f"{param}.role")
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        one = {"role": role, "content": "" if content is None and calls else _content(content, f"{param}.content")}
        if calls:
            one["tool_calls"] = message_calls(calls, f"{param}.tool_calls")
        if role == "tool":
            one["tool_call_id"] = str(message.get("tool_call_id", ""))[:100]
        out.append(one)
    return out


def message_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as a chat template reads them: each ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` with its arguments a JSON object (sent as text, as OpenAI sends them)."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise APIError(400, f"{param} must be a list of at most {MAX_TOOLS} calls", param=param)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, f"{param}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                f"\"arguments\"}}}}", param=param)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{param}[{i}].function.arguments must be a JSON object", param=param)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{param} must be text: a string or a list of {{\"type\": \"text\", \"text\"}} parts",
                   param=param)


def settings(body: dict[str, Any], *, chat: bool) -> Settings:
    """The decoding settings of a request, each field checked (400 naming it)."""
    for name, neutral in UNSUPPORTED.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise APIError(400, f"{name} is not supported by this server; leave it out", param=name)
    length = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = None if chat else 16  # OpenAI's: a completion stops at 16 tokens unless told; a chat reply at the
    # end of its turn, or at the server's --max-tokens
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop
    if stops is None:
        stops = ()
    if not isinstance(stops, (list, tuple)):
        stops = [stops]  # refused below, as a list holding something other than a string
    try:
        stops = check_stops(stops)
    except ValueError as err:
        raise APIError(400, str(err), param="stop") from None
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    if chat and body.get("echo") not in (None, False):
        raise APIError(400, "echo is a completion's: send the prompt to /v1/completions", param="echo")
    echo = not chat and flag(body, "echo")
    return Settings(
        max_tokens=_integer(body, length, default, minimum=0 if echo else 1),
        temperature=_real(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_real(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=_integer(body, "seed", None, minimum=-(2**63), maximum=2**63 - 1),
        stop=stops,
        n=_integer(body, "n", 1, minimum=1, maximum=MAX_CHOICES),
        stream=flag(body, "stream"),
        include_usage=flag(options or {}, "include_usage"),
        logprobs=_logprobs(body, chat=chat),
        echo=echo,
        **structure(body),
    )


STRUCTURES = ("response_format", "structured_outputs", "json_schema", "grammar")


def structure(body: dict[str, Any]) -> dict[str, Any]:
    """The grammar a reply is kept within and the field it came from (Settings' ``grammar`` and ``constrains``):
    OpenAI's ``response_format``, vLLM's ``structured_outputs`` (``{"json"}``, ``{"regex"}``, ``{"grammar"}`` or
    ``{"choice"}``), or llama.cpp's server's ``json_schema`` and ``grammar`` (Lark's syntax or GBNF); one at most."""
    given = [name for name in STRUCTURES if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the reply; give one", param=given[1])
    if not given:
        return {}
    name, value = given[0], body[given[0]]
    if name == "response_format":
        grammar = response_format(value)
    elif name == "structured_outputs":
        grammar = _structured_outputs(value)
    elif name == "json_schema":
        if not isinstance(value, dict):
            raise APIError(400, "json_schema must be a JSON schema (an object)", param=name)
        grammar = ("json_schema", value)
    else:
        if not isinstance(value, str) or not value.strip():
            raise APIError(400, "grammar must be a grammar's text (Lark's syntax or GBNF)", param=name)
        grammar = ("lark", value)
    return {} if grammar is None else {"grammar": grammar, "constrains": name}


def _structured_outputs(value: Any) -> tuple[str, Any]:
    """vLLM's ``structured_outputs``: one of ``json`` (a schema, or its text), ``regex``, ``grammar`` (Lark or GBNF)
    or ``choice`` (a list of texts, the reply one of them)."""
    kinds = {"json": "json_schema", "regex": "regex", "grammar": "lark"}
    given = [k for k in (*kinds, "choice") if isinstance(value, dict) and value.get(k) is not None]
    if len(given) != 1:
        raise APIError(400, "structured_outputs must give one of json, regex, grammar or choice",
                       param="structured_outputs")
    kind, source = given[0], value[given[0]]
    if kind == "choice":
        if not isinstance(source, list) or not source or not all(isinstance(c, str) and c for c in source):
            raise APIError(400, "structured_outputs.choice must be a list of texts", param="structured_outputs")
        return "lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in source)
    if not (isinstance(source, str) and source) and not (kind == "json" and isinstance(source, dict)):
        raise APIError(400, f"structured_outputs.{kind} must be text" + (" or a JSON schema" if kind == "json" else ""),
                       param="structured_outputs")
    return kinds[kind], source


def response_format(value: Any) -> tuple[str, Any] | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; the schema is checked when the request
    is answered (400 naming what the library refuses)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                           param="response_format.json_schema.schema")
        return "json_schema", schema
    raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}", param="response_format")


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many of the most probable tokens to report beside each chosen one: a chat request asks with ``logprobs:
    true`` and ``top_logprobs`` (0 to 20), a completion with ``logprobs`` (0 to 5); None when not asked."""
    if not chat:
        return _integer(body, "logprobs", None, minimum=0, maximum=MAX_TOP_COMPLETION)
    top = _integer(body, "top_logprobs", None, minimum=0, maximum=MAX_TOP_CHAT)
    if not flag(body, "logprobs"):
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def _integer(body: dict[str, Any], name: str, default: int | None, *, minimum: int,
             maximum: int = 2**31 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise APIError(400, f"{name} must be an integer from {minimum} to {maximum}, got {str(value)[:40]}",
                       param=name)
    return value


def _real(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
          open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if open_low else low <= value) or value > high:
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise APIError(400, f"{name} must be a number in {interval}, got {str(value)[:40]}", param=name)
    return float(value)


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A true-or-false field (400 naming it otherwise); ``default`` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false", param=name)
    return value
