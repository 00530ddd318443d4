"""qkv's fused operations (``ops.c``) from Python: a decoding step's norms, gated activations and attention, one call
each instead of several of PyTorch's small operations.

The modules call them where they apply (:func:`applies`: the library loaded, float32 on the CPU, no gradient, not
being compiled) and run their own Python otherwise, which stays the reference the tests hold these to:

* :func:`rms_norm` for :class:`qkv.nn.norm.RMSNorm`, and :func:`add_rms_norm` for a residual connection's sum
  and the norm after it (:class:`qkv.nn.layers.DecoderLayer`'s decoding step);
* :func:`gated` for :class:`qkv.nn.feedforward.StackedFeedForward`'s ``act(gate) * up`` (SiLU, GELU's tanh form);
* :func:`decode_attention` for :class:`qkv.nn.attention.StackedSelfAttention` with one new token a row (or a few:
  speculative decoding's drafts): rotary positions, the KV cache's new positions written, attention over each row's
  cached positions.

``QKV_FUSED=0`` in the environment, or :func:`reference` around a call, runs the Python instead (to compare, or to
measure what these save: ``benchmarks/bench_decode_parts.py`` times both ways).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from . import VARIANTS, _best, _loaded, calls

ACTIVATIONS = {"swiglu": 0, "geglu_tanh": 1}  # ops.c's codes of the gated activations it computes
_off = os.environ.get("QKV_FUSED", "1") == "0"


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Within it, the modules run their Python, not these operations."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


def applies(x: Tensor) -> bool:
    """Whether a fused operation may stand in for the Python on ``x``: :func:`trains`, with no gradient to record."""
    return not torch.is_grad_enabled() and trains(x)


def _library() -> ctypes.CDLL | None:
    return _loaded()[0]


def _code(variant: str | None) -> int:
    """A variant's number in the library: the named one, or the best this CPU runs."""
    return _best() if variant is None else VARIANTS.index(variant)


def rms_norm(x: Tensor, gains: Tensor, eps: float, *, in_place: bool = False) -> Tensor:
    """``RMSNorm(x)`` over the last dimension, ``gains`` float32; ``in_place``: written over ``x`` (contiguous)."""
    if not in_place:
        x = x.contiguous()
    out = x if in_place else torch.empty_like(x)
    calls().rms_norm(x.data_ptr(), None, gains.data_ptr(), eps, x.numel() // x.size(-1), x.size(-1), None,
                     out.data_ptr())
    return out


def add_rms_norm(x: Tensor, add: Tensor, gains: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + add, RMSNorm(x + add))``: a residual connection's sum and the next sub-layer's norm of it, in one
    pass; ``x`` and ``add`` of one shape."""
    x, add = x.contiguous(), add.contiguous()
    summed, out = torch.empty_like(x), torch.empty_like(x)
    calls().rms_norm(x.data_ptr(), add.data_ptr(), gains.data_ptr(), eps, x.numel() // x.size(-1), x.size(-1),
                     summed.data_ptr(), out.data_ptr())
    return summed, out


def gated(gate_up: Tensor, activation: str, *, variant: str | None = None) -> Tensor:
    """``act(gate) * up`` of ``gate_up`` ``(..., 2 d)``, ``[gate | up]`` side by side: ``(..., d)``; ``variant``:
    the instruction set (:data:`qkv.kernels.VARIANTS`; default the best this CPU runs)."""
    gate_up = gate_up.contiguous()
    d = gate_up.size(-1) // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], d)
    if calls().gated(_code(variant), gate_up.data_ptr(), gate_up.numel() // (2 * d), d, ACTIVATIONS[activation],
                     out.data_ptr()):
        raise ValueError(f"this CPU does not run the {variant} variant")
    return out


def trains(x: Tensor) -> bool:
    """Whether :func:`gelu_tanh` computes on qkv's own: the library is there and not turned off, and ``x`` is
    float32 on the CPU with no graph being compiled (a gradient may be recorded)."""
    return (not torch.compiler.is_compiling() and not _off and x.dtype == torch.float32 and x.device.type == "cpu"
            and _library() is not None)


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return _gelu_tanh(x, None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return _gelu_tanh(x, grad)


def _gelu_tanh(x: Tensor, grad: Tensor | None, variant: str | None = None) -> Tensor:
    x = x.contiguous()
    grad = None if grad is None else grad.contiguous()
    out = torch.empty_like(x)
    if _library().qkv_gelu_tanh(_code(variant), x.data_ptr(), None if grad is None else grad.data_ptr(), x.numel(),
                                out.data_ptr()):
        raise ValueError(f"this CPU does not run the {variant} variant")
    return out


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh form (GPT-2's), ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, and its gradient, on qkv's
    own where :func:`trains` says (PyTorch's computes tanh a call per number: twice its exact GELU's time),
    PyTorch's ``F.gelu(x, approximate="tanh")`` elsewhere. The same numbers to about 1e-6."""
    return _GeluTanh.apply(x) if trains(x) else F.gelu(x, approximate="tanh")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, *, variant: str | None = None) -> Tensor:
    """``x W^T (+ b)`` for a few rows of ``x`` (a decoding step's), ``weight`` float32 ``(out, in)`` contiguous: the
    output rows split over PyTorch's threads (its own product of a row runs on one)."""
    x = x.contiguous()
    rows, n, m = x.numel() // x.size(-1), x.size(-1), weight.size(0)
    out = x.new_empty(*x.shape[:-1], m)
    status = calls().linear_f32(_code(variant), x.data_ptr(), rows, n, weight.data_ptr(),
                                None if bias is None else bias.data_ptr(), m, out.data_ptr())
    if status:
        raise ValueError("this CPU does not run that variant")
    return out


