"""The explorer's local web server: the page, what model it explores, and one model run per request.

    GET  /                the page (:func:`qkv.explore.page` with no result)
    GET  /api/info        {"model", "kind", "example", "max_chars", "input_label"}
    POST /api/attention   {"text": "..."} (an image model: {"image": "data:image/png;base64,..."})
                          -> a result (:mod:`qkv.explore.results`), or {"error": "..."}

Python's ``ThreadingHTTPServer`` answers requests concurrently, one thread each; the model is loaded once and
runs one input at a time (a lock), so a second visitor waits for the first one's run instead of failing. A bad
request (no body, a body too large, not JSON, no text, an empty or too long text) gets a 4xx status and a
one-line ``{"error": ...}``; a failure inside the model gets 500 and the same; the server goes on serving either
way. It listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .page import page
from .results import InputError

log = logging.getLogger("qkv")

MAX_CHARS = 2000  # longest text a request may carry (the token limit of .results applies after)
MAX_BODY = 4 * 1024 * 1024  # bytes (an image travels base64-encoded)


@dataclass
class Explorer:
    """What the server explores: ``run(text) -> result`` and the page's ``info``."""

    run: Callable[[str | bytes], dict[str, Any]]  # text, or an image file's bytes when info["kind"] is "image"
    info: dict[str, Any]

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.info = {"max_chars": MAX_CHARS, **self.info}
        self.html = page(None, f"qkv explore: {self.info['model']}").encode("utf-8")

    def answer(self, body: bytes) -> dict[str, Any]:
        """The result for a request body; raises :class:`InputError` for a bad one."""
        try:
            request = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"the request is not JSON ({err}); send {{\"text\": \"...\"}}") from None
        if self.info["kind"] == "image":
            return self._run(_image_bytes(request))
        if not isinstance(request, dict) or not isinstance(request.get("text"), str):
            raise InputError('the request needs a "text" string: send {"text": "..."}')
        text = request["text"].strip()
        if not text:
            raise InputError("the text is empty: type a sentence")
        if len(text) > MAX_CHARS:
            raise InputError(f"the text is {len(text)} characters long; at most {MAX_CHARS}: shorten it")
        return self._run(text)

    def _run(self, value: str | bytes) -> dict[str, Any]:
        with self.lock:
            return self.run(value)


def _image_bytes(request: Any) -> bytes:
    """The file in a request ``{"image": "data:image/png;base64,..."}``."""
    value = request.get("image") if isinstance(request, dict) else None
    if not isinstance(value, str) or not value.startswith("data:image/") or "," not in value:
        raise InputError('the request needs an "image": a data URL of a PNG or JPEG (data:image/png;base64,...)')
    try:
        return base64.b64decode(value.split(",", 1)[1], validate=True)
    except binascii.Error:
        raise InputError("the image's data URL is not valid base64") from None


class _Handler(BaseHTTPRequestHandler):
    explorer: Explorer  # set on the subclass that serve() makes
    server_version = "qkv-explore"

    def do_GET(self) -> None:
        if self.path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, self.explorer.html, "text/html; charset=utf-8")
        elif self.path == "/api/info":
            self._json(HTTPStatus.OK, self.explorer.info)
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {self.path}: open / for the explorer"})

    def do_POST(self) -> None:
        if self.path != "/api/attention":
            self._json(HTTPStatus.NOT_FOUND, {"error": f"nothing to POST to at {self.path}: use /api/attention"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._json(HTTPStatus.LENGTH_REQUIRED, {"error": "the request has no Content-Length"})
            return
        if length > MAX_BODY:
            self.close_connection = True  # the body is not read: this connection cannot carry another request
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       {"error": f"the request is {length} bytes; at most {MAX_BODY}: send a shorter text"})
            return
        try:
            result = self.explorer.answer(self.rfile.read(length))
        except InputError as err:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
            return
        except Exception as err:  # the model failed on this input: say so, keep serving
            log.exception("explore: the model failed")
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                       {"error": f"the model failed on this input: {type(err).__name__}: {err}"})
            return
        self._json(HTTPStatus.OK, result)  # a client gone by now is the server's handle_error's business

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("explore: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # Ctrl-C does not wait for open connections

    def handle_error(self, request, client_address) -> None:
        # a browser that closed the connection before the answer was written (a reload): one line, no traceback
        log.info("explore: a request from %s ended early: %s", client_address[0], sys.exc_info()[1])


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server for ``explorer`` bound to ``host:port`` (port 0: any free one), not yet serving.

    Raises:
        OSError: one line, when the port is taken or the host cannot be bound.
    """
    handler = type("Handler", (_Handler,), {"explorer": explorer})
    try:
        server = _Server((host, port), handler)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is taken (another qkv explore?): choose another with --port, or "
                          "--port 0 for any free one") from None
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return server
