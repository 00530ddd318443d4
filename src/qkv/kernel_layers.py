"""int4, int5, int6 and int8 layers that multiply with qkv's own kernel (``q4.c``) instead of PyTorch's.

:class:`~qkv.quantized.Int4Linear` keeps its codes in the layout PyTorch's kernel reads, which depends on the CPU
(rows in blocks of 32 or 64, input by input), with a bfloat16 scale and zero point per group of 32 inputs,
``W ≈ (q - 8) · s + z``. :class:`KernelInt4Linear` holds 4-bit codes in groups of 32 too, GGUF's blocks: a group's
32 in 16 bytes, byte ``i`` holding input ``i`` in its low nibble and input ``i + 16`` in its high one, and per group
an fp16 scale ``d`` and offset ``m``, ``W ≈ q · d + m``, GGUF's Q4_1 form; the rows interleaved eight at a time,
block by block, as the kernel multiplies them fastest (:func:`qkv.kernels.interleaved`). A Q4_0 or Q4_1 file's
blocks are so taken over exactly, bytes and fp16 numbers as stored (Q4_0's offset is ``-8 d``); bfloat16 would round
each scale by up to 2⁻⁹ of itself, which costs a measurable share of perplexity (docs/quantization.md). fp16
reaches 65504: weights beyond it are refused.

:class:`~qkv.quantized.Int8Linear` keeps one bfloat16 scale per output row, ``W ≈ s · q``. :class:`KernelInt8Linear`
keeps one fp16 scale per block of 32 inputs, ``W ≈ d · q``, GGUF's Q8_0 form: a Q8_0 tensor (most files' token
table and output layer) is taken over exactly, and weights quantized again land nearer their values (a step per
block, not per row), for 6% more memory (two bytes per 32 codes).

:class:`KernelInt6Linear` holds a GGUF file's Q6_K blocks as stored (six-bit codes, an int8 scale per 16 inputs, an
fp16 one per 256: 6.6 bits a weight), the layers of a Q4_K_M file that llama.cpp's quantizer gives more bits;
:class:`KernelInt5Linear` its Q5_K blocks (five-bit codes, a six-bit scale and minimum per 32 inputs, fp16 ``d`` and
``dmin`` per 256).

They live above the native folder (:mod:`qkv.kernels`, which imports nothing of qkv) and beside the layers they
extend (:mod:`qkv.quantized`). All of them multiply through :func:`block_linear` in a graph that ``torch.compile``
makes: the kernel's product registered as the operator ``qkv::block_linear``, one node of the graph.

Everything else (the bias, fp32 outlier columns, the backward pass through the frozen codes, the largest outputs
of an output layer) is :class:`~qkv.quantized.QuantizedLinear`'s. :func:`qkv.quantize.int4_class` and
:func:`~qkv.quantize.int8_class` pick these layers wherever the kernel is built (and int4's groups are 32 wide).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .kernels import (
    BLOCK,
    GROUP,
    Q5_PAIR,
    Q6_PAIR,
    SUPER,
    available,
    best_variant,
    bits,
    bound_linear,
    bound_picked,
    dequantize,
    groups,
    inputs,
    interleaved,
    linear,
    q5_codes,
    q6_codes,
    read_rows,
    rounded_activations,
    write_rows,
)
from .quantized import Int4Linear, Int8Linear, QuantizedLinear, check_int4, unpaired

_GROUP_BYTES = BLOCK // 2
# From this many input rows on, widened weights and a float product beat the kernel, by the weights' bits and the
# variant the CPU runs (48, AVX-512 and as AVX2, the two ways alternating). 4-bit: the kernel reads a group of eight
# rows' blocks once for all the input rows (from a core's first cache) and stays ahead a long way: a whole forward of
# SmolLM2-135M and of a 1.7B model, 1.3-2x faster from 32 to 256 tokens at both sizes, 1.4x at 512 at 135M, even
# or ahead at 1,024. 8-bit (the rows one by one; SmolLM2's output layer, 49,152 x 576): AVX-512 VNNI even with the
# widened weights up to 256 rows, behind at 512; AVX2 behind from 32-64 (16 keeps to the safe side). The portable C
# falls behind from about 16.
# 6-bit and 5-bit (GGUF's Q6_K and Q5_K, the rows one by one as 8-bit ones): 8-bit's thresholds.
WIDEN_ROWS = {4: {"portable": 16, "avx2": 512, "avx512-vnni": 512}, 8: {"portable": 16, "avx2": 16, "avx512-vnni": 64}}
WIDEN_ROWS[6] = WIDEN_ROWS[5] = WIDEN_ROWS[8]
WIDEN_TILE_WEIGHTS = 1 << 18  # weights widened at a time for that product: 1 MB of float32, in a core's cache


@functools.cache
def widen_rows(bits: int) -> int:
    """:data:`WIDEN_ROWS` of ``bits``-bit weights for the variant this CPU runs."""
    return WIDEN_ROWS[bits][best_variant()]


def _widened(codes: Tensor, scales: Tensor, offsets: Tensor | None, start: int, end: int, out: Tensor) -> Tensor:
    """Weight rows ``start`` to ``end`` as float32 into ``out`` ``(end - start, in)``: 4-bit ones (interleaved) by
    the kernel's library, 8-bit ones (no offsets) as codes times their blocks' scales, 6-bit ones as
    :func:`q6_weights` and :func:`q5_weights` give them."""
    if bits(codes) in (5, 6):
        widen = q6_weights if bits(codes) == 6 else q5_weights
        return out.copy_(widen(codes[start:end], scales[start:end], offsets[start:end]))
    if offsets is not None:
        return dequantize(codes, scales, offsets, start, out)
    blocks = out.view(end - start, -1, BLOCK)
    blocks.copy_(codes[start:end].view(end - start, -1, BLOCK)).mul_(scales[start:end].float()[..., None])
    return out


def _product(codes: Tensor, scales: Tensor, offsets: Tensor | None, rows: int,
             kernel: Callable[[Tensor], Tensor] | None = None) -> Callable[[Tensor], Tensor]:
    """A kernel layer's product, for these buffers: for a few rows the kernel (``kernel``, its addresses bound, or
    looked up at each call). From :func:`widen_rows` rows on (a prompt), the same int8-rounded inputs
    times the weights widened a tile of rows at a time, by PyTorch's float matrix product: equal up to float
    rounding, and several times faster there (docs/quantization.md)."""
    width = inputs(codes)
    tile = max(1, WIDEN_TILE_WEIGHTS // width)
    kernel = kernel or functools.partial(linear, codes=codes, scales=scales, offsets=offsets, rows=rows)
    widen = widen_rows(bits(codes))

    def product(x: Tensor) -> Tensor:
        if x.size(0) < widen:
            return kernel(x)
        rounded = rounded_activations(x).T.contiguous()  # (in, batch): each tile's outputs are rows of y^T
        y = x.new_empty(rows, x.size(0))
        weights = x.new_empty(min(tile, rows), width)
        for start in range(0, rows, tile):
            end = min(start + tile, rows)
            torch.mm(_widened(codes, scales, offsets, start, end, weights[: end - start]), rounded, out=y[start:end])
        return y.T.contiguous()

    return product


@torch.library.custom_op("qkv::block_linear", mutates_args=())
def block_linear(x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor | None, rows: int) -> Tensor:
    """A kernel layer's product as a registered operator: what a graph made by ``torch.compile`` calls (one
    node; the library's call through ctypes cannot be traced). ``x`` ``(batch, in)`` contiguous float32; ``rows``
    the layer's outputs."""
    return _product(codes, scales, offsets, rows)(x)


