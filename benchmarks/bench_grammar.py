"""Constrained decoding's cost per token on qkv's tokenizers: llguidance against xgrammar, the two libraries that turn a
JSON schema into a mask of the tokens that may come next (llama.cpp, vLLM and SGLang use one or the other).

    python benchmarks/bench_grammar.py [--repeats 5]

For SmolLM2's byte-level BPE (49,152 tokens, from its GGUF file through qkv's tokenizer), a JSON schema of the kind
applications send (an object with a string, an integer, an enum, a boolean and an array of objects) is compiled by
each library, then a valid instance is walked token by token: at each step the library computes the mask, then
takes the token. Printed: the compile time, and the median and 90th percentile of a mask's time. xgrammar needs
triton and transformers besides its wheel (``pip install xgrammar``); llguidance needs nothing.

Nothing here is a test: the numbers depend on the machine, only the ratios travel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {
            "key": {"type": "string"}, "weight": {"type": "number"}}, "required": ["key", "weight"]}},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "editor", "active": True,
            "tags": [{"key": "math", "weight": 0.9}, {"key": "engines", "weight": 0.75},
                     {"key": "poetry", "weight": 0.1}]}


def _times(compile_fn, step_fns, tokens: list[int]) -> dict[str, float]:
    start = time.perf_counter()
    state = compile_fn()
    compiled = time.perf_counter() - start
    mask, take = step_fns(state)
    steps = []
    for token in tokens:
        start = time.perf_counter()
        mask()
        steps.append(time.perf_counter() - start)
        take(token)
    steps.sort()
    return {"compile_ms": compiled * 1e3, "median_us": statistics.median(steps) * 1e6,
            "p90_us": steps[int(0.9 * (len(steps) - 1))] * 1e6}


def llguidance_run(tokenizer, tokens: list[int]) -> dict[str, float]:
    import llguidance

    lltok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def compile_fn():
        return llguidance.LLMatcher(lltok, grammar)

    def steps(matcher):
        def take(token):
            if not matcher.consume_token(token):
                raise AssertionError(f"llguidance refused token {token}: {matcher.get_error()}")
        return matcher.compute_bitmask, take

    return _times(compile_fn, steps, tokens)


def xgrammar_run(tokenizer, tokens: list[int]) -> dict[str, float]:
    import xgrammar

    vocab = [tokenizer.hf.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=len(vocab),
                                  stop_token_ids=[tokenizer.eos_id])
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))

    def compile_fn():
        compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        return xgrammar.GrammarMatcher(compiled)

    def steps(matcher):
        def take(token):
            if not matcher.accept_token(token):
                raise AssertionError(f"xgrammar refused token {token}")
        return (lambda: matcher.fill_next_token_bitmask(bitmask)), take

    return _times(compile_fn, steps, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from qkv.interop import load_pretrained

    tokenizer = load_pretrained("smollm2").tokenizer
    tokens = tokenizer.encode(json.dumps(INSTANCE))
    print(f"SmolLM2's tokenizer ({tokenizer.vocab_size:,} tokens); an instance of {len(tokens)} tokens")
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        try:
            results = [run(tokenizer, tokens) for _ in range(args.repeats)]
        except ImportError as err:
            print(f"{name}: not installed ({err})")
            continue
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"{name}: compile {med['compile_ms']:.1f} ms; a mask {med['median_us']:.0f} µs (median), "
              f"{med['p90_us']:.0f} µs (90th percentile)")


if __name__ == "__main__":
    main()
