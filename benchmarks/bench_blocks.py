"""Speed of qkv's building blocks beside PyTorch's, in one run, as ratios.

    python benchmarks/bench_blocks.py [--json results.json]

Measures, alternating the contenders and taking medians of several repetitions:
  * the machine's matrix-multiply peak in fp32 and bf16 (the yardstick for FLOP utilisation);
  * attention: qkv fused path, qkv explicit path (softmax(QKᵀ/√d)V written out), nn.MultiheadAttention;
  * an encoder layer forward + backward: qkv EncoderLayer vs nn.TransformerEncoderLayer, fp32 and bf16
    autocast, with achieved FLOP/s as a fraction of the measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from qkv.nn import EncoderLayer, FeedForward, LayerNorm, MultiHeadAttention


def timed(fns: dict[str, Callable[[], object]], repeats: int = 7, inner: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, alternating them so drifts hit all alike."""
    for fn in fns.values():  # warm up (allocator, kernels selection)
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def matmul_peak(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = timed({"mm": lambda: a @ b}, repeats=5)["mm"]
    return 2 * n**3 / seconds


def bench_attention(batch: int, seq: int, d: int, heads: int) -> dict[str, float]:
    ref = nn.MultiheadAttention(d, heads, batch_first=True).eval()
    ours = MultiHeadAttention(d, heads, causal=True).eval()
    x = torch.randn(batch, seq, d)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # PyTorch convention: True = masked
    with torch.inference_mode():
        return timed({
            "qkv fused": lambda: ours(x),
            "qkv explicit": lambda: ours(x, need_weights=True),
            "nn.MultiheadAttention": lambda: ref(x, x, x, attn_mask=causal, need_weights=False, is_causal=True),
        })


def encoder_layer_flops(batch: int, seq: int, d: int, d_ff: int) -> float:
    """Forward + backward matmul FLOPs (3x forward): projections, FFN, and the two attention products."""
    tokens = batch * seq
    forward = 2 * tokens * (4 * d * d + 2 * d * d_ff) + 2 * 2 * batch * seq * seq * d
    return 3 * forward


def bench_layer(batch: int, seq: int, d: int, heads: int, d_ff: int, peaks: dict[str, float]) -> list[dict]:
    ref = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True, norm_first=True)
    ours = EncoderLayer(self_attn=MultiHeadAttention(d, heads), feed_forward=FeedForward(d, d_ff),
                        self_attn_norm=LayerNorm(d), ffn_norm=LayerNorm(d), norm_first=True)
    x = torch.randn(batch, seq, d)
    rows = []
    for precision in ("fp32", "bf16"):
        bf16 = precision == "bf16"

        def step(module, call, bf16=bf16):
            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = call(module)
                out.float().sum().backward()
            return run

        times = timed({
            "qkv EncoderLayer": step(ours, lambda m: m(x)[0]),
            "nn.TransformerEncoderLayer": step(ref, lambda m: m(x)),
        }, repeats=5, inner=2)
        flops = encoder_layer_flops(batch, seq, d, d_ff)
        for name, seconds in times.items():
            rows.append({"what": f"encoder layer fwd+bwd {precision}", "impl": name, "ms": seconds * 1e3,
                         "GFLOP/s": flops / seconds / 1e9, "of peak": flops / seconds / peaks[precision]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(f"matmul peak (2048², median): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} "
          f"GFLOP/s -> bf16/fp32 = {peaks['bf16'] / peaks['fp32']:.2f}x\n")

    attention = bench_attention(batch=8, seq=256, d=256, heads=8)
    base = attention["nn.MultiheadAttention"]
    print("causal self-attention forward, B=8 T=256 d=256 h=8 (fp32)")
    for name, seconds in attention.items():
        print(f"  {name:24s} {seconds * 1e3:8.2f} ms   {base / seconds:5.2f}x nn.MultiheadAttention's speed")

    layer = bench_layer(batch=8, seq=128, d=256, heads=8, d_ff=1024, peaks=peaks)
    print("\nencoder layer forward + backward, B=8 T=128 d=256 h=8 d_ff=1024")
    for row in layer:
        print(f"  {row['what']:30s} {row['impl']:28s} {row['ms']:8.2f} ms  {row['GFLOP/s']:6.1f} GFLOP/s "
              f"({row['of peak']:.0%} of peak)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peaks_flops": peaks, "attention_s": attention, "layer": layer}, f, indent=2)


if __name__ == "__main__":
    main()
