"""What ``qkv serve`` bounds and says, on a live server (SmolLM2 as stored): a reply's default length, one log line
per request, stop strings, connections whose headers never complete, addresses it cannot listen on; and a bad
request fails alone, never the requests decoding beside it."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

pytest.importorskip("starlette", reason="qkv serve needs starlette: pip install 'qkv[serve]'")
pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
httpx = pytest.importorskip("httpx")

from clitools import one_line_error  # noqa: E402
from live_server import HANG, live  # noqa: E402

from qkv.serve.app import Server  # noqa: E402
from qkv.serve.engine import Engine  # noqa: E402

NAME = "smollm2"
KEY = "a-test-key-of-enough-length"


def test_a_reply_without_max_tokens_stops_at_the_servers_default_which_models_states(engine):
    capped = Engine(engine.model, engine.tokenizer, name=NAME, stop_ids=set(engine.stop_ids),
                    chat_template=engine.chat_template, max_tokens=5)
    with live(Server(capped)) as base:
        entry = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert entry["default_max_tokens"] == 5 and entry["max_model_len"] == engine.context
        story = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0}
        answer = httpx.post(f"{base}/v1/chat/completions", json=story, timeout=HANG).json()
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 5
        answer = httpx.post(f"{base}/v1/chat/completions", json=story | {"max_tokens": 7}, timeout=HANG).json()
        assert answer["usage"]["completion_tokens"] == 7  # a request's own max_tokens goes beyond the default


def test_each_request_is_one_log_line_with_its_tokens_and_time(url, caplog):
    caplog.set_level(logging.INFO, logger="qkv")
    body = {"model": NAME, "prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG).json()
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=HANG) as stream:
        list(stream.iter_lines())
    httpx.get(f"{url}/nowhere")
    deadline = time.monotonic() + HANG
    while sum("/nowhere" in r.getMessage() for r in caplog.records) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the line is written once the answer has gone
    lines = [r.getMessage() for r in caplog.records if r.name == "qkv" and " tokens, " in r.getMessage()]
    prompt, made = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    said = f"prompt {prompt} tokens, generated {made} tokens, "
    assert [line.split(": ")[0] for line in lines] == ["POST /v1/completions 200"] * 2 + ["GET /nowhere 404"]
    assert all(said in line for line in lines[:2]) and lines[2].endswith(" s")


SURROGATE = '"a \\ud800 b"'  # JSON's escape of half a character: Python reads it, no tokenizer can
BAD = [
    (f'{{"model": "smollm2", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}', "/v1/chat/completions",
     "messages[0].content"),
    (f'{{"model": "smollm2", "prompt": {SURROGATE}}}', "/v1/completions", "prompt"),
    (f'{{"model": "smollm2", "prompt": ["Hi", {SURROGATE}]}}', "/v1/completions", "prompt[1]"),
    (json.dumps({"model": NAME, "prompt": "Hi", "stop": ["x" * 240_000] * 4}), "/v1/completions", "stop"),
]


def test_a_bad_request_fails_alone_while_a_stream_decodes_beside_it(url):
    """Each request of the list is a 400 naming its field (a tiny top_p is the most probable token, as the
    samplers define it), and a stream running meanwhile ends whole, as it does alone."""
    prompt = {"model": NAME, "prompt": "Count: one, two, three,", "max_tokens": 24, "temperature": 0}
    alone = httpx.post(f"{url}/v1/completions", json=prompt, timeout=HANG).json()["choices"][0]["text"]
    pieces, answers = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=prompt | {"stream": True}, timeout=HANG) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            pieces.append(chunk["choices"][0]["text"])
            if len(pieces) == 2:  # decoding now: the bad requests arrive
                start = time.monotonic()
                for body, path, _ in BAD:
                    answers.append(httpx.post(f"{url}{path}", content=body, timeout=HANG,
                                              headers={"Content-Type": "application/json"}))
                assert time.monotonic() - start < 10  # four 240,000-character stop strings are refused at once
                for top_p in (1e-30, 1e-300):
                    answers.append(httpx.post(f"{url}/v1/completions", timeout=HANG, json=prompt | {
                        "temperature": 1.0, "top_p": top_p, "max_tokens": 6}))
    assert "".join(pieces) == alone
    for answer, (_, _, param) in zip(answers, BAD, strict=False):
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert "lone surrogate" in answers[0].json()["error"]["message"]
    assert "at most 256 characters" in answers[3].json()["error"]["message"]
    greedy = httpx.post(f"{url}/v1/completions", json=prompt | {"max_tokens": 6}, timeout=HANG).json()
    for answer in answers[len(BAD) :]:
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def opened(port: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    if first:
        sock.sendall(first)
    return sock


def closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_that_never_complete_are_cut_off_and_connections_are_bounded(server):
    with live(server, header_seconds=1.0, connections=6) as base:
        port = int(base.rsplit(":", 1)[1])
        trickling = [opened(port, b"GET /health HTTP/1.1\r\nHost: 127") for _ in range(3)]
        health = httpx.get(f"{base}/health", timeout=HANG)  # answered while they hang
        assert health.status_code == 200
        assert not any(closed(s, 0.1) for s in trickling)  # well within the header time: still open
        assert all(closed(s, 3.0) for s in trickling)  # past it: closed by the server
        held = [opened(port, b"") for _ in range(6)]
        time.sleep(0.2)
        assert sum(closed(s, 0.5) for s in held) >= 1  # beyond the bound: closed at once
        for s in trickling + held:
            s.close()
        time.sleep(1.5)
        assert httpx.get(f"{base}/health", timeout=HANG).status_code == 200


def test_an_address_in_use_or_unknown_is_one_line_naming_it(tmp_path, here):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    with busy:
        proc = here("serve", "--pretrained", "smollm2", "--port", port, cwd=tmp_path)
        one_line_error(proc, f"127.0.0.1:{port} is in use already", "give another --port")
    proc = here("serve", "--pretrained", "smollm2", "--host", "no-such-host.invalid", "--api-key", KEY, cwd=tmp_path)
    one_line_error(proc, "--host 'no-such-host.invalid' is not a known name or address", "127.0.0.1")
    assert "Errno" not in proc.stderr