def decode_attention(qkv: Tensor, heads: int, kv_heads: int, dim: int, tables: tuple[Tensor, Tensor] | None,
                     rotary: int, interleaved: bool, keys: Tensor, values: Tensor, length: int,
                     starts: Tensor | None, window: int | None, scale: float, *, variant: str | None = None) -> Tensor:
    """A few new tokens a row (one, when decoding): ``qkv`` ``(B, t, (heads + 2 kv_heads) · dim)`` contiguous, their
    queries and keys turned by ``tables`` (the rotary cosines and sines of the new positions, ``(1 or B, ..., t,
    rotary or rotary / 2)``; None: no rotary positions), their keys and values written at positions ``length`` to
    ``length + t - 1`` of the cache ``keys``, ``values`` ``(B, kv_heads, room, dim)`` (each position's numbers
    contiguous; the rows and heads may be further apart, as in a view of a longer cache), and each query's attention
    over its row's positions ``starts[b]`` (int64, or None: 0) up to its own, the last ``window`` of them if given:
    ``(B, t, heads · dim)``, each token's numbers those it gets fed alone after the ones before it. ``variant``: the
    instruction set of its loops over the cache (:data:`qkv.kernels.VARIANTS`; default the best this CPU runs)."""
    b, t, room = qkv.size(0), qkv.size(1), keys.size(2)
    if keys.stride()[2:] != (dim, 1) or values.stride() != keys.stride():
        raise ValueError("the cache's positions must each hold their numbers side by side, alike for keys and values")
    cos = sin = None
    table = token_table = 0
    if tables is not None:
        cos, sin = tables
        token_table = cos.size(-1)
        table = 0 if cos.size(0) == 1 else cos[0].numel()
    out = qkv.new_empty(b, t, heads * dim)
    scratch = qkv.new_empty(b * t * heads, room)
    status = calls().new_token_attention(
        _code(variant), qkv.data_ptr(), b, t, heads, kv_heads, dim,
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), table, token_table, rotary,
        int(interleaved), keys.data_ptr(), values.data_ptr(), room, keys.stride(0), keys.stride(1), length,
        None if starts is None else starts.data_ptr(), window or 0, float(scale), scratch.data_ptr(),
        out.data_ptr())
    if status:
        raise ValueError("the KV cache has no room for the new positions, a row has no position to attend to, or "
                         "this CPU does not run that variant")
    return out


__all__ = ["ACTIVATIONS", "add_rms_norm", "applies", "decode_attention", "gated", "gelu_tanh", "linear", "reference",
           "rms_norm", "trains"]
