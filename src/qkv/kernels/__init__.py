"""qkv's native kernel: the block products of ``q4.c`` (int4 × int8, int8 × int8), loaded through ctypes (and in
the same library the fused operations of ``ops.c``, :mod:`qkv.kernels.ops`).

PyTorch's int4 kernel widens each 4-bit weight to a float; on a CPU with AVX2 and no AVX-512 that makes decoding
compute-bound at a third of llama.cpp's speed. ``q4.c`` multiplies as llama.cpp does: the activations quantized to
int8 per block of 32 inputs, each weight block times them in integers, one float multiply per block (the arithmetic
is written out at the top of ``q4.c``). The weights are GGUF's blocks as a file stores them: 4-bit (Q4_0, Q4_1)
or 8-bit (Q8_0). Three variants — portable C, AVX2, AVX-512 VNNI — the best the CPU runs
chosen by default; the rows split over PyTorch's own OpenMP threads.

The library is built when qkv is installed (``setup.py``, an optional extension). Where it is missing (no C compiler
then) or cannot load, :func:`available` is False and :func:`why_not` says why in one line: qkv then multiplies with
PyTorch's kernel.

Layouts (see ``q4.c``), each weight ``q · scale + offset``: 4-bit ``codes`` ``(rows, n / 2)`` uint8, block ``b``
of a row in bytes ``16 b`` to ``16 b + 15``, byte ``i`` holding input ``32 b + i`` in its low nibble and
``32 b + 16 + i`` in its high one (GGUF's Q4_0/Q4_1 order); 8-bit ``codes`` ``(rows, n)`` int8, with no offsets;
``scales`` and ``offsets`` ``(rows, n / 32)`` float16 (``d`` and ``m`` of a Q4_1 block, held as the file holds
them). 6-bit weights are GGUF's Q6_K as stored (:func:`q6_codes` packs the codes): ``codes`` ``(rows, n / 64, 48)``
uint8, ``scales`` each super-block's ``d`` ``(rows, n / 256)`` float16, and in the offsets' place the int8 scales
of each 16 inputs ``(rows, n / 16)``, each weight ``d · scale · (q - 32)``. 5-bit weights are GGUF's Q5_K as
stored (:func:`q5_codes`): ``codes`` ``(rows, n / 64, 40)`` uint8, ``scales`` each super-block's ``d`` and ``dmin``
``(rows, n / 256, 2)`` float16, and in the offsets' place each block's six-bit scale, then its minimum, ``(rows, 2,
n / 32)`` uint8, each weight ``d · scale · q - dmin · minimum``. qkv's 4-bit layers
(:mod:`qkv.kernel_layers`) hold the same blocks :func:`interleaved`, eight rows at a time, which the kernel
multiplies up to twice as fast (docs/quantization.md); its 8-bit ones hold the rows in order.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # inputs per block, of the weights and of the quantized activations
GROUP = 8  # 4-bit rows interleaved at a time for decoding (q4.c's Q4X8 layout, :func:`interleaved`)
Q6_PAIR = 48  # two blocks of 32 six-bit codes (q4.c's Q6 layout)
Q5_PAIR = 40  # two blocks of 32 five-bit codes (q4.c's Q5 layout)
SUPER = 256  # inputs of a K-quant super-block (Q6_K, Q5_K): one d
VARIANTS = ("portable", "avx2", "avx512-vnni")  # in the order q4.c numbers them

_HERE = Path(__file__).resolve().parent
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """The library and "", or None and why it is not there."""
    built = sorted(_HERE.glob("_q4*.so")) + sorted(_HERE.glob("_q4*.pyd"))
    if not built:
        return None, "qkv's kernel was not built when qkv was installed (no working C compiler then?)"
    try:  # torch is imported above: its OpenMP runtime is loaded, which the library's threads are taken from
        library = ctypes.CDLL(str(built[0]))
    except OSError as err:
        return None, f"qkv's kernel {built[0].name} does not load: {' '.join(str(err).split())}"
    try:
        _declare(library)
    except AttributeError as err:  # a library built from older sources (a rebuild that failed left it in place)
        return None, (f"qkv's kernel {built[0].name} is older than this qkv ({' '.join(str(err).split())}); "
                      "reinstall qkv to build it again")
    return library, ""


def _declare(library: ctypes.CDLL) -> None:
    """The argument and result types of the library's functions (AttributeError for one it lacks)."""
    library.qkv_best_variant.restype = _INT
    library.qkv_runs_variant.argtypes = [_INT]
    library.qkv_quantize_q8.argtypes = [_P, _I64, _I64, _P, _P, _P]
    library.qkv_linear.argtypes = [_INT, _INT, _P, _P, _P, _I64, _I64, _P, _I64, _P]
    library.qkv_linear.restype = _INT
    library.qkv_q8_rounded.argtypes = [_P, _I64, _I64, _P]
    library.qkv_block_sums.argtypes = [_INT, _INT, _P, _P, _I64, _I64, _P, _P]
    library.qkv_block_sums.restype = _INT
    library.qkv_q4x8_dequantize.argtypes = [_P, _P, _P, _I64, _I64, _I64, _P]
    library.qkv_q4x8_write_rows.argtypes = [_P, _P, _P, _I64, _I64, _I64, _P, _P, _P]
    library.qkv_linear_x8_picked.argtypes = [_INT, _P, _P, _P, _P, _I64, _I64, _I64, _P, _INT, _P]
    library.qkv_linear_x8_picked.restype = _INT
    _F = ctypes.c_float  # the fused operations (ops.c, qkv.kernels.ops)
    library.qkv_rms_norm.argtypes = [_P, _P, _P, _F, _I64, _I64, _P, _P]
    library.qkv_gated.argtypes = [_INT, _P, _I64, _I64, _INT, _P]
    library.qkv_gated.restype = _INT
    library.qkv_new_token_attention.argtypes = [_INT, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64,
                                                _INT, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _F, _P, _P]
    library.qkv_new_token_attention.restype = _INT
    library.qkv_gelu_tanh.argtypes = [_INT, _P, _P, _I64, _P]
    library.qkv_gelu_tanh.restype = _INT
    library.qkv_linear_f32.argtypes = [_INT, _P, _I64, _I64, _P, _P, _I64, _P]
    library.qkv_linear_f32.restype = _INT


