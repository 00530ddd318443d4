"""Tool calls: functions an application offers the model, and the model's calls read back out of its text.

A chat request may give ``tools`` (OpenAI's ``{"type": "function", "function": {"name", "description",
"parameters"}}``) and ``tool_choice``::

    "none"        the model is told of the tools and answers in text (nothing is read as a call)
    "auto"        the model chooses: calls written in its family's format are read out of the reply, the rest is
                  the reply's text
    "required"    decoding is constrained to calls (one, or more with ``parallel_tool_calls``), each naming one of
                  the tools with arguments its ``parameters`` schema accepts
    {"type": "function", "function": {"name"}}   the same, calls of that one function

How the tools reach the model: through its own chat template where the template lays tools out (Qwen2.5 and Qwen3,
Llama 3.x, SmolLM3, Hermes: ``tools`` given to the template, an assistant's ``tool_calls`` and the ``tool``
messages as the template reads them); otherwise through one default, the Hermes format: the tools described in
the system message, a call written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a tool's
answer a user turn between ``<tool_response>`` tags.

The two formats read back (:class:`CallReader`), as the model writes them::

    hermes   text <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call> ...   calls anywhere, the rest text
    llama3   {"name": "f", "parameters": {...}}; {...}     the whole reply (after Llama's <|python_tag|>), or text

A call whose JSON does not parse, or that names no tool offered, stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..detokenize import held
from .protocol import MAX_TOOLS, APIError, flag

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function's name, as OpenAI allows them
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's tags
PYTHON_TAG = "<|python_tag|>"  # what Llama 3.1 may write before a call
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    """The tools a chat request offers: ``functions`` (OpenAI's ``function`` objects, by name), ``choice`` (none,
    auto, required, or a function's name) and whether a reply may hold several calls (``parallel``)."""

    functions: dict[str, dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Decoding is constrained to calls."""
        return self.choice not in ("none", "auto")

    def offered(self) -> list[dict[str, Any]]:
        """The tools as a chat template reads them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]


@dataclass(frozen=True)
class Call:
    """One call the model wrote: the function's ``name``, its ``arguments`` as JSON text, and the ``id`` a ``tool``
    message answers it by."""

    name: str
    arguments: str
    id: str

    def json(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI writes it in a message (``index``: in a stream's delta)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def request(body: dict[str, Any]) -> Tools | None:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, each checked (400 naming the
    field); None when it offers none."""
    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice asks for a call but the request gives no tools", param="tool_choice")
        return None
    if not isinstance(given, list) or len(given) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\"}}",
                       param="tools")
    functions = {}
    for i, tool in enumerate(given):
        function = _function(tool, f"tools[{i}]")
        if function["name"] in functions:
            raise APIError(400, f"tools[{i}] names {function['name']!r} again; each function once", param="tools")
        functions[function["name"]] = function
    return Tools(functions, _choice(choice, functions), flag(body, "parallel_tool_calls", True))


def _function(tool: Any, param: str) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise APIError(400, f"{param} must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}",
                       param=param)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(400, f"{param}.function.name must be 1 to 64 letters, digits, _ . or -", param=param)
    if not isinstance(function.get("description", ""), str):
        raise APIError(400, f"{param}.function.description must be a string", param=param)
    if not isinstance(function.get("parameters", {}), dict):
        raise APIError(400, f"{param}.function.parameters must be a JSON schema (an object)", param=param)
    return {key: function[key] for key in ("name", "description", "parameters", "strict") if key in function}


def _choice(choice: Any, functions: dict[str, dict[str, Any]]) -> str:
    if choice is None:
        return "auto"
    if choice in CHOICES:
        return choice
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\"}}", param="tool_choice")
    if name not in functions:
        raise APIError(400, f"tool_choice names {name[:64]!r}, which is not among the tools", param="tool_choice")
    return name


def format_of(template: str | None) -> tuple[str, bool]:
    """The format a model writes calls in, and whether its template lays tools out itself: a template that reads
    ``tools`` and shows ``<tool_call>`` (Qwen, SmolLM3, Hermes) or Llama's ``"parameters"`` JSON; any other
    template gets the default (Hermes, described in the system message)."""
    if template and "tools" in template:
        if OPEN in template:
            return "hermes", True
        if PYTHON_TAG in template or '"parameters"' in template:
            return "llama3", True
    return "hermes", False


def conversation(messages: list[dict[str, Any]], tools: Tools | None,
                 native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a chat template is given: as they are for a template that lays tools out itself
    (``native``); otherwise in the default format, plain messages only: the tools described in the system
    message, calls written into the assistant's text, a tool's answer a user turn."""
    if native:
        return messages, None if tools is None else tools.offered()
    out: list[dict[str, Any]] = []
    answering = False  # the last turn holds tools' answers
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            written = [f"{OPEN}\n{_call_json(c['function'])}\n{CLOSE}" for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [content, *written]))})
        elif role == "tool":
            answer = f"<tool_response>\n{content}\n</tool_response>"
            if answering:  # a tool's answers after one call of several: one user turn
                out[-1]["content"] += "\n" + answer
            else:
                out.append({"role": "user", "content": answer})
        else:
            out.append({"role": role, "content": content})
        answering = role == "tool"
    if tools is not None:
        described = describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def describe(tools: Tools) -> str:
    """The default format's description of the tools, for the system message (the wording Hermes and Qwen were
    trained with)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.offered())
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f"{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")


def _call_json(function: dict[str, Any]) -> str:
    """A call as the default format writes it: ``{"name": ..., "arguments": {...}}``."""
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)


def call_grammar(tools: Tools, fmt: str) -> str:
    """A Lark grammar (llguidance's, with ``%json`` schemas) of the calls ``tool_choice`` asks for: ``required``,
    a call of any tool; a named function, of that one; several in a row with ``parallel_tool_calls``. Each call's
    JSON names its function first and holds exactly the arguments its ``parameters`` accept."""
    chosen = tools.functions.values() if tools.choice == "required" else [tools.functions[tools.choice]]
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               key: f.get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for f in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "llama3":
        call, between = "obj", '"; "'
    else:
        call, between = f'{json.dumps(OPEN + chr(10))} obj {json.dumps(chr(10) + CLOSE)}', r'"\n"'
    start = f"start: {call} ({between} {call})*" if tools.parallel else f"start: {call}"
    return f"{start}\nobj: %json {json.dumps(schema)}\n"


class CallReader:
    """A reply read as it grows (:meth:`feed` each piece, then :meth:`end`): the text that is the reply's content,
    and the calls, each once it is whole. Text that may begin a call is held back until it is known whether it
    does."""

    def __init__(self, fmt: str, names: set[str]) -> None:
        self.fmt, self.names = fmt, names
        self.buffer = ""  # text not yet given out
        self.inside = False  # (hermes) within <tool_call> ... </tool_call>
        self.holding: bool | None = None  # (llama3) the reply may be a call: held to the end; None: not yet known
        self.space = ""  # trailing whitespace, held until text follows
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that ``text``, appended to the reply, makes final."""
        self.buffer += text
        content, calls = self._llama3() if self.fmt == "llama3" else self._hermes()
        return self._spaced(content), calls

    def end(self) -> tuple[str, list[Call]]:
        """What was held back, at the reply's end: a call cut short, or text that was not a call, as content."""
        rest, self.buffer = self.buffer, ""
        if self.fmt == "llama3":
            calls = self._json_calls(rest) if self.holding else None
            content = "" if calls else rest
        else:
            call = self._call(rest) if self.inside else None
            calls = [call] if call else []
            content = "" if call else (OPEN + rest if self.inside else rest)
        self.calls += len(calls or [])
        out = self._spaced(content)
        if not self.calls:
            out += self.space
        self.space = ""
        return out, calls or []

    def _hermes(self) -> tuple[str, list[Call]]:
        content, calls = "", []
        while True:
            if self.inside:
                close = self.buffer.find(CLOSE)
                if close < 0:
                    return content, calls
                body, self.buffer = self.buffer[:close], self.buffer[close + len(CLOSE):]
                call = self._call(body)
                if call is None:
                    content += OPEN + body + CLOSE
                else:
                    calls.append(call)
                    self.calls += 1
                self.inside = False
            else:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = held(self.buffer, (OPEN,))
                    cut = len(self.buffer) - keep
                    content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                    return content, calls
                content, self.buffer = content + self.buffer[:at], self.buffer[at + len(OPEN):]
                self.inside = True

    def _llama3(self) -> tuple[str, list[Call]]:
        if self.holding is None:
            start = self.buffer.lstrip()
            if not start or PYTHON_TAG.startswith(start):
                return "", []  # not yet known
            self.holding = start.startswith(("{", PYTHON_TAG))
        if self.holding:
            return "", []
        content, self.buffer = self.buffer, ""
        return content, []

    def _spaced(self, content: str) -> str:
        """``content`` less its trailing whitespace, held until text follows (dropped at the end if calls were
        made): no whitespace is given out between or around calls, whatever pieces the reply came in."""
        text = self.space + content
        body = text.rstrip()
        self.space = text[len(body):]
        return body

    def _call(self, body: str) -> Call | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return self._made(value, "arguments")

    def _json_calls(self, text: str) -> list[Call] | None:
        """Llama's calls: JSON objects one after another (``;`` between), after an optional ``<|python_tag|>``;
        None unless the whole text is calls."""
        text = text.strip().removeprefix(PYTHON_TAG)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            if at == len(text):
                return calls or None
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = self._made(value, "parameters")
            if call is None:
                return None
            calls.append(call)

    def _made(self, value: Any, key: str) -> Call | None:
        """A call of an offered tool from its JSON (arguments under ``key``, or ``arguments``), else None."""
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get(key, value.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        return Call(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


__all__ = ["Call", "CallReader", "Tools", "call_grammar", "conversation", "describe", "format_of", "request"]