@block_linear.register_fake
def _(x: Tensor, codes: Tensor, scales: Tensor, offsets: Tensor | None, rows: int) -> Tensor:
    return x.new_empty(x.size(0), rows)


class _KernelProduct:
    """What both kernel layers multiply with: in eager PyTorch the product with the buffers' addresses bound once;
    in a graph being compiled, :func:`block_linear` (the outlier columns' share added around it either way)."""

    def _make_product(self) -> Callable[[Tensor], Tensor]:
        rows = self.out_features
        return _product(*self._blocks(), rows, bound_linear(*self._blocks(), rows=rows))

    def _make_lean(self) -> Callable[[Tensor], Tensor]:
        """The kernel's call on ``x`` ``(..., in)`` as it lies, for a few rows; more (a prompt) go the full way."""
        codes, scales, offsets = self._blocks()
        kernel, full = bound_linear(codes, scales, offsets, rows=self.out_features), self._product
        most, n, rows = widen_rows(bits(codes)) * self.in_features, self.in_features, self.out_features

        def lean(x: Tensor) -> Tensor:
            if x.numel() >= most:
                return full(x.reshape(-1, n)).view(*x.shape[:-1], rows)
            return kernel(x)

        return lean

    def _cpu_product(self) -> Callable[[Tensor], Tensor]:
        if not torch.compiler.is_compiling():
            return super()._cpu_product()
        codes, scales, offsets = self._blocks()
        rows = self.out_features

        def product(x: Tensor) -> Tensor:
            return block_linear(x, codes, scales, offsets, rows)

        return self._without_outlier_inputs(product) if self.outliers else product


