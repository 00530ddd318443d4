"""The server's log of requests: one line each on stderr, once its answer has gone (a stream's at its end)::

    qkv: POST /v1/chat/completions 200: prompt 40 tokens, generated 34 tokens, 0.79 s

A request's handler counts its tokens in the request's :class:`Tally` (:func:`tally`); the line is written by
:class:`AccessLog`, which wraps the whole application, so that every request has one, refused ones included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("qkv")


@dataclass
class Tally:
    """The tokens one request read (its prompts) and made (every choice's)."""

    prompt: int = 0
    generated: int = 0


def tally(request: Any) -> Tally:
    """The :class:`Tally` of ``request`` (a Starlette request), to count into; a loose one where the application
    runs without :class:`AccessLog`."""
    return request.scope.get("state", {}).get("tally") or Tally()


class AccessLog:
    """ASGI middleware writing one line per HTTP request: method, path, status, prompt and generated tokens,
    seconds from its arrival to the end of its answer."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted, status, start = Tally(), [0], time.perf_counter()
        scope.setdefault("state", {})["tally"] = counted

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status[0] = status[0] or 500
            raise
        finally:
            path = scope.get("path", "?")[:100]
            log.info("%s %s %s: prompt %d tokens, generated %d tokens, %.2f s", scope.get("method", "?"),
                     path if path.isprintable() else ascii(path), status[0] or "-", counted.prompt,
                     counted.generated, time.perf_counter() - start)


__all__ = ["AccessLog", "Tally", "tally"]
