"""The explorer's local web server: the page, what model it explores, and one model run per request.

    GET  /                the page (:func:`qkv.explore.page` with no result)
    GET  /api/info        {"model", "kind", "example", "max_chars", "input_label"}
    POST /api/attention   {"text": "..."} (an image model: {"image": "data:image/png;base64,..."})
                          -> a result (:mod:`qkv.explore.results`), or {"error": "..."}

Python's ``ThreadingHTTPServer`` answers requests concurrently, one thread each; the model is loaded once and runs
one input at a time (a lock), so a second visitor waits for the first one's run instead of failing. A bad request
(no body, a body too large, not JSON, a number of more digits than any request needs, no text, an empty or too long
text, a header sent twice) gets a 4xx status and a one-line ``{"error": ...}``; a failure inside the model gets 500
and the same; the server goes on serving either way, with one log line per refusal. It listens on 127.0.0.1 unless
told otherwise.

Other sites cannot use it: a request must name the server, once (``Host``: a loopback name or the host it was
started with, and its port; a DNS name rebound to 127.0.0.1 does not), and a POST that a page sends must come from
the server's own page (``Origin``). A request must arrive whole within ``timeout`` seconds, and no more than
``MAX_BODY`` bytes of it are read.
"""

from __future__ import annotations

import base64
import errno
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
import time
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
MAX_DIGITS = 100  # longest integer in a request's JSON (none of its fields is a number; int() stops at 4300)


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
        request = _parsed(body)
        if self.info["kind"] == "image":
            return self._run(_image_bytes(request))
        if not isinstance(request, dict) or not isinstance(request.get("text"), str):
            raise InputError('the request needs a "text" string: send {"text": "..."}')
        text = request["text"].strip()
        if not text:
            raise InputError("the text is empty: type a sentence")
        if len(text) > MAX_CHARS:
            raise InputError(f"the text is {len(text)} characters long; at most {MAX_CHARS}: shorten it")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON's \ud800 escapes decode to half a character, which no model reads
            raise InputError(f"the text holds a lone surrogate (U+{ord(text[err.start]):04X} at character "
                             f"{err.start}), which is not a character: send valid Unicode") from None
        return self._run(text)

    def _run(self, value: str | bytes) -> dict[str, Any]:
        with self.lock:
            return self.run(value)


def _parsed(body: bytes) -> Any:
    """The request's JSON value, every error in it the request's (an :class:`InputError`): not UTF-8, not JSON
    (``NaN`` and ``Infinity`` are not), nested too deeply, or a number longer than any a request needs, which
    ``int()`` would refuse with a ValueError of its own (past 4300 digits) or spend its time on."""
    try:
        return json.loads(body.decode("utf-8"), parse_int=_integer, parse_constant=_not_json)
    except InputError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"the request is not JSON ({err}); send {{\"text\": \"...\"}}") from None
    except RecursionError:
        raise InputError('the request\'s JSON is nested too deeply; send {"text": "..."}') from None


