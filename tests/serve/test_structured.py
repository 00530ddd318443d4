"""``response_format`` in ``qkv serve``, with the official client, on SmolLM2 as stored: a JSON schema and a JSON
object, the reply parsing as the schema asks; requests with and without a schema decoded together, each as alone;
a reply cut by ``max_tokens`` saying ``length``; a schema the library cannot use a 400 naming it."""

from __future__ import annotations

import json
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
