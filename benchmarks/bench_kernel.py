"""qkv's int4 × int8 kernel (qkv.kernels) against PyTorch's int4 kernel: one product's time at the shapes of
SmolLM2-135M's and a 1.7B model's layers, one input row (a decoding step), each variant the CPU runs on the
layers' interleaved rows, and the best one on the same rows one after the other (GGUF's order); and
SmolLM2-135M-Instruct's perplexity on tinyshakespeare through each (the cost of int8 activations).

    python benchmarks/bench_kernel.py [--repeats 200] [--skip-products] [--skip-k-quants] [--skip-perplexity]
        [--llama-cpp BUILD/bin] [--step FILE.gguf]

The products alternate, in one process, after a warm-up; medians of ``--rounds`` rounds. Perplexity on
llama-perplexity's measure (the first 20,000 characters of ``../shared/data/tinyshakespeare/input.txt``, chunks
of 128 tokens each scored on its second half): fp32 weights, then int4 as stored (Q4_1) through each kernel
(``QKV_KERNEL``), and llama.cpp's own with ``--llama-cpp``. With ``--step FILE``: one decoding step's 4-bit
products of that model (read with ``load_pretrained``), its layers' interleaved rows against the same rows one after
the other, alternating, ``--rounds`` × 3 rounds: the weights stream from memory, as in decoding. The K-quant part:
GGUF's Q6_K and Q5_K blocks as stored (random blocks) against int8 blocks (what they are quantized to when not held
as stored), each variant, one input row, at the shapes of a 1.7B model's layers, then streamed from memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from qkv import kernels
from qkv.kernel_layers import KernelInt4Linear
from qkv.perplexity import perplexity as measured
from qkv.quantized import Int4Linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (2048, 6144), (2048, 16384), (8192, 2048)]
CHUNK = 128  # tokens per chunk of the perplexity
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _us(f, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return 1e6 * (time.perf_counter() - start) / repeats


ROWS = "best, rows in order"  # the column of the Q4 layout (the weights' rows one after the other)


def _calls(inputs: int, outputs: int) -> dict:
    """One product of each kernel at this shape, one input row: PyTorch's int4 layer, then each variant of qkv's
    that the CPU runs, on the same weights; then the best variant on them in the Q4 layout."""
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    theirs, ours = Int4Linear.from_linear(linear, group_size=32), KernelInt4Linear.from_linear(linear)
    x = torch.randn(1, inputs)
    calls = {"pytorch-int4": functools.partial(theirs, x)}
    blocks = (ours.codes, ours.group_scales, ours.offsets)
    for number, variant in enumerate(kernels.VARIANTS):
        if kernels.runs(variant):
            calls[variant] = functools.partial(kernels.linear, x, *blocks, rows=outputs, variant=number)
    codes, scales, offsets = kernels.read_rows(*blocks, torch.arange(outputs))
    in_order = (codes.reshape(outputs, -1).contiguous(), scales.contiguous(), offsets.contiguous())
    calls[ROWS] = functools.partial(kernels.linear, x, *in_order)
    return calls


def products(repeats: int, rounds: int) -> None:
    names = ["pytorch-int4", *kernels.VARIANTS, ROWS]
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


SHAPES_K = [(2048, 2048), (2048, 8192), (8192, 2048), (2048, 49152)]  # inputs a multiple of 256


def k_quant_weights(inputs: int, outputs: int, g: torch.Generator) -> dict[int, tuple]:
    """Random Q6_K and Q5_K rows as the kernel holds them, and the Q6_K weights as int8 blocks: buffers by bits."""
    from qkv.interop.ggml_blocks import q5_k_blocks, q6_k_blocks
    from qkv.kernel_layers import KernelInt8Linear, q6_weights

    def raw(size: int, at: int, halves: int) -> torch.Tensor:
        blocks = torch.randint(0, 256, (outputs, inputs // 256, size), dtype=torch.uint8, generator=g)
        scales = (torch.randn(outputs, inputs // 256, halves, generator=g) * 1e-3).half()
        blocks[..., at : at + 2 * halves] = scales.view(torch.uint8)
        return blocks.view(outputs, -1).numpy()

    q, d, sub = q6_k_blocks(raw(210, 208, 1))
    six = (kernels.q6_codes(q), d, sub)
    q, dm, sc, mins = q5_k_blocks(raw(176, 0, 2))
    eight = KernelInt8Linear.encoded(q6_weights(*six))
    return {6: six, 5: (kernels.q5_codes(q), dm, torch.stack([sc, mins], 1).contiguous()),
            8: (eight["codes"], eight["scales"].half())}


def k_quants(repeats: int, rounds: int) -> None:
    """Q6_K and Q5_K blocks as stored against int8 blocks (Q8_0's form, Q6_K's weights), one input row, per
    variant: from the caches at a 1.7B model's shapes, then streamed from memory."""
    g = torch.Generator().manual_seed(0)
    print("6-bit and 5-bit (Q6_K, Q5_K as stored) against 8-bit (int8 blocks), one input row:")
    for inputs, outputs in SHAPES_K:
        weights = k_quant_weights(inputs, outputs, g)
        x = torch.randn(1, inputs)
        calls = {f"{variant} {bits}-bit": functools.partial(kernels.linear, x, *w, rows=outputs, variant=number)
                 for number, variant in enumerate(kernels.VARIANTS) if kernels.runs(variant)
                 for bits, w in weights.items()}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for f in calls.values():
            _us(f, 3)
        for _ in range(rounds):
            for k, f in calls.items():
                times[k].append(_us(f, max(1, repeats // 10)))
        print(f"{inputs:>8} x {outputs:<7}  " + "  ".join(
            f"{k} {statistics.median(t):7.0f} us" for k, t in times.items()))
    streamed(weights, rounds)


def streamed(weights: dict[int, tuple], rounds: int, layers: int = 24) -> None:
    """One product of each of ``layers`` copies of the last shape's weights, one after the other, as a decoding step
    reads a model's layers: far more bytes than a cache holds (24 x 2,048 x 49,152: 1.9 GB as Q6_K), so the
    weights come from memory."""
    outputs, inputs = weights[8][0].shape
    copies = {bits: [tuple(t.clone() for t in w) for _ in range(layers)] for bits, w in weights.items()}
    x = torch.randn(1, inputs)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for number, variant in enumerate(kernels.VARIANTS):
            if variant == "portable" or not kernels.runs(variant):
                continue
            for bits, copied in copies.items():
                start = time.perf_counter()
                for w in copied:
                    kernels.linear(x, *w, rows=outputs, variant=number)
                times.setdefault(f"{variant} {bits}-bit", []).append(1e3 * (time.perf_counter() - start))
    print(f"streamed, {layers} layers of {inputs} x {outputs}: " + "  ".join(
        f"{k} {statistics.median(t):.1f} ms" for k, t in times.items()))


def step(file: str, rounds: int) -> None:
    """Every 4-bit product of one decoding step of ``file``'s model, one input row each, in both layouts."""
    from qkv.interop import load_pretrained

    model = load_pretrained(file).model
    layouts: dict[str, list] = {"interleaved rows": [], "rows in order": []}
    for layer in model.modules():
        if isinstance(layer, KernelInt4Linear):
            blocks, rows = (layer.codes, layer.group_scales, layer.offsets), layer.out_features
            codes, scales, offsets = kernels.read_rows(*blocks, torch.arange(rows))
            x = torch.randn(1, layer.in_features)
            layouts["interleaved rows"].append(functools.partial(kernels.linear, x, *blocks, rows=rows))
            layouts["rows in order"].append(functools.partial(kernels.linear, x, codes.reshape(rows, -1).contiguous(),
                                                              scales.contiguous(), offsets.contiguous()))
    times: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(3 * rounds):
        for name, calls in layouts.items():
            start = time.perf_counter()
            for call in calls:
                call()
            times[name].append(time.perf_counter() - start)
    print(f"{file}: {len(layouts['rows in order'])} products a step: " + ", ".join(
        f"{name} {1e3 * statistics.median(t):.2f} ms" for name, t in times.items()))


def perplexity(llama_cpp: Path | None) -> None:
    """llama-perplexity's measure on the first 20,000 characters of tinyshakespeare: chunks of 128 tokens, each
    scored on its second half (SmolLM2 adds no bos token, so the chunks are the text's own tokens)."""
    from qkv.interop import load_pretrained, smollm2_path

    text = TEXT.read_text(encoding="utf-8")[:20000]

    def measure(weights: str) -> float:
        pre = load_pretrained("smollm2", weights=weights)
        return measured(pre.model, pre.tokenizer.encode(text), CHUNK).value

    reference = measure("none")
    print(f"perplexity, fp32 weights: {reference:.4f}")
    kinds = (("qkv's kernel (Q4_1 and Q8_0 as stored, int8 activations)", "qkv"),
             ("PyTorch's kernels (int4 with bf16 scales, int8 per row; bf16 activations)", "torch"))
    for name, env in kinds:
        os.environ["QKV_KERNEL"] = env
        value = measure("auto")
        print(f"perplexity, {name}: {value:.4f} ({100 * (value / reference - 1):+.2f}%)")
    os.environ.pop("QKV_KERNEL")
    if llama_cpp is not None:  # its own process, one thread: this one's PyTorch threads would steal its cores
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            run = subprocess.run([llama_cpp / "llama-perplexity", "-m", smollm2_path(), "-f", f.name, "-c",
                                  str(CHUNK), "-b", str(CHUNK), "-t", "1"], capture_output=True, text=True)
        found = re.search(r"Final estimate: PPL = ([\d.]+)", run.stdout + run.stderr)
        print(f"perplexity, llama.cpp (its Q4_1 x Q8_1): {found[1] if found else 'not printed'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--skip-k-quants", action="store_true")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--step", metavar="FILE", help="a GGUF file: one decoding step's products in both layouts")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin, for llama-perplexity beside qkv's")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(kernels.why_not())
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, best variant "
          f"{kernels.best_variant()}, torch {torch.__version__}, {date.today()}")
    if not args.skip_products:
        products(args.repeats, args.rounds)
    if not args.skip_k_quants:
        k_quants(args.repeats, args.rounds)
    if args.step:
        step(args.step, args.rounds)
    if not args.skip_perplexity:
        perplexity(args.llama_cpp)


if __name__ == "__main__":
    main()
