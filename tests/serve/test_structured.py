"""``response_format`` in ``qkv serve``, with the official client, on SmolLM2 as stored: a JSON schema and a JSON
object, the reply parsing as the schema asks; requests with and without a schema decoded together, each as alone;
a reply cut by ``max_tokens`` saying ``length``; a schema the library cannot use a 400 naming it; vLLM's and
llama.cpp's own fields for the same (a regex, a choice, a Lark or GBNF grammar, a schema)."""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install llguidance")
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")

from live_server import HANG  # noqa: E402

NAME = "smollm2"  # the served model's name (tests/serve/conftest.py)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
QUESTION = [{"role": "user", "content": "Name a large city and its population, as JSON."}]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG)


def test_a_json_schema_reply_parses_as_the_schema_asks_whole_and_streamed(client):
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=80,
                                           response_format=FORMAT)
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=80,
                                            response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    anything = client.completions.create(model=NAME, prompt="A small JSON object:", temperature=0.7, seed=3,
                                         max_tokens=60, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].text), dict)


def test_rows_with_a_schema_and_without_decode_together_each_as_alone(client):
    asks = [dict(response_format=FORMAT), {}, dict(response_format={"type": "json_object"}), {}]
    together = [None] * len(asks)

    def ask(i):
        together[i] = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=40,
                                                     **asks[i]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
    alone = [client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=40,
                                            **a).choices[0].message.content for a in asks]
    assert together == alone


def test_a_reply_cut_short_says_length_and_a_bad_schema_is_a_400(client):
    cut = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=3,
                                         response_format=FORMAT)
    assert cut.choices[0].finish_reason == "length"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "x": {"type": "strnig"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=5, response_format=bad)
    assert "strnig" in refused.value.body["message"] and refused.value.body["param"] == "response_format"


def test_vllms_and_llama_cpps_fields_keep_a_completion_within_their_grammar(client):
    """vLLM's ``structured_outputs`` (a regex, a choice, a grammar) and llama.cpp's ``grammar`` (GBNF) and
    ``json_schema``: the text each gives is one its grammar accepts."""
    asks = {"structured_outputs": [({"regex": "[0-9]{3}-[0-9]{4}"}, r"\d{3}-\d{4}"),
                                   ({"choice": ["red wine", "green tea"]}, "red wine|green tea"),
                                   ({"grammar": 'start: "yes" | "no"'}, "yes|no")],
            "grammar": [('root ::= ("up" | "down") " " [0-9]+', "(up|down) [0-9]+")]}
    for field, cases in asks.items():
        for value, pattern in cases:
            reply = client.completions.create(model=NAME, prompt="The answer:", temperature=0.8, seed=1,
                                              max_tokens=12, extra_body={field: value})
            assert re.fullmatch(pattern, reply.choices[0].text), (value, reply.choices[0].text)
    reply = client.completions.create(model=NAME, prompt="A city as JSON:", temperature=0, max_tokens=120,
                                      extra_body={"json_schema": SCHEMA}).choices[0]
    assert reply.finish_reason == "stop", reply.text  # whole, not cut by max_tokens
    assert set(json.loads(reply.text)) == {"city", "population"}


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar", "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "list of texts"),
    ({"grammar": 'root ::= ("a" | '}, "grammar", "GBNF grammar cannot be read"),
    ({"grammar": 3}, "grammar", "grammar's text"),
])
def test_a_grammar_field_that_cannot_be_used_is_a_400_naming_it(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=NAME, prompt="x", max_tokens=3, extra_body=extra)
    assert refused.value.body["param"] == param and words in refused.value.body["message"]
