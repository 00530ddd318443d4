"""A qkv server answering on a free port of this machine, in a thread: the serving tests' one way to start one.

Imported by name (``from live_server import live``), from any folder of the test tree (see tests/interop/hf_greedy).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

HANG = 60  # seconds: a guard against a hung server, not a measure


@contextmanager
def live(server, **limits):
    """``server`` answering on a free port of 127.0.0.1 in a thread, within ``qkv serve``'s bounds (``limits``: those
    of qkv.serve.connections.config); yields its base URL."""
    import uvicorn

    from qkv.serve.connections import config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    running = uvicorn.Server(config(server.app(), **limits))
    thread = threading.Thread(target=running.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(HANG * 100):
        if running.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        running.should_exit = True
        thread.join(HANG)
