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
            s.sendall(b"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.server_address[1] + headers
                      + b"\r\n{")
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
            s.sendall(b'POST /api/attention HTTP/1.1\r\nHost: localhost:%d\r\nContent-Length: 12\r\n\r\n{"text":"a"}'
                      % srv.server_address[1])
            s.close()
            deadline = time.time() + 10
            while "ended early" not in caplog.text and time.time() < deadline:
                time.sleep(0.05)
        assert "a request from 127.0.0.1 ended early" in caplog.text and "Traceback" not in caplog.text
        assert _post(srv, {"text": "still here"})[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def _raw(server, request: bytes, *, wait: float = 10) -> bytes:
    """What the server answers ``request`` sent on a socket of its own, up to the connection's end."""
    with socket.create_connection(server.server_address[:2], timeout=wait) as s:
        s.sendall(request)
        return s.makefile("rb").read()


def _status_and_error(reply: bytes) -> tuple[bytes, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)["error"]


def _post_raw(server, headers: str, body: bytes = b'{"text":"a cat"}') -> bytes:
    return _raw(server, f"POST /api/attention HTTP/1.1\r\n{headers}Content-Length: {len(body)}\r\n\r\n".encode()
                + body)


def test_requests_for_another_host_are_refused(server, caplog):
    port = server.server_address[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        assert _raw(server, f"GET /api/info HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()).startswith(b"HTTP/1.0 200")
    with caplog.at_level("INFO", logger="qkv"):
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", f"127.0.0.2:{port}", ""):
            for request in (f"GET /api/info HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
                            f"POST /api/attention HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n\r\n{{}}".encode()):
                status, error = _status_and_error(_raw(server, request))
                assert status == b"HTTP/1.0 403 Forbidden"
                assert error == (f"this server answers requests for http://127.0.0.1:{port} only, not for Host "
                                 f"{host!r}: open http://127.0.0.1:{port}/")
    status, error = _status_and_error(_raw(server, b"GET / HTTP/1.0\r\n\r\n"))  # no Host at all
    assert status == b"HTTP/1.0 403 Forbidden" and "not for Host ''" in error
    assert "Traceback" not in caplog.text and "403 this server answers requests for" in caplog.text


def test_a_server_bound_to_every_interface_takes_ip_addresses_but_no_names():
    srv = make_server(Explorer(_run, {"model": "m", "kind": "encoder", "example": ""}), "0.0.0.0", 0)
    port = srv.server_address[1]
    assert srv.accepts(f"192.168.1.20:{port}") and srv.accepts(f"localhost:{port}")
    assert not srv.accepts(f"rebound.example:{port}") and not srv.accepts(f"192.168.1.20:{port + 1}")
    srv.server_close()


def test_posts_from_other_sites_are_refused(server):
    port = server.server_address[1]
    host = f"Host: 127.0.0.1:{port}\r\n"
    for origin in ("", f"Origin: http://127.0.0.1:{port}\r\n", f"Origin: http://localhost:{port}\r\n"):
        assert _post_raw(server, host + origin).startswith(b"HTTP/1.0 200")
    for origin in ("http://evil.example", "null", f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):
        status, error = _status_and_error(_post_raw(server, host + f"Origin: {origin}\r\n"))
        assert status == b"HTTP/1.0 403 Forbidden"
        assert error == (f"requests sent by the page at {origin!r} are refused: the explorer answers its own "
                         f"page, http://127.0.0.1:{port}/")


@pytest.mark.parametrize("length", ["-1", "+16", "1_6", "16.0", "0x10", "sixteen", ""])
def test_a_content_length_that_is_not_a_count_of_bytes_is_refused_unread(server, length):
    host = f"Host: 127.0.0.1:{server.server_address[1]}\r\n".encode()
    body = b'{"text":"a cat"}' + b" " * (MAX_BODY + 2_000_000)  # more than the bound: the server must not read it
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        s.sendall(b"POST /api/attention HTTP/1.1\r\n" + host + f"Content-Length: {length}\r\n\r\n".encode())
        s.sendall(body[:65536])
        reply = s.makefile("rb").read()
    status, error = _status_and_error(reply)
    assert status == b"HTTP/1.0 400 Bad Request"
    assert error == f"Content-Length must be one number of bytes, got {length!r}"
    two = _raw(server, b"POST /api/attention HTTP/1.1\r\n" + host + b"Content-Length: 2\r\nContent-Length: 9\r\n"
               b"\r\n{}")
    assert _status_and_error(two) == (b"HTTP/1.0 400 Bad Request", "Content-Length must be one number of bytes, "
                                                                    "got '2, 9'")
    huge = _raw(server, b"POST /api/attention HTTP/1.1\r\n" + host + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n")
    assert _status_and_error(huge) == (b"HTTP/1.0 413 Request Entity Too Large", f"the request is {'9' * 5000} bytes; "
                                       f"at most {MAX_BODY}: send a shorter text")


def test_a_client_that_stalls_is_answered_408_and_let_go(server):
    server.RequestHandlerClass.timeout = 0.5
    host = f"Host: 127.0.0.1:{server.server_address[1]}\r\n"
    start = time.monotonic()
    reply = _raw(server, f"POST /api/attention HTTP/1.1\r\n{host}Content-Length: 1000\r\n\r\n".encode()
                 + b'{"text":"a ca', wait=5)
    assert _status_and_error(reply) == (b"HTTP/1.0 408 Request Timeout", "the request's body did not arrive within "
                                                                        "0.5 s (13 of 1000 bytes came)")
    assert _raw(server, b"GET / HTTP/1.1\r\n", wait=5) == b""  # headers never finished: the connection is closed
    assert _raw(server, b"", wait=5) == b""
    assert time.monotonic() - start < 4
    with socket.create_connection(server.server_address[:2], timeout=5) as s:  # a body cut short by its sender
        s.sendall(f"POST /api/attention HTTP/1.1\r\n{host}Content-Length: 20\r\n\r\n{{}}".encode())
        s.shutdown(socket.SHUT_WR)
        short = s.makefile("rb").read()
    assert _status_and_error(short) == (b"HTTP/1.0 400 Bad Request", "the request ended after 2 of its 20 bytes")


@pytest.mark.parametrize("request_line, status, error", [
    (b"GET / HTTP/9.9", b"HTTP/1.0 505 HTTP Version Not Supported", "Invalid HTTP version (9.9)"),
    (b"GET / HTTP/x.y", b"HTTP/1.0 400 Bad Request", "Bad request version ('HTTP/x.y')"),
    (b"hello world", b"HTTP/1.0 400 Bad Request", "Bad HTTP/0.9 request type ('hello')"),
    (b"PUT /api/attention HTTP/1.1", b"HTTP/1.0 501 Not Implemented", "Unsupported method ('PUT')"),
])
def test_a_request_line_the_server_does_not_speak_gets_a_status_and_a_json_error(server, request_line, status,
                                                                                 error):
    reply = _raw(server, request_line + b"\r\nHost: 127.0.0.1:%d\r\n\r\n" % server.server_address[1])
    assert _status_and_error(reply) == (status, error)
    assert _post(server, {"text": "still here"})[0] == 200


def test_deep_json_and_lone_surrogates_are_the_requests_fault(server, caplog):
    with caplog.at_level("INFO", logger="qkv"):
        status, answer = _post(server, b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert (status, answer["error"]) == (400, 'the request\'s JSON is nested too deeply; send {"text": "..."}')
        status, answer = _post(server, b'{"text": "a \\ud800 cat"}')
        assert (status, answer["error"]) == (400, "the text holds a lone surrogate (U+D800 at character 2), which is "
                                                  "not a character: send valid Unicode")
    assert "Traceback" not in caplog.text and len(caplog.records) == 2


def test_an_image_bomb_is_the_requests_fault(vit_dir, monkeypatch, caplog):
    import base64
    import io

    import torch
    from PIL import Image

    from qkv.checkpoint import load_checkpoint
    from qkv.cli.explore import _image_explorer

    run, info = _image_explorer(load_checkpoint(vit_dir), "vit", torch.device("cpu"))
    srv = make_server(Explorer(run, info), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # a 50x50 image stands for one of gigapixels
    buffer = io.BytesIO()
    Image.new("L", (50, 50)).save(buffer, "PNG")
    try:
        with caplog.at_level("INFO", logger="qkv"):
            status, answer = _post(srv, {"image": "data:image/png;base64," + base64.b64encode(buffer.getvalue())
                                         .decode()})
        assert status == 400 and answer["error"].startswith("the upload: the image is too large to decode safely")
        assert "Traceback" not in caplog.text and len(caplog.records) == 1
        buffer = io.BytesIO()
        Image.new("L", (8, 8)).save(buffer, "PNG")
        assert _post(srv, {"image": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()})[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_model_failure_is_one_log_line_without_a_traceback(server, caplog):
    with caplog.at_level("INFO", logger="qkv"):
        assert _post(server, {"text": "boom"})[0] == 500
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "Traceback" not in caplog.text
    assert "500 the model failed on this input: RuntimeError: the model broke" in caplog.text


def test_an_ipv6_loopback_server_answers():
    """`qkv explore --host ::1` lists ::1 as a local host, so it must be able to bind it."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        srv = make_server(Explorer(_run, {"model": "m", "kind": "encoder", "example": ""}), "::1", 0)
    except OSError as err:
        if "Cannot assign" in str(err) or "not available" in str(err):
            pytest.skip(f"IPv6 loopback not configured: {err}")
        raise
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        with socket.create_connection(("::1", port), timeout=10) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: [::1]:{port}\r\nConnection: close\r\n\r\n".encode())
            assert s.recv(64).startswith(b"HTTP/1.0 200")
        assert srv.home == f"http://[::1]:{port}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("body, error", [
    (b'{"text": "a cat", "n": ' + b"9" * 100_000 + b"}", "the request holds a number of 100000 digits; at most 100:"),
    (b'{"text": "a cat", "n": -' + b"9" * 5_000 + b"}", "the request holds a number of 5000 digits; at most 100:"),
    (b"9" * 4_301, "the request holds a number of 4301 digits; at most 100:"),
    (b'{"text": "a cat", "n": NaN}', "the request is not JSON (NaN is not a JSON value);"),
    (b'{"text": "a cat", "n": -Infinity}', "the request is not JSON (-Infinity is not a JSON value);"),
], ids=["100000-digits", "negative-5000-digits", "a-bare-4301-digits", "NaN", "-Infinity"])
def test_numbers_json_or_int_cannot_hold_are_the_requests_fault_not_the_models(server, caplog, body, error):
    """Python's int() refuses more than 4300 digits with a ValueError of its own: read while parsing, it was
    answered 500, "the model failed on this input", though the model never ran."""
    with caplog.at_level("INFO", logger="qkv"):
        status, answer = _post(server, body)
    assert (status, answer["error"]) == (400, error + ' send {"text": "..."}')
    assert ": 500 " not in caplog.text and "Traceback" not in caplog.text
    assert _post(server, {"text": "a cat", "n": 10**99, "x": -1.5e300}) == _post(server, {"text": "a cat"})


def test_a_request_with_two_host_or_origin_headers_is_refused(server, caplog):
    """Which of two Host headers counts differs between servers and proxies: a rebinding page could pass the check
    with one and be routed by the other. Neither is read."""
    port = server.server_address[1]
    good, evil = f"127.0.0.1:{port}", f"evil.example:{port}"
    with caplog.at_level("INFO", logger="qkv"):
        for first, second in ((good, evil), (evil, good), (good, good)):
            for request in (f"GET /api/info HTTP/1.1\r\nHost: {first}\r\nhost: {second}\r\n\r\n".encode(),
                            _post_request(f"Host: {first}\r\nHOST: {second}\r\n")):
                assert _status_and_error(_raw(server, request)) == (b"HTTP/1.0 400 Bad Request",
                                                                    "the request has 2 Host headers; send one")
        two_origins = f"Host: {good}\r\nOrigin: http://{good}\r\nOrigin: http://evil.example\r\n"
        assert _status_and_error(_post_raw(server, two_origins)) == (b"HTTP/1.0 400 Bad Request",
                                                                      "the request has 2 Origin headers; send one")
    assert "Traceback" not in caplog.text
    assert _post_raw(server, f"Host: {good}\r\nOrigin: http://{good}\r\n").startswith(b"HTTP/1.0 200")


def _post_request(headers: str, body: bytes = b'{"text":"a cat"}') -> bytes:
    return f"POST /api/attention HTTP/1.1\r\n{headers}Content-Length: {len(body)}\r\n\r\n".encode() + body