class KernelInt4Linear(_KernelProduct, Int4Linear):
    """``y = x Ŵᵀ + b`` with Ŵ in 4 bits, multiplied by qkv's int4 × int8 kernel.

    Buffers, interleaved for decoding (:func:`qkv.kernels.interleaved`: the rows in groups of eight, a block's
    codes of the eight rows together): ``codes`` ``(groups, in_features / 32, 128)`` uint8, ``group_scales`` (read
    as ``scales``) and ``offsets`` ``(groups, in_features / 32, 8)`` float16, ``W = q · scale + offset``; a row's
    block is GGUF's (see the module's text), its 16 bytes four at a time beside the other rows'. A last group of
    fewer than eight rows holds zeros in the others. Rows are written as :class:`~qkv.quantized.Int4Linear`'s are,
    as scales and zero points ``z = offset + 8 · scale``. A state saved with the rows one after the other (qkv
    before this layout) is interleaved as it is loaded.

    Raises:
        ValueError: ``in_features`` not a multiple of 32 (or a group size other than 32); rows written with a
            scale or offset beyond fp16's range.
    """

    input_dtype = torch.float32  # the kernel quantizes its input to int8 itself: nothing is lost to bf16 first

    def __init__(self, in_features: int, out_features: int, *, group_size: int = BLOCK, bias: bool = False,
                 outliers: int = 0) -> None:
        check_int4("the layer", in_features, group_size)
        if group_size != BLOCK:
            raise ValueError(f"qkv's int4 kernel multiplies groups of {BLOCK} inputs, got group_size={group_size}")
        QuantizedLinear.__init__(self, in_features, out_features, bias=bias, outliers=outliers)  # not PyTorch's layout
        self.group_size = BLOCK
        shape = (groups(out_features), in_features // BLOCK)
        self.register_buffer("codes", torch.zeros(*shape, GROUP * _GROUP_BYTES, dtype=torch.uint8))
        self.register_buffer("group_scales", torch.zeros(*shape, GROUP, dtype=torch.float16))
        self.register_buffer("offsets", torch.zeros(*shape, GROUP, dtype=torch.float16))

    @property
    def scales(self) -> Tensor:  # a buffer of its own name would clash with Int4Linear's property
        """The groups' scales ``(out_features, in_features / 32)`` float16, row by row."""
        return self._rows()[1]

    @property
    def zeros(self) -> Tensor:
        """The zero points ``offset + 8 · scale`` (float32) ``(out_features, in_features / 32)``, as
        :class:`~qkv.quantized.Int4Linear` states them."""
        _, scales, offsets = self._rows()
        return offsets.float() + 8 * scales.float()

    def _rows(self, outputs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Rows ``outputs`` (default every row) in GGUF's order: code bytes ``(r, blocks, 16)``, scales and offsets
        ``(r, blocks)``."""
        device = self.codes.device
        rows = torch.arange(self.out_features, device=device) if outputs is None else outputs.to(device)
        return read_rows(self.codes, self.group_scales, self.offsets, rows)

    @staticmethod
    def encoded(w: Tensor, group_size: int = BLOCK) -> dict[str, Tensor]:
        """As :meth:`Int4Linear.encoded <qkv.quantized.Int4Linear.encoded>`, the codes chosen against the scales
        and offsets as fp16 holds them (the group's least weight the offset, its range / 15 the scale)."""
        groups = w.view(w.size(0), -1, group_size)
        lows, highs = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((highs - lows) / 15).clamp(min=2**-24).half().float()  # 2⁻²⁴: fp16's least step, never 0
        offsets = lows.half().float()
        codes = ((groups - offsets[..., None]) / scales[..., None]).round().clamp(0, 15)
        return {"codes": codes.to(torch.uint8).view(w.size(0), -1), "scales": scales, "zeros": offsets + 8 * scales}

    def write_rows(self, start: int, codes: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` of the layer: their codes ``(r, in)`` in [0, 15], scales and zeros ``(r, n_groups)``."""
        groups = codes.to(torch.uint8).view(len(codes), -1, 2, _GROUP_BYTES)  # inputs i and i + 16 of each group
        self.write_halves(start, groups[:, :, 0] | groups[:, :, 1] << 4, *self._halves(scales, zeros))

    def write_pairs(self, start: int, pairs: Tensor, span: int, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` from codes packed two to a byte as ggml stores them (``span``: inputs ``j`` and
        ``j + span`` share a byte): with a span of 16 (Q4_0, Q4_1) the bytes are this layer's, taken as they
        are."""
        if span != _GROUP_BYTES:
            self.write_rows(start, unpaired(pairs.reshape(len(pairs), -1), span), scales, zeros)
            return
        self.write_halves(start, pairs.reshape(len(pairs), -1, _GROUP_BYTES), *self._halves(scales, zeros))

    def write_halves(self, start: int, pairs: Tensor, d: Tensor, m: Tensor) -> None:
        """Rows ``start ...`` from a file's Q4_0 or Q4_1 blocks as this layer holds them
        (:func:`~qkv.interop.ggml_blocks.int4_halves`): the code bytes ``(r, blocks, 16)`` and each block's fp16
        scale and offset ``(r, blocks)``, taken as they are."""
        write_rows(self.codes, self.group_scales, self.offsets, start, pairs, d, m)

    @staticmethod
    def _halves(scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor]:
        """The groups' fp16 scales and offsets ``zeros - 8 · scales``, taken in float64: where the zero point was
        made in float32 of a file's fp16 offset and scale (:func:`~qkv.interop.ggml_blocks.int4_groups`), that
        sum was exact and the offset comes back as the file holds it."""
        scales = scales.double()
        halves = _fp16(torch.stack([scales, zeros.double() - 8 * scales]))
        return halves[0], halves[1]

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        """The reference: every weight ``q · scale + offset`` from the buffers, in torch."""
        codes, scales, offsets = self._rows(outputs)
        groups = codes.view(len(codes), -1, 1, _GROUP_BYTES)
        levels = torch.cat([groups & 15, groups >> 4], dim=2).view(len(codes), -1, BLOCK).float()
        return (levels * scales.float()[..., None] + offsets.float()[..., None]).view(len(codes), -1)

    def _tile_rows(self) -> int:
        return QuantizedLinear._tile_rows(self)  # any rows: each is read where it lies

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        """Rows ``start`` to ``end`` widened by the kernel's library: the numbers :meth:`_decoded` gives."""
        return _widened(self.codes, self.group_scales, self.offsets, start, end, out)

    def _blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.codes, self.group_scales, self.offsets

    @classmethod
    def picked(cls, layers: Sequence[QuantizedLinear]) -> Callable[[Tensor, Tensor, bool], Tensor] | None:
        """``layers`` as one product that runs, in one parallel region, the layer each row of its input picks:
        ``(x, picked, shared) -> y``, ``y[j] = layers[picked[j]](x[j])`` (:func:`qkv.kernels.bound_picked`), a
        mixture of experts' k experts of a decoding step in one call (:class:`qkv.nn.MoEFeedForward`). None unless
        each is a plain layer of this class (no bias, no fp32 columns) of one shape, on the CPU."""
        plain = all(type(layer) is cls and layer.bias is None and not layer.outliers for layer in layers)
        if not available() or not plain or len({(m.in_features, m.out_features) for m in layers}) > 1:
            return None
        if layers[0].codes.device.type != "cpu":
            return None
        return bound_picked([layer._blocks() for layer in layers], layers[0].out_features)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        keys = [prefix + name for name in ("codes", "group_scales", "offsets")]
        if all(key in state_dict for key in keys) and state_dict[keys[0]].dim() == 2:  # rows one after the other
            state_dict.update(zip(keys, interleaved(*(state_dict[key].contiguous() for key in keys)), strict=True))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _format(self) -> str:
        return "int4, group_size=32, fp16 scales, qkv's kernel"


class KernelInt8Linear(_KernelProduct, Int8Linear):
    """``y = x Ŵᵀ + b`` with Ŵ in 8 bits, one fp16 scale per block of 32 inputs (GGUF's Q8_0), multiplied by qkv's
    int8 × int8 kernel.

    Buffers: ``codes`` ``(out_features, in_features)`` int8, ``scales`` ``(out_features, in_features / 32)``
    float16, ``W = scale · code``. Rows are written with a scale per block, or one per row (as
    :class:`~qkv.quantized.Int8Linear`'s), which then holds for each of the row's blocks.

    Raises:
        ValueError: ``in_features`` not a multiple of 32; rows written with a scale beyond fp16's range.
    """

    input_dtype = torch.float32

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        if in_features % BLOCK:
            raise ValueError(f"qkv's int8 kernel multiplies blocks of {BLOCK} inputs; the layer has {in_features}")
        QuantizedLinear.__init__(self, in_features, out_features, bias=bias, outliers=outliers)
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, in_features // BLOCK, dtype=torch.float16))

    @staticmethod
    def encoded(w: Tensor) -> dict[str, Tensor]:
        """The codes ``(rows, in)`` int8 and scales ``(rows, in / 32)`` of fp32 rows ``w``: each block's largest
        weight over 127, rounded to fp16, then each code against that scale."""
        blocks = w.view(w.size(0), -1, BLOCK)
        scales = (blocks.abs().amax(dim=-1) / 127).clamp(min=2**-24).half().float()
        codes = (blocks / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
        return {"codes": codes.view_as(w), "scales": scales}

    def write_rows(self, start: int, codes: Tensor, scales: Tensor) -> None:
        """Rows ``start ...``: their codes ``(r, in)`` int8 and scales ``(r, in / 32)``, or ``(r,)`` one a row."""
        blocks = self.scales.size(1)
        scales = (scales[:, None] if scales.dim() == 1 else scales).expand(len(codes), blocks)
        self.codes[start : start + len(codes)] = codes
        self.scales[start : start + len(codes)] = _fp16(scales)

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        rows = slice(None) if outputs is None else outputs.to(self.codes.device)
        codes, scales = self.codes[rows], self.scales[rows]
        return (codes.view(len(codes), -1, BLOCK).float() * scales.float()[..., None]).view(len(codes), -1)

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        return _widened(self.codes, self.scales, None, start, end, out)

    def _blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.codes, self.scales, None

    def _format(self) -> str:
        return "int8, fp16 scales per 32 inputs, qkv's kernel"


def _low_bits(codes: Tensor) -> Tensor:
    """The low four bits of K-quant codes laid out in pairs of blocks (:func:`qkv.kernels.q6_codes`,
    :func:`~qkv.kernels.q5_codes`): ``(rows, pairs, 2, 32)``."""
    nibbles = codes[..., :BLOCK]
    return torch.stack([nibbles & 15, nibbles >> 4], dim=2)


def q6_weights(codes: Tensor, d: Tensor, sub: Tensor) -> Tensor:
    """Q6 blocks (:func:`qkv.kernels.q6_codes`) as float32 ``(rows, in)``: ``d · sub · (q - 32)``, each a product
    float32 holds exactly (the ``gguf`` package's numbers for the file's blocks)."""
    rows, pairs = codes.shape[:2]
    crumbs = codes[..., BLOCK:].view(rows, pairs, 2, 1, 8)
    high = torch.cat([crumbs >> 2 * k & 3 for k in range(4)], dim=3).view(rows, pairs, 2, BLOCK)
    q = (_low_bits(codes) | high << 4).view(rows, -1).float() - 32
    scale = (d.float().repeat_interleave(SUPER // 16, 1) * sub.float()).repeat_interleave(16, 1)
    return q * scale


def q5_weights(codes: Tensor, dm: Tensor, sub: Tensor) -> Tensor:
    """Q5 blocks (:func:`qkv.kernels.q5_codes`) as float32 ``(rows, in)``: ``d · scale · q - dmin · minimum``, the
    ``gguf`` package's numbers for the file's blocks."""
    rows, pairs = codes.shape[:2]
    words = codes[..., BLOCK:].view(rows, pairs, 2, 4, 1)
    fifth = (words >> torch.arange(8, dtype=torch.uint8) & 1).view(rows, pairs, 2, BLOCK)
    q = (_low_bits(codes) | fifth << 4).view(rows, -1).float()
    d, dmin = (t.float().repeat_interleave(SUPER // BLOCK, 1) for t in dm.unbind(-1))
    scale, offset = (d * sub[:, 0].float()).repeat_interleave(BLOCK, 1), (dmin * sub[:, 1].float())
    return scale * q - offset.repeat_interleave(BLOCK, 1)


class _KQuantLinear(_KernelProduct, QuantizedLinear):
    """What the layers holding a GGUF file's K-quant blocks as stored share: made from a file's blocks only, not
    from float weights; ``in_features`` a multiple of 256 (a super-block); buffers ``codes``, ``super_scales`` and
    ``sub_scales``, which ``_widen`` turns into weights."""

    input_dtype = torch.float32
    _widen: Callable[[Tensor, Tensor, Tensor], Tensor]

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        if in_features % SUPER:
            raise ValueError(f"K-quant blocks hold {SUPER} inputs; the layer has {in_features}")
        QuantizedLinear.__init__(self, in_features, out_features, bias=bias, outliers=outliers)

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        rows = slice(None) if outputs is None else outputs.to(self.codes.device)
        return type(self)._widen(self.codes[rows], self.super_scales[rows], self.sub_scales[rows])

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        return _widened(*self._blocks(), start, end, out)

    def _blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.codes, self.super_scales, self.sub_scales


class KernelInt5Linear(_KQuantLinear):
    """``y = x Ŵᵀ + b`` with Ŵ a GGUF file's Q5_K blocks as stored, multiplied by qkv's kernel: five-bit codes ``q``,
    a six-bit scale and minimum for each 32 inputs and fp16 ``d`` and ``dmin`` for each 256, ``W = d · scale · q -
    dmin · minimum``, 5.6 bits a weight (5.5 in the file, whose scales are packed tighter).

    Buffers: ``codes`` ``(out_features, in_features / 64, 40)`` uint8 (q4.c's Q5 layout), ``super_scales``
    ``(out_features, in_features / 256, 2)`` float16 (``d``, ``dmin``) and ``sub_scales`` ``(out_features, 2,
    in_features / 32)`` uint8 (the scales, then the minimums).

    Raises:
        ValueError: ``in_features`` not a multiple of 256.
    """

    mode = "int5"
    _widen = staticmethod(q5_weights)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, outliers=outliers)
        self.register_buffer("codes", torch.zeros(out_features, in_features // (2 * BLOCK), Q5_PAIR,
                                                  dtype=torch.uint8))
        self.register_buffer("super_scales", torch.zeros(out_features, in_features // SUPER, 2, dtype=torch.float16))
        self.register_buffer("sub_scales", torch.zeros(out_features, 2, in_features // BLOCK, dtype=torch.uint8))

    def write_blocks(self, start: int, q: Tensor, dm: Tensor, scales: Tensor, mins: Tensor) -> None:
        """Rows ``start ...`` from a file's Q5_K blocks (:func:`~qkv.interop.ggml_blocks.q5_k_blocks`): the codes
        ``(r, in)`` in 0..31, ``d`` and ``dmin`` ``(r, in / 256, 2)`` float16, the scales and minimums ``(r, in / 32)``
        each."""
        end = start + len(q)
        self.codes[start:end] = q5_codes(q)
        self.super_scales[start:end] = dm
        self.sub_scales[start:end] = torch.stack([scales, mins], dim=1)

    def _format(self) -> str:
        return "5-bit, GGUF's Q5_K blocks as stored, qkv's kernel"


class KernelInt6Linear(_KQuantLinear):
    """``y = x Ŵᵀ + b`` with Ŵ a GGUF file's Q6_K blocks as stored, multiplied by qkv's kernel: six-bit codes ``q``,
    an int8 scale for each 16 inputs and an fp16 ``d`` for each 256, ``W = d · scale · (q - 32)``, 6.6 bits a
    weight where int8 per block of 32 takes 8.5. Made from a file's blocks only (:meth:`write_blocks`), not from
    float weights.

    Buffers: ``codes`` ``(out_features, in_features / 64, 48)`` uint8 (q4.c's Q6 layout), ``super_scales``
    ``(out_features, in_features / 256)`` float16 and ``sub_scales`` ``(out_features, in_features / 16)`` int8.

    Raises:
        ValueError: ``in_features`` not a multiple of 256.
    """

    mode = "int6"
    _widen = staticmethod(q6_weights)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, outliers=outliers)
        self.register_buffer("codes", torch.zeros(out_features, in_features // (2 * BLOCK), Q6_PAIR,
                                                  dtype=torch.uint8))
        self.register_buffer("super_scales", torch.zeros(out_features, in_features // SUPER, dtype=torch.float16))
        self.register_buffer("sub_scales", torch.zeros(out_features, in_features // 16, dtype=torch.int8))

    def write_blocks(self, start: int, q: Tensor, d: Tensor, sub: Tensor) -> None:
        """Rows ``start ...`` from a file's Q6_K blocks (:func:`~qkv.interop.ggml_blocks.q6_k_blocks`): the codes
        ``(r, in)`` in 0..63, ``d`` ``(r, in / 256)`` float16 and the int8 scales ``(r, in / 16)``."""
        end = start + len(q)
        self.codes[start:end] = q6_codes(q)
        self.super_scales[start:end] = d
        self.sub_scales[start:end] = sub

    def _format(self) -> str:
        return "6-bit, GGUF's Q6_K blocks as stored, qkv's kernel"


def _fp16(values: Tensor) -> Tensor:
    """Scales (and offsets) as the kernel's layers hold them, in fp16, or one line on what fp16 cannot hold."""
    halves = values.half()
    if not torch.isfinite(halves).all():
        raise ValueError("weights beyond fp16's range (65504) cannot be held for qkv's kernel; quantize with "
                         "QKV_KERNEL=torch")
    return halves


__all__ = ["KernelInt4Linear", "KernelInt5Linear", "KernelInt6Linear", "KernelInt8Linear"]