def available() -> bool:
    """Whether the kernel is built and loads."""
    return _loaded()[0] is not None


def why_not() -> str:
    """Why the kernel is not available, in one line ("" when it is)."""
    return _loaded()[1]


def _library() -> ctypes.CDLL:
    library, why = _loaded()
    if library is None:
        raise RuntimeError(why)
    return library


_DOOR = ("linear", "rms_norm", "gated", "new_token_attention", "linear_f32")  # the calls of a decoding step


class _Ctypes:
    """The calls of :func:`calls` through ctypes, for a library built without its Python door."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for name in _DOOR:
            setattr(self, name, getattr(library, f"qkv_{name}"))


@functools.cache
def calls():
    """The functions a decoding step calls many times a token, taking addresses and sizes as ints (None: a null
    pointer): the library's own Python module (``calls.c``: a fraction of a microsecond a call), or the same
    functions through ctypes (several microseconds) where the module door is not there. Raises as
    :func:`_library` does without the library."""
    library = _library()
    if os.environ.get("QKV_CALLS") != "ctypes":
        try:
            return importlib.import_module(f"{__name__}._q4")
        except ImportError:
            pass
    return _Ctypes(library)


def best_variant() -> str:
    """The variant the layers run: the fastest this CPU runs ("avx512-vnni", "avx2" or "portable"), or the one
    ``QKV_KERNEL`` names (read once; to run a slower CPU's variant here, e.g. ``avx2`` on an AVX-512 CPU)."""
    return VARIANTS[_best()]


def runs(variant: str) -> bool:
    """Whether this CPU runs ``variant``."""
    return bool(_library().qkv_runs_variant(VARIANTS.index(variant)))


def _check(t: Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU tensor {shape} of {dtype}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` ``(batch, n)`` float32 as int8 per block of 32: the codes ``(batch, n)``, each block's scale
    ``max|x| / 127`` and its scale times the sum of its codes, ``(batch, n / 32)`` each."""
    batch, n = x.shape
    if n % BLOCK:
        raise ValueError(f"the inputs must be a multiple of {BLOCK}, got {n}")
    _check(x, torch.float32, (batch, n), "x")
    xq = torch.empty(batch, n, dtype=torch.int8)
    xd, xs = torch.empty(batch, n // BLOCK), torch.empty(batch, n // BLOCK)
    _library().qkv_quantize_q8(x.data_ptr(), batch, n, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def inputs(codes: Tensor) -> int:
    """A weight row's inputs: two a byte in 4-bit codes (uint8), one in 8-bit ones (int8); 32 a block of
    interleaved ones, 64 a pair of 6-bit or 5-bit blocks."""
    if codes.dim() == 3:
        return codes.size(1) * BLOCK * (2 if _format(codes) in (3, 4) else 1)
    return codes.size(1) * (1 if codes.dtype == torch.int8 else 2)


def _rows(codes: Tensor, rows: int | None = None) -> int:
    """The weights' rows: ``rows`` where given (interleaved codes hold them in whole groups of eight), else every row
    the codes hold."""
    if rows is not None:
        return rows
    return codes.size(0) * (GROUP if _format(codes) == 2 else 1)


def groups(rows: int) -> int:
    """Groups of :data:`GROUP` interleaved rows that hold ``rows`` rows (the last one's other lanes zeros)."""
    return -(-rows // GROUP)


def _by_row(codes: Tensor, scales: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Interleaved buffers as views indexed ``[group, lane]`` for a row: its codes ``(blocks, 4, 4)`` (a block's 16
    bytes, quad by quad), its scales and offsets ``(blocks,)``."""
    g, blocks = codes.size(0), codes.size(1)
    return (codes.view(g, blocks, 4, GROUP, 4).permute(0, 3, 1, 2, 4), scales.permute(0, 2, 1),
            offsets.permute(0, 2, 1))


def write_rows(codes: Tensor, scales: Tensor, offsets: Tensor, start: int, pairs: Tensor, d: Tensor,
               m: Tensor) -> None:
    """Rows ``start ...`` of interleaved buffers (contiguous, on the CPU): their blocks' bytes ``(r, blocks, 16)``
    in the Q4 layout and their fp16 scales and offsets ``(r, blocks)``, copied by the kernel's library."""
    rows, n = len(pairs), inputs(codes)
    pairs, d, m = (t.contiguous().cpu() for t in (pairs.reshape(rows, n // 2), d.half(), m.half()))
    if start < 0 or start + rows > codes.size(0) * GROUP or d.shape != (rows, n // BLOCK) or m.shape != d.shape:
        raise ValueError(f"rows {start} to {start + rows} of {n} inputs do not fit weights of "
                         f"{codes.size(0) * GROUP} rows")
    _library().qkv_q4x8_write_rows(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), n, start, rows,
                                   pairs.data_ptr(), d.data_ptr(), m.data_ptr())


def read_rows(codes: Tensor, scales: Tensor, offsets: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``rows`` of interleaved buffers in the Q4 layout: bytes ``(r, blocks, 16)``, scales and offsets
    ``(r, blocks)``."""
    where = (rows // GROUP, rows % GROUP)
    by_codes, by_scales, by_offsets = _by_row(codes, scales, offsets)
    return by_codes[where].reshape(len(rows), -1, BLOCK // 2), by_scales[where], by_offsets[where]


def interleaved(codes: Tensor, scales: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """4-bit weights in the Q4 layout (``codes`` ``(rows, n / 2)``, ``scales`` and ``offsets`` ``(rows, n / 32)``)
    laid out for decoding, q4.c's Q4X8: the rows in groups of eight, each block's codes of the eight rows together,
    so that one instruction multiplies four inputs of eight rows. Returns codes ``(groups, n / 32, 128)`` uint8,
    scales and offsets ``(groups, n / 32, 8)`` fp16, a last group of fewer rows filled with zeros: the same numbers,
    whose product :func:`matmul` gives bit for bit as the portable variant gives the Q4 layout's."""
    rows, n = codes.size(0), 2 * codes.size(1)
    _check(codes, torch.uint8, (rows, n // 2), "codes")
    _check(scales, torch.float16, (rows, n // BLOCK), "scales")
    _check(offsets, torch.float16, (rows, n // BLOCK), "offsets")
    out = (torch.zeros(groups(rows), n // BLOCK, GROUP * BLOCK // 2, dtype=torch.uint8),
           torch.zeros(groups(rows), n // BLOCK, GROUP, dtype=torch.float16),
           torch.zeros(groups(rows), n // BLOCK, GROUP, dtype=torch.float16))
    write_rows(*out, 0, codes.view(rows, -1, BLOCK // 2), scales, offsets)
    return out


def _whole_super_blocks(n: int, bits: int) -> None:
    if n % SUPER:
        raise ValueError(f"{bits}-bit weights come in super-blocks of {SUPER} inputs, got {n}")


def _pairs(q: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """K-quant codes ``q`` ``(rows, n)`` two blocks of 32 at a time: the pair's low four bits two to a byte (input
    ``i`` of the first block low, of the second high) ``(rows, n / 64, 32)``, and the bits above them ``(rows,
    n / 64, 2, 4, 8)`` (block, then its inputs ``8 j + i`` as ``[j, i]``)."""
    rows, n = q.shape
    _whole_super_blocks(n, bits)
    pairs = q.to(torch.uint8).view(rows, n // (2 * BLOCK), 2, BLOCK)
    low, high = pairs & 15, (pairs >> 4).view(rows, n // (2 * BLOCK), 2, 4, 8)
    return low[..., 0, :] | low[..., 1, :] << 4, high


def q6_codes(q: Tensor) -> Tensor:
    """6-bit codes ``q`` ``(rows, n)`` in 0..63 as q4.c's Q6 layout, two blocks of 32 at a time: ``(rows, n / 64,
    48)`` uint8, the pair's low four bits two to a byte (input ``i`` of the first block low, of the second high),
    then each block's high two bits four to a byte (byte ``i``: inputs ``i``, ``8 + i``, ``16 + i``, ``24 + i``, from
    the lowest bits up)."""
    nibbles, high = _pairs(q, 6)
    crumbs = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
    return torch.cat([nibbles, crumbs.flatten(-2)], dim=-1).contiguous()


def q5_codes(q: Tensor) -> Tensor:
    """5-bit codes ``q`` ``(rows, n)`` in 0..31 as q4.c's Q5 layout, two blocks of 32 at a time: ``(rows, n / 64,
    40)`` uint8, the pair's low four bits as :func:`q6_codes` lays them, then each block's fifth bits, a
    little-endian 32-bit word (bit ``i``: input ``i``)."""
    nibbles, fifth = _pairs(q, 5)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    words = (fifth * weights).sum(-1, dtype=torch.uint8)  # (rows, pairs, 2, 4): byte j holds inputs 8 j .. 8 j + 7
    return torch.cat([nibbles, words.flatten(-2)], dim=-1).contiguous()


def matmul(x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor | None = None, *, rows: int | None = None,
           variant: str | None = None) -> Tensor:
    """``x`` ``(batch, n)`` float32 times the weights' transpose: ``(batch, rows)`` float32, the activations
    quantized to int8 on the way, as :func:`quantize_activations` does. 4-bit weights: ``codes`` uint8 and
    ``offsets``, in the Q4 layout or :func:`interleaved` (then ``rows`` says how many are real); 8-bit: ``codes``
    int8, no offsets; 6-bit (:func:`q6_codes`): ``codes``, the super-blocks' ``scales`` and ``offsets`` the int8
    scales of each 16 inputs; 5-bit (:func:`q5_codes`): ``codes``, the super-blocks' ``d`` and ``dmin`` and
    ``offsets`` the blocks' scales and minimums."""
    n, rows = inputs(codes), _rows(codes, rows)
    if bits(codes) in (5, 6):
        five = bits(codes) == 5
        _whole_super_blocks(n, bits(codes))
        _check(codes, torch.uint8, (rows, n // (2 * BLOCK), Q5_PAIR if five else Q6_PAIR), "codes")
        _check(scales, torch.float16, (rows, n // SUPER, 2) if five else (rows, n // SUPER), "scales")
        if offsets is None:
            raise ValueError("5-bit weights need their blocks' scales and minimums (offsets)" if five else
                             "6-bit weights need their scales per 16 inputs (offsets)")
        _check(offsets, torch.uint8 if five else torch.int8, (rows, 2, n // BLOCK) if five else (rows, n // 16),
               "offsets")
    elif codes.dim() == 3:
        shape = (groups(rows), n // BLOCK)
        _check(codes, torch.uint8, (*shape, GROUP * BLOCK // 2), "codes")
        _check(scales, torch.float16, (*shape, GROUP), "scales")
        if offsets is None:
            raise ValueError("interleaved 4-bit weights need their offsets")
        _check(offsets, torch.float16, (*shape, GROUP), "offsets")
    else:
        _check(codes, torch.int8 if offsets is None else torch.uint8, (rows, n if offsets is None else n // 2),
               "codes")
        _check(scales, torch.float16, (rows, n // BLOCK), "scales")
        if offsets is not None:
            _check(offsets, torch.float16, (rows, n // BLOCK), "offsets")
    if x.dim() != 2 or x.size(1) != n:
        raise ValueError(f"x must be (batch, {n}), got {tuple(x.shape)}")
    number = None if variant is None else VARIANTS.index(variant)
    return linear(x.float().contiguous(), codes, scales, offsets, rows=rows, variant=number)


def linear(x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor | None = None, *, rows: int | None = None,
           variant: int | None = None) -> Tensor:
    """:func:`matmul` without its checks, for a layer that made its buffers right once: ``x`` contiguous
    float32 ``(batch, n)``; ``variant`` a number (:data:`VARIANTS`' index; default the best)."""
    return bound_linear(codes, scales, offsets, rows=rows, variant=variant)(x)


def bound_linear(codes: Tensor, scales: Tensor, offsets: Tensor | None = None, *, rows: int | None = None,
                 variant: int | None = None) -> Callable[[Tensor], Tensor]:
    """:func:`linear` with these weights: what does not depend on the input (the library's function, the buffers'
    addresses) looked up once, so that a decoding step's call costs a few microseconds. The weights must stay
    where they are (a layer remakes its function when its buffers move)."""
    call = calls().linear
    rows = _rows(codes, rows)
    fixed = (_format(codes), _best() if variant is None else variant, codes.data_ptr(), scales.data_ptr(),
             None if offsets is None else offsets.data_ptr(), rows)

    def product(x: Tensor) -> Tensor:  # x (..., n): every leading dimension a row
        n = x.size(-1)
        y = x.new_empty(*x.shape[:-1], rows)
        status = call(*fixed, n, x.data_ptr(), x.numel() // n, y.data_ptr())
        if status:
            raise (ValueError("this CPU does not run that variant") if status == -1 else MemoryError())
        return y

    return product


def bound_picked(weights: list[tuple[Tensor, Tensor, Tensor]], rows: int) -> Callable[[Tensor, Tensor, bool], Tensor]:
    """For a table of :func:`interleaved` 4-bit weights of one shape (each its codes, scales and offsets; ``rows``
    real rows each): a function ``(x, picked, shared) -> y`` with ``y[j] = x[j] Wᵀ_{picked[j]}`` ``(len(picked),
    rows)``, ``x`` contiguous float32, one row for all when ``shared`` (quantized once). Every product in one
    parallel region: a mixture of experts' k experts of a decoding step as one call. The weights must stay where
    they are, as with :func:`bound_linear`."""
    table = [(ctypes.c_void_p * len(weights))(*(w[i].data_ptr() for w in weights)) for i in range(3)]
    call, variant, n = _library().qkv_linear_x8_picked, _best(), inputs(weights[0][0])

    def product(x: Tensor, picked: Tensor, shared: bool) -> Tensor:
        y = x.new_empty(picked.numel(), rows)
        status = call(variant, *table, picked.data_ptr(), picked.numel(), rows, n, x.data_ptr(), int(shared),
                      y.data_ptr())
        if status:
            raise MemoryError("qkv's kernel could not allocate its quantized activations")
        return y

    return product


def dequantize(codes: Tensor, scales: Tensor, offsets: Tensor, start: int, out: Tensor) -> Tensor:
    """Rows ``start`` to ``start + len(out)`` of :func:`interleaved` weights as float32 into ``out`` ``(r, n)``:
    ``q · scale + offset``, rounded as :meth:`~qkv.quantized.QuantizedLinear.dequantized` computes them; returns
    ``out``."""
    _library().qkv_q4x8_dequantize(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), inputs(codes), start,
                                   start + out.size(0), out.data_ptr())
    return out


def rounded_activations(x: Tensor) -> Tensor:
    """``x`` ``(batch, n)`` contiguous float32 as the kernel multiplies it: int8 per block of 32, times each block's
    scale (:func:`quantize_activations`' codes and scales, multiplied back)."""
    out = torch.empty_like(x)
    _library().qkv_q8_rounded(x.data_ptr(), x.size(0), x.size(1), out.data_ptr())
    return out


# What QKV_KERNEL may say: auto (the default: this kernel wherever it is built), qkv, one of its variants by name,
# or torch (PyTorch's kernels).
CHOICES = ("auto", "qkv", *VARIANTS, "torch")


def choice() -> str:
    """``QKV_KERNEL``, checked: the one place it is read (see :data:`CHOICES`); unset or empty is ``auto``.

    Raises:
        ValueError: a value that is not one of :data:`CHOICES`.
    """
    chosen = os.environ.get("QKV_KERNEL") or "auto"
    if chosen not in CHOICES:
        raise ValueError(f"QKV_KERNEL must be {', '.join(CHOICES[:-1])} or torch, got {chosen!r}")
    return chosen


def in_use() -> str:
    """Which kernel quantized layers multiply with here, and why, in one line: the benchmarks print it beside their
    figures."""
    capability = torch.backends.cpu.get_cpu_capability()
    if choice() != "torch" and available():
        return f"kernel: qkv's, {best_variant()} (PyTorch's CPU capability {capability})"
    reason = "QKV_KERNEL=torch" if choice() == "torch" else why_not()
    return f"kernel: PyTorch's, CPU capability {capability} ({reason})"


@functools.cache
def _best() -> int:
    chosen = choice()
    if chosen not in VARIANTS:
        return _library().qkv_best_variant()
    if not runs(chosen):
        raise ValueError(f"QKV_KERNEL={chosen}: this CPU does not run that variant of qkv's kernel; choose "
                         f"{' or '.join(v for v in VARIANTS if runs(v))}")
    return VARIANTS.index(chosen)


def bits(codes: Tensor) -> int:
    """The weights' bits: 8 for int8 codes, 6 and 5 for q4.c's Q6 and Q5 blocks, else 4."""
    return {1: 8, 3: 6, 4: 5}.get(_format(codes), 4)


def _format(codes: Tensor) -> int:
    """q4.c's number for the weights' format: 0 for 4-bit codes (uint8, two a byte), 1 for 8-bit ones (int8), 2 for
    interleaved 4-bit ones, 3 for 6-bit ones (48 bytes a pair of blocks), 4 for 5-bit ones (40 bytes)."""
    if codes.dim() == 3:
        return {Q6_PAIR: 3, Q5_PAIR: 4}.get(codes.size(-1), 2)
    return 1 if codes.dtype == torch.int8 else 0


def block_sums(codes: Tensor, xq: Tensor, *, variant: str, sub: Tensor | None = None) -> Tensor:
    """The integer sum of every weight block times the activation row ``xq`` ``(n,)`` int8: ``(rows, n / 32)``
    int32, as ``variant`` computes it (the tests hold each variant to a reference). 4-bit codes uint8, 8-bit int8,
    6-bit ones with their scales ``sub`` (each block's sum is then ``sub_0 Σ (q - 32) p + sub_1 Σ (q - 32) p`` over
    its two halves), 5-bit ones with their blocks' scales ``sub`` ``(rows, n / 32)`` uint8 (``sub · Σ q p``)."""
    rows, n = codes.size(0), inputs(codes)
    _check(codes, codes.dtype, (rows, *codes.shape[1:]), "codes")
    _check(xq, torch.int8, (n,), "xq")
    if _format(codes) == 3:
        _check(sub, torch.int8, (rows, n // 16), "sub")
    if _format(codes) == 4:
        _check(sub, torch.uint8, (rows, n // BLOCK), "sub")
    sums = torch.empty(rows, n // BLOCK, dtype=torch.int32)
    if _library().qkv_block_sums(_format(codes), VARIANTS.index(variant), codes.data_ptr(),
                                 None if sub is None else sub.data_ptr(), rows, n, xq.data_ptr(), sums.data_ptr()):
        raise ValueError(f"this CPU does not run the {variant} variant")
    return sums


__all__ = [
    "BLOCK",
    "GROUP",
    "VARIANTS",
    "available",
    "best_variant",
    "bits",
    "block_sums",
    "bound_linear",
    "choice",
    "dequantize",
    "groups",
    "in_use",
    "inputs",
    "interleaved",
    "linear",
    "matmul",
    "q5_codes",
    "q6_codes",
    "quantize_activations",
    "read_rows",
    "rounded_activations",
    "runs",
    "why_not",
    "write_rows",
]
