"""qkv's int4 × int8 kernel (qkv.kernels) against PyTorch's int4 kernel: one product's time at the shapes of
SmolLM2-135M's and a 1.7B model's layers, one input row (a decoding step), each variant the CPU runs; and
SmolLM2-135M-Instruct's perplexity on tinyshakespeare through each (the cost of int8 activations).

    python benchmarks/bench_kernel.py [--repeats 200] [--skip-perplexity]

The products alternate, in one process, after a warm-up; medians of ``--rounds`` rounds. Perplexity: the first
2,048 tokens of ``../shared/data/tinyshakespeare/input.txt`` as 4 rows of 512, fp32 weights, then int4 as stored
(Q4_1) through each kernel (``QKV_INT4_KERNEL=torch`` chooses PyTorch's).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from qkv import kernels
from qkv.kernels.layer import KernelInt4Linear
from qkv.quantize import Int4Linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (2048, 6144), (2048, 16384), (8192, 2048)]
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _us(f, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return 1e6 * (time.perf_counter() - start) / repeats


def _calls(inputs: int, outputs: int) -> dict:
    """One product of each kernel at this shape, one input row: PyTorch's int4 layer, then each variant of qkv's
    that the CPU runs, on the same weights."""
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    theirs, ours = Int4Linear.from_linear(linear, group_size=32), KernelInt4Linear.from_linear(linear)
    x = torch.randn(1, inputs)
    calls = {"pytorch-int4": functools.partial(theirs, x)}
    for number, variant in enumerate(kernels.VARIANTS):
        if kernels.runs(variant):
            calls[variant] = functools.partial(kernels.linear, x, ours.codes, ours.scales, ours.zeros, variant=number)
    return calls


def products(repeats: int, rounds: int) -> None:
    names = ["pytorch-int4", *kernels.VARIANTS]
    print(f"{'inputs x outputs':>18}  " + "  ".join(f"{v:>12}" for v in names))
    for inputs, outputs in SHAPES:
        calls = _calls(inputs, outputs)
        times: dict[str, list[float]] = {k: [] for k in calls}
        with torch.no_grad():
            for f in calls.values():
                _us(f, 10)
            for _ in range(rounds):
                for k, f in calls.items():
                    times[k].append(_us(f, repeats))
        cells = [f"{statistics.median(times[k]):9.0f} us" if k in times else f"{'-':>12}" for k in names]
        print(f"{inputs:>8} x {outputs:<7}  " + "  ".join(cells))


def perplexity() -> None:
    from qkv.interop import load_pretrained

    def measure(weights: str) -> float:
        pre = load_pretrained("smollm2", weights=weights)
        ids = torch.tensor(pre.tokenizer.encode(TEXT.read_text(encoding="utf-8")[:12000])[:2048]).view(4, 512)
        with torch.no_grad():
            logits = pre.model(ids)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return math.exp(nll.item())

    reference = measure("none")
    print(f"perplexity, fp32 weights: {reference:.4f}")
    for name, env in (("qkv's kernel (int8 activations)", None), ("PyTorch's int4 kernel (bf16 activations)", "torch")):
        if env:
            os.environ["QKV_INT4_KERNEL"] = env
        value = measure("auto")
        os.environ.pop("QKV_INT4_KERNEL", None)
        print(f"perplexity, int4 as stored, {name}: {value:.4f} ({100 * (value / reference - 1):+.2f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-perplexity", action="store_true")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(kernels.why_not())
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, best variant "
          f"{kernels.best_variant()}, torch {torch.__version__}, {date.today()}")
    products(args.repeats, args.rounds)
    if not args.skip_perplexity:
        perplexity()


if __name__ == "__main__":
    main()
