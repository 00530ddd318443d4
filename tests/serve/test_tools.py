"""Tool calls in ``qkv serve``: the request's tools checked in one line each; calls read out of a reply in the Hermes
and Llama 3 formats the same whether it comes whole or a character at a time; ``required`` and a named function
keeping decoding to calls whose arguments their schema accepts (and nothing else); and, with the official client on
SmolLM2 as stored, forced, required and auto calls, streamed and not, and a round trip (call, tool result, answer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("llguidance", reason="tool calls are constrained by llguidance: pip install llguidance")
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")

from live_server import HANG  # noqa: E402

from qkv import constrained  # noqa: E402
from qkv.serve import tools  # noqa: E402
from qkv.serve.protocol import APIError  # noqa: E402
from qkv.tokenizers import CharTokenizer  # noqa: E402

NAME = "smollm2"  # the served model's name (tests/serve/conftest.py)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _call(city):
    return [{"id": f"call_{city}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]


# one earlier turn where the assistant called the tool: SmolLM2-135M then calls it again by itself (auto)
SHOWN = [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": _call("Paris")},
         {"role": "user", "content": "What is the weather in London?"}]


def _tools(**body):
    return tools.request({"tools": [WEATHER, TIME], **body})


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "again"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0]", "JSON schema"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_a_bad_tools_field_is_a_400_naming_it(body, param, words):
    with pytest.raises(APIError) as caught:
        tools.request(body)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_no_tools_and_tool_choice_defaults():
    assert tools.request({}) is None and tools.request({"tools": [], "tool_choice": "auto"}) is None
    offered = tools.request({"tools": [WEATHER]})
    assert offered.choice == "auto" and offered.parallel and not offered.forced
    assert _tools(tool_choice={"type": "function", "function": {"name": "get_time"}}).choice == "get_time"


def _read(fmt, pieces, names=("get_weather", "get_time")):
    reader = tools.CallReader(fmt, set(names))
    content, calls = "", []
    for piece in pieces:
        text, made = reader.feed(piece)
        content, calls = content + text, calls + made
    text, made = reader.end()
    return content + text, [(c.name, json.loads(c.arguments)) for c in calls + made]


HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("No call: a < b and <tool", "No call: a < b and <tool", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', None, []),  # JSON that fails
    ('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', None, []),  # no such tool
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ('<tool_call>\n{"name": "get_weather", "argu', None, []),  # cut short
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
     '{"city": "a;b"}}', "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "a;b"})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}} and then some', None, []),
    ("It is sunny: {\"name\": 1}", None, []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"),
                         [("hermes", *case) for case in HERMES] + [("llama3", *case) for case in LLAMA3])
def test_calls_are_read_out_of_a_reply_alike_whole_and_a_character_at_a_time(fmt, text, content, calls):
    whole = _read(fmt, [text])
    assert whole == _read(fmt, list(text)) == _read(fmt, [text[:7], text[7:20], text[20:]])
    assert whole == (text if content is None else content, calls)  # None: not a call, the text as it was


def _table():
    chars = CharTokenizer.train(["".join(map(chr, range(32, 127))) + "\n"])
    return chars, constrained.token_table(chars, chars.vocab_size, eos=2)


def _accepts(grammar, text, table):
    constraint = constrained.Constraint(table[1], constrained.grammar("lark", grammar))
    try:
        for c in text:
            constraint.take(table[0].stoi[c])
    except ValueError:
        return False
    return constraint.complete


@pytest.mark.parametrize(("fmt", "key", "around"), [("hermes", "arguments", ("<tool_call>\n", "\n</tool_call>")),
                                                    ("llama3", "parameters", ("", ""))])
def test_a_required_call_grammar_takes_valid_calls_of_the_tools_and_nothing_else(fmt, key, around):
    table = _table()

    def call(name, arguments):
        return around[0] + json.dumps({"name": name, key: arguments}) + around[1]

    good, other = call("get_weather", {"city": "Paris", "unit": "celsius"}), call("get_time", {"zone": "CET"})
    required = tools.call_grammar(_tools(tool_choice="required", parallel_tool_calls=False), fmt)
    assert _accepts(required, good, table) and _accepts(required, other, table)
    for bad in (call("get_weather", {"town": "Paris"}), call("get_weather", {"city": "Paris", "unit": "kelvin"}),
                call("get_weather", {}), call("nope", {"zone": "CET"}), "Paris is sunny.",
                good + ("\n" if fmt == "hermes" else "; ") + other):
        assert not _accepts(required, bad, table), bad
    named = tools.call_grammar(_tools(tool_choice={"type": "function", "function": {"name": "get_time"}}), fmt)
    assert _accepts(named, other, table) and not _accepts(named, good, table)
    assert _accepts(named, other + ("\n" if fmt == "hermes" else "; ") + other, table)  # parallel calls


def test_the_default_format_writes_tools_calls_and_answers_into_plain_messages():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": c}}} for c in ("Paris", "Rome")]},
                {"role": "tool", "content": "18 C", "tool_call_id": "a"}, {"role": "tool", "content": "24 C"}]
    plain, offered = tools.conversation(messages, _tools(), native=False)
    assert offered is None and [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in plain)
    assert plain[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in plain[0]["content"]
    assert plain[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                   '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                   '"Rome"}}\n</tool_call>')
    assert plain[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n24 C\n</tool_response>"
    native = tools.conversation(messages, _tools(), native=True)
    assert native == (messages, _tools().offered())


def _templates():
    source = os.environ.get("QKV_LLAMA_CPP_SOURCE")
    folder = Path(source or "/nonexistent") / "models" / "templates"
    if not folder.is_dir():
        pytest.skip("needs the published chat templates of llama.cpp's sources (QKV_LLAMA_CPP_SOURCE; .ci/run)")
    return folder


@pytest.mark.parametrize(("name", "fmt", "native"), [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes", True), ("Qwen-Qwen3-0.6B", "hermes", True),
    ("HuggingFaceTB-SmolLM3-3B", "hermes", False), ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", True),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3", True), ("meta-llama-Llama-3.1-8B-Instruct", "llama3", True),
    ("google-gemma-2-2b-it", "hermes", False), ("microsoft-Phi-3.5-mini-instruct", "hermes", False)])
def test_the_call_format_is_known_from_the_models_template(name, fmt, native):
    assert tools.format_of((_templates() / f"{name}.jinja").read_text()) == (fmt, native)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG)


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(chunks):
    """The content, the calls (their deltas put together by index) and the finish reason of a streamed reply."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_forced_call_is_one_call_of_the_tool_whole_and_streamed(client, choice):
    ask = dict(model=NAME, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
               temperature=0, max_tokens=60)
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    calls = _calls(message)
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(calls) == 1 and calls[0][0] == "get_weather" and set(calls[0][1]) <= {"city", "unit"}
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    assert _streamed(client.chat.completions.create(**ask, stream=True)) == ("", calls, "tool_calls")


