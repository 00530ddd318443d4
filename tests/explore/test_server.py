"""The explorer's server: the page and the model's info, a result per request, concurrent requests, and every
kind of bad request answered with a status and a one-line error while the server goes on serving."""

import http.client
import json
import socket
import struct
import threading
import time

import pytest

from qkv.explore.results import InputError
from qkv.explore.server import MAX_BODY, MAX_CHARS, Explorer, make_server


def _run(text):
    if text == "boom":
        raise RuntimeError("the model broke")
    if text == "bad":
        raise InputError("the sentence is 99 tokens long; the explorer shows at most 62: shorten it")
    time.sleep(0.05)  # long enough for concurrent requests to overlap
    return {"model": "fake", "kind": "encoder", "input": text, "views": [], "steps": None, "image": None}


@pytest.fixture
def server():
    srv = make_server(Explorer(_run, {"model": "fake", "kind": "encoder", "example": "hi", "input_label": "Text"}),
                      "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.getheader("Content-Type"), data


def _post(server, payload):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, _, data = _request(server, "POST", "/api/attention", body, {"Content-Type": "application/json"})
    return status, json.loads(data)


def test_page_info_and_a_result(server):
    status, kind, html = _request(server, "GET", "/")
    assert status == 200 and kind.startswith("text/html") and b'id="qkv-data"' in html
    status, _, info = _request(server, "GET", "/api/info")
    assert status == 200 and json.loads(info) == {"max_chars": MAX_CHARS, "model": "fake", "kind": "encoder",
                                                  "example": "hi", "input_label": "Text"}
    assert _post(server, {"text": "  a cat  "}) == (200, {"model": "fake", "kind": "encoder", "input": "a cat",
                                                         "views": [], "steps": None, "image": None})


@pytest.mark.parametrize("payload, status, message", [
    (b"{not json", 400, "the request is not JSON"),
    ({"words": "x"}, 400, 'the request needs a "text" string'),
    (["x"], 400, 'the request needs a "text" string'),
    ({"text": 3}, 400, 'the request needs a "text" string'),
    ({"text": "   "}, 400, "the text is empty: type a sentence"),
    ({"text": "x" * (MAX_CHARS + 1)}, 400, f"the text is {MAX_CHARS + 1} characters long; at most {MAX_CHARS}"),
    ({"text": "bad"}, 400, "the sentence is 99 tokens long"),
    ({"text": "boom"}, 500, "the model failed on this input: RuntimeError: the model broke"),
    (b"\xff\xfe", 400, "the request is not JSON"),
])
def test_bad_requests_get_a_clear_error_and_the_server_goes_on(server, payload, status, message):
    got, answer = _post(server, payload)
    assert got == status and answer["error"].startswith(message) and "\n" not in answer["error"]
    assert _post(server, {"text": "still here"})[0] == 200


def test_oversized_requests_missing_lengths_and_unknown_paths(server):
    def raw(headers: bytes) -> bytes:
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            s.sendall(b"POST /api/attention HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n{")
            return s.makefile("rb").read()

    reply = raw(f"Content-Length: {MAX_BODY + 1}\r\n".encode())  # answered before the body is read
    assert reply.startswith(b"HTTP/1.0 413")
    assert f"the request is {MAX_BODY + 1} bytes; at most {MAX_BODY}: send a shorter text".encode() in reply
    reply = raw(b"Connection: close\r\n")  # no Content-Length at all
    assert reply.startswith(b"HTTP/1.0 411") and b"the request has no Content-Length" in reply
    status, _, data = _request(server, "GET", "/secret")
    assert status == 404 and json.loads(data)["error"] == "no page /secret: open / for the explorer"
    status, _, data = _request(server, "POST", "/", b"{}")
    assert status == 404 and "use /api/attention" in json.loads(data)["error"]
    assert _post(server, {"text": "still here"})[0] == 200


def test_concurrent_requests_are_all_answered(server):
    answers = []
    threads = [threading.Thread(target=lambda i=i: answers.append(_post(server, {"text": f"t{i}"})))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a[1]["input"] for a in answers) == [f"t{i}" for i in range(8)]
    assert all(a[0] == 200 for a in answers)


def test_a_taken_port_is_a_one_line_error(server):
    port = server.server_address[1]
    with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is taken .*choose another with --port, or --port 0"):
        make_server(Explorer(_run, {"model": "m", "kind": "encoder", "example": ""}), "127.0.0.1", port)


@pytest.fixture
def image_server():
    received = []

    def run(data):
        received.append(data)
        return {"model": "vit", "kind": "image", "input": "image", "views": [], "steps": None, "image": None}

    srv = make_server(Explorer(run, {"model": "vit", "kind": "image", "example": "data:image/png;base64,AA=="}),
                      "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, received
    srv.shutdown()
    srv.server_close()


def test_an_image_model_takes_an_image_as_a_data_url(image_server):
    server, received = image_server
    status, answer = _post(server, {"image": "data:image/png;base64,iVBORw0KGgo="})
    assert status == 200 and answer["kind"] == "image" and received == [b"\x89PNG\r\n\x1a\n"]
    for payload, message in (({"text": "a cat"}, 'the request needs an "image": a data URL of a PNG or JPEG'),
                             ({"image": "http://example.com/cat.png"}, 'the request needs an "image"'),
                             ({"image": "data:image/png;base64,@@@"}, "the image's data URL is not valid base64")):
        status, answer = _post(server, payload)
        assert status == 400 and answer["error"].startswith(message)
    assert len(received) == 1


def test_a_client_that_leaves_before_the_answer_costs_one_log_line(caplog):
    big = {"model": "m", "kind": "encoder", "input": "x" * 8_000_000, "views": [], "steps": None, "image": None}
    srv = make_server(Explorer(lambda text: big, {"model": "m", "kind": "encoder", "example": ""}), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with caplog.at_level("INFO", logger="qkv"):
            s = socket.create_connection(srv.server_address[:2], timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            s.sendall(b'POST /api/attention HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n{"text":"a"}')
            s.close()
            deadline = time.time() + 10
            while "ended early" not in caplog.text and time.time() < deadline:
                time.sleep(0.05)
        assert "a request from 127.0.0.1 ended early" in caplog.text and "Traceback" not in caplog.text
        assert _post(srv, {"text": "still here"})[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()