def _integer(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise InputError(f"the request holds a number of {len(digits.lstrip('-'))} digits; at most {MAX_DIGITS}: "
                         'send {"text": "..."}')
    return int(digits)


def _not_json(constant: str) -> Any:
    raise InputError(f"the request is not JSON ({constant} is not a JSON value); send {{\"text\": \"...\"}}")


def _image_bytes(request: Any) -> bytes:
    """The file in a request ``{"image": "data:image/png;base64,..."}``."""
    value = request.get("image") if isinstance(request, dict) else None
    if not isinstance(value, str) or not value.startswith("data:image/") or "," not in value:
        raise InputError('the request needs an "image": a data URL of a PNG or JPEG (data:image/png;base64,...)')
    try:
        return base64.b64decode(value.split(",", 1)[1], validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise InputError("the image's data URL is not valid base64") from None


class _Handler(BaseHTTPRequestHandler):
    explorer: Explorer  # set on the subclass that serve() makes
    server: _Server
    server_version = "qkv-explore"
    # An error found before the request line's version is read (a garbled line, HTTP/9.9) is still answered with a
    # status line: as HTTP/0.9, the default, it would be a bare page the client cannot tell from an answer.
    default_request_version = "HTTP/1.0"
    timeout = 10.0  # seconds a client has to send its request, body included: a stalled one frees its thread

    def do_GET(self) -> None:
        if not self._host_allowed():
            return
        if self.path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, self.explorer.html, "text/html; charset=utf-8")
        elif self.path == "/api/info":
            self._json(HTTPStatus.OK, self.explorer.info)
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no page {self.path}: open / for the explorer")

    def do_POST(self) -> None:
        if not (self._host_allowed() and self._origin_allowed()):
            return
        if self.path != "/api/attention":
            self._error(HTTPStatus.NOT_FOUND, f"nothing to POST to at {self.path}: use /api/attention", close=True)
            return
        length = self._content_length()
        body = None if length is None else self._read_body(length)
        if body is None:
            return
        try:
            result = self.explorer.answer(body)
        except InputError as err:
            self._error(HTTPStatus.BAD_REQUEST, str(err))
            return
        except Exception as err:  # the model failed on this input: say so, keep serving
            log.debug("explore: the model failed", exc_info=True)  # the line _error logs is the user's; this is ours
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"the model failed on this input: {type(err).__name__}: {err}")
            return
        self._json(HTTPStatus.OK, result)  # a client gone by now is the server's handle_error's business

    def _host_allowed(self) -> bool:
        """Refuse a request for another host name: a page that a DNS name rebound to 127.0.0.1 could reach the
        server otherwise, as if it were on the same site."""
        if self._repeated("Host", "Origin"):
            return False
        host = self.headers.get("Host", "")
        if self.server.accepts(host):
            return True
        self._error(HTTPStatus.FORBIDDEN, f"this server answers requests for {self.server.home} only, not for "
                                          f"Host {host!r}: open {self.server.home}/", close=True)
        return False

    def _origin_allowed(self) -> bool:
        """Refuse a POST sent by a page of another site (a cross-site form or fetch); the explorer's own page
        sends its origin, a script or curl none. ``null`` (a page opened from a file, a sandbox) is refused too:
        the exported pages do not call the server."""
        origin = self.headers.get("Origin")
        if origin is None or (origin.startswith("http://") and self.server.accepts(origin[len("http://"):])):
            return True
        self._error(HTTPStatus.FORBIDDEN, f"requests sent by the page at {origin!r} are refused: the explorer "
                                          f"answers its own page, {self.server.home}/", close=True)
        return False

    def _repeated(self, *names: str) -> bool:
        """Refuse a request that sends one of the headers ``names`` more than once (True once answered): which of
        the values counts differs between servers, proxies and checks, so neither is trusted."""
        for name in names:
            n = len(self.headers.get_all(name) or ())
            if n > 1:
                self._error(HTTPStatus.BAD_REQUEST, f"the request has {n} {name} headers; send one", close=True)
                return True
        return False

    def _content_length(self) -> int | None:
        """The announced body size, or None once a bad one is answered (the body is then left unread)."""
        values = self.headers.get_all("Content-Length") or []
        if not values:
            self._error(HTTPStatus.LENGTH_REQUIRED, "the request has no Content-Length", close=True)
            return None
        value = values[0].strip()
        if len(values) > 1 or not re.fullmatch(r"[0-9]+", value, re.ASCII):  # int() takes "-1", "+1", "1_0", "١"
            self._error(HTTPStatus.BAD_REQUEST, f"Content-Length must be one number of bytes, got "
                                                f"{', '.join(values)!r}", close=True)
            return None
        if len(value) > len(str(MAX_BODY)) or int(value) > MAX_BODY:  # int() of 5,000 digits is an error
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the request is {value} bytes; at most {MAX_BODY}: send a shorter text", close=True)
            return None
        return int(value)

    def _read_body(self, length: int) -> bytes | None:
        """The body, read within ``timeout`` seconds in all (not per packet, which a trickle could stretch without
        end), or None once a late or short one is answered."""
        body, deadline = bytearray(), time.monotonic() + self.timeout
        try:
            while len(body) < length:
                self.connection.settimeout(max(deadline - time.monotonic(), 1e-3))
                piece = self.rfile.read1(length - len(body))
                if not piece:
                    break
                body += piece
        except TimeoutError:
            self._error(HTTPStatus.REQUEST_TIMEOUT, f"the request's body did not arrive within {self.timeout:g} s "
                                                    f"({len(body)} of {length} bytes came)", close=True)
            return None
        finally:
            self.connection.settimeout(self.timeout)
        if len(body) < length:
            self._error(HTTPStatus.BAD_REQUEST, f"the request ended after {len(body)} of its {length} bytes",
                        close=True)
            return None
        return bytes(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a garbled request line, an HTTP version it does not speak, a method it
        lacks), answered as one-line JSON like every other error."""
        self._error(HTTPStatus(code), message or HTTPStatus(code).phrase, close=True)

    def _error(self, status: HTTPStatus, message: str, *, close: bool = False) -> None:
        """One log line and ``{"error": message}``; ``close``: the connection cannot carry another request (its
        body was not read)."""
        log.log(logging.WARNING if status >= 500 else logging.INFO, "explore: %s %s from %s: %d %s",
                self.command or "?", getattr(self, "path", ""), self.client_address[0], status, message)
        if close:
            self.close_connection = True
        self._json(status, {"error": message})

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        # "replace": a lone surrogate in a model's output or an echoed input must not stop the answer
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
        self._send(status, body, "application/json; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("explore: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # Ctrl-C does not wait for open connections
    hosts: frozenset[str]  # the Host values it answers (see make_server)
    home: str  # its address, as a browser opens it

    def accepts(self, host: str) -> bool:
        """Whether ``host`` (a Host header, or an Origin without its ``http://``) names this server: a loopback
        name or the name it was started with, and its port. Bound to every interface, any IP address with its
        port is one too; a DNS name never is, so a rebound name is still refused."""
        host = host.strip().lower()
        if host in self.hosts:
            return True
        name, _, port = host.rpartition(":")
        if self.server_address[0] not in ("0.0.0.0", "::") or port != str(self.server_address[1]):
            return False
        try:
            ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
        except ValueError:
            return False
        return True

    def handle_error(self, request, client_address) -> None:
        # a browser that closed the connection before the answer was written (a reload): one line, no traceback
        log.info("explore: a request from %s ended early: %s", client_address[0], sys.exc_info()[1])


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server for ``explorer`` bound to ``host:port`` (port 0: any free one), not yet serving.

    Raises:
        OSError: one line, when the port is taken or the host cannot be bound.
    """
    handler = type("Handler", (_Handler,), {"explorer": explorer})
    # an IPv6 address (::1) needs an IPv6 socket; the class attribute is read when the socket is made
    server_class = type("Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
    try:
        server = server_class((host, port), handler)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is taken (another qkv explore?): choose another with --port, or "
                          "--port 0 for any free one") from None
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    bound, port = server.server_address[:2]
    names = {"127.0.0.1", "localhost", "::1", host.lower(), bound}
    netlocs = {f"[{n}]" if ":" in n else n for n in names if n}
    server.hosts = frozenset({f"{n}:{port}" for n in netlocs} | (netlocs if port == 80 else set()))
    shown = "127.0.0.1" if bound in ("0.0.0.0", "::") else f"[{bound}]" if ":" in bound else bound
    server.home = f"http://{shown}:{port}"
    return server