def test_auto_reads_a_call_the_model_chose_to_make_and_leaves_a_plain_answer_alone(client):
    ask = dict(model=NAME, tools=[WEATHER], temperature=0, max_tokens=60)
    reply = client.chat.completions.create(messages=SHOWN, **ask)
    calls = _calls(reply.choices[0].message)
    assert calls == [("get_weather", {"city": "London"})] and reply.choices[0].finish_reason == "tool_calls"
    assert _streamed(client.chat.completions.create(messages=SHOWN, stream=True, **ask)) == ("", calls, "tool_calls")
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}], **ask)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    none = client.chat.completions.create(messages=SHOWN, tool_choice="none", **ask)
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


def test_a_round_trip_call_then_tool_result_then_answer(client):
    first = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    conversation = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 31, "sky": "clear"})}]
    answer = client.chat.completions.create(model=NAME, messages=conversation, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=30)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    # the answer continues the conversation as laid out, the tool's result in it
    ids = client.post("/../tokenize", cast_to=object, body={"model": NAME, "messages": conversation})["tokens"]
    prompt = client.post("/../detokenize", cast_to=object, body={"tokens": ids})["prompt"]
    assert '<tool_call>\n{"name": "get_weather"' in prompt and '{"celsius": 31, "sky": "clear"}' in prompt


def test_the_models_own_template_lays_tools_out_where_it_can(engine, client):
    template = (_templates() / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    before, engine.chat_template = engine.chat_template, template
    try:
        reply = client.chat.completions.create(model=NAME, messages=SHOWN, tools=[WEATHER], temperature=0,
                                               max_tokens=60)
        prompt = engine.chat_prompt([dict(m) for m in SHOWN[:1]], tools.request({"tools": [WEATHER]}))
    finally:
        engine.chat_template = before
    assert _calls(reply.choices[0].message) == [("get_weather", {"city": "London"})]
    assert prompt.startswith("<|im_start|>system\nYou are Qwen") and json.dumps(WEATHER) in prompt


def test_what_cannot_be_a_call_is_a_400_before_any_token(client):
    bad = [dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
           dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                {"x": {"type": "string", "format": "no-such-format"}}, "required": ["x"]}}}], tool_choice="required"),
           dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
           dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
               "name": "get_weather", "arguments": "{not json"}}]}], tools=[WEATHER])]
    for extra, (param, words) in zip(bad, [("response_format", "give one"), ("tools", "no-such-format"),
                                           ("tool_choice", "not among"), ("messages[0].tool_calls", "JSON object")],
                                      strict=True):
        ask = {"model": NAME, "messages": QUESTION, "max_tokens": 5, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**ask)
        assert caught.value.body["param"] == param and words in caught.value.body["message"]
