"""Where ``qkv serve`` listens and what a connection may hold: the socket, and uvicorn run within bounds.

A connection costs a file descriptor from the moment it opens, before any Host or API-key check can run. Left to
itself, uvicorn (0.54) keeps one whose request headers never complete for ever (each byte received even puts off
its keep-alive timeout), so a few thousand clients trickling bytes exhaust the process's descriptors and nothing is
answered any more. So, here:

* a request's headers must arrive whole within :data:`HEADER_SECONDS` of the connection opening (or of the answer
  before, on a kept-alive connection), else the connection is closed;
* headers are read up to :data:`HEADER_BYTES` (uvicorn's h11 limit; a larger one is answered 400);
* at most :data:`MAX_CONNECTIONS` connections are open at once: a request on the last one is answered 503
  (uvicorn's ``limit_concurrency``), and one opened beyond it is closed at once, costing its descriptor for no longer
  than that.

The request body has its own limits (:data:`~qkv.serve.app.BODY_SECONDS`, :data:`~qkv.serve.protocol.MAX_BODY`).
:class:`BoundedH11` extends uvicorn's h11 protocol class, which uvicorn does not publish:
``tests/serve/test_limits.py`` fails if a version of uvicorn changes what it relies on.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..files import quoted

HEADER_SECONDS = 10.0  # a request's headers must arrive whole within this
HEADER_BYTES = 16 * 1024  # the most a request's line and headers may take
MAX_CONNECTIONS = 256  # connections open at once (well under the usual 1,024 file descriptors of a process)
KEEP_ALIVE_SECONDS = 5  # an idle connection is closed after this


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port) and listening, so that a client is queued, not refused,
    while the server starts; an address that cannot be had is one line saying why and what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except socket.gaierror as err:  # a name that does not resolve
        sock.close()
        raise OSError(f"--host {quoted(host)} is not a known name or address ({err.strerror}); give one of this "
                      "machine's addresses, such as 127.0.0.1 (this machine only) or 0.0.0.0 (all)") from None
    except OSError as err:
        sock.close()
        raise OSError(_refusal(host, port, err)) from None
    return sock


def _refusal(host: str, port: int, err: OSError) -> str:
    """What an address that could not be bound means, and what to do."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if err.errno == errno.EADDRINUSE:
        return (f"{where} is in use already (another server, or qkv serve still running); stop it, or give another "
                "--port (0: any free one)")
    if err.errno == errno.EADDRNOTAVAIL:
        return f"--host {quoted(host)} is no address of this machine; give one of its own, or 0.0.0.0 for all"
    if err.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 are privileged); give a --port above 1023"
    return f"cannot listen on {where}: {err.strerror or err}"


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection, closed when a request's headers are not whole within ``header_seconds``, or at
    once when more than ``limit_concurrency`` connections are open."""

    header_seconds = HEADER_SECONDS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: Any = None  # the pending close of a connection whose headers are late (an asyncio handle)

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            transport.close()  # beyond the bound: its descriptor freed now, not held
            return
        self._wait_for_headers()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers have come whole (or the connection ended)
            self._cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next request's headers have the same time
            self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        self._cancel()
        self.deadline = self.loop.call_later(self.header_seconds, self._late)

    def _late(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _cancel(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


def config(app: Any, *, header_seconds: float = HEADER_SECONDS, connections: int = MAX_CONNECTIONS) -> uvicorn.Config:
    """uvicorn's configuration of ``app`` with the bounds above (``header_seconds`` and ``connections`` as given)."""
    protocol = type("BoundedH11", (BoundedH11,), {"header_seconds": header_seconds})
    return uvicorn.Config(app, http=protocol, log_level="warning", timeout_keep_alive=KEEP_ALIVE_SECONDS,
                          limit_concurrency=connections, h11_max_incomplete_event_size=HEADER_BYTES)


__all__ = ["HEADER_BYTES", "HEADER_SECONDS", "MAX_CONNECTIONS", "BoundedH11", "config", "listen"]
