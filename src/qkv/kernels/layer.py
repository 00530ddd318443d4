"""An int4 layer that multiplies with qkv's own kernel (``q4.c``) instead of PyTorch's.

:class:`~qkv.quantize.Int4Linear` keeps its codes in the layout PyTorch's kernel reads, which depends on the CPU
(rows in blocks of 32 or 64, input by input). :class:`KernelInt4Linear` holds the same numbers — 4-bit codes in
groups of 32 inputs, a bfloat16 scale and zero point per group, ``W ≈ (q - 8) · s + z`` — in the layout of
qkv's kernel, which is GGUF's: each row's codes in order, a group's 32 in 16 bytes, byte ``i`` holding input ``i``
in its low nibble and input ``i + 16`` in its high one. A Q4_0 or Q4_1 file's blocks are copied in as they are.

Everything else (the bias, fp32 outlier columns, the backward pass through the frozen codes, the largest outputs
of an output layer) is :class:`~qkv.quantize.QuantizedLinear`'s. :func:`qkv.quantize.int4_class` picks this
layer wherever the kernel is built and the groups are 32 wide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..quantize import Int4Linear, QuantizedLinear, check_int4, unpaired
from . import BLOCK, dequantize, linear, rounded_activations

_GROUP_BYTES = BLOCK // 2
WIDEN_ROWS = 16  # from this many input rows on, widened weights and a float product beat the kernel (measured)
WIDEN_TILE_WEIGHTS = 1 << 18  # weights widened at a time for that product: 1 MB of float32, in a core's cache


class KernelInt4Linear(Int4Linear):
    """``y = x Ŵᵀ + b`` with Ŵ in 4 bits, multiplied by qkv's int4 × int8 kernel.

    Buffers: ``codes`` ``(out_features, in_features / 2)`` uint8 (GGUF's order, see the module's text),
    ``group_scales`` and ``group_zeros`` ``(out_features, in_features / 32)`` bfloat16 (``scales`` and ``zeros``,
    as :class:`~qkv.quantize.Int4Linear` names them).

    Raises:
        ValueError: ``in_features`` not a multiple of 32 (or a group size other than 32).
    """

    input_dtype = torch.float32  # the kernel quantizes its input to int8 itself: nothing is lost to bf16 first

    def __init__(self, in_features: int, out_features: int, *, group_size: int = BLOCK, bias: bool = False,
                 outliers: int = 0) -> None:
        check_int4("the layer", in_features, group_size)
        if group_size != BLOCK:
            raise ValueError(f"qkv's int4 kernel multiplies groups of {BLOCK} inputs, got group_size={group_size}")
        QuantizedLinear.__init__(self, in_features, out_features, bias=bias, outliers=outliers)  # not PyTorch's layout
        self.group_size = BLOCK
        groups = in_features // BLOCK
        self.register_buffer("codes", torch.full((out_features, in_features // 2), 0x88, dtype=torch.uint8))
        self.register_buffer("group_scales", torch.zeros(out_features, groups, dtype=torch.bfloat16))
        self.register_buffer("group_zeros", torch.zeros(out_features, groups, dtype=torch.bfloat16))

    @property
    def scales(self) -> Tensor:
        return self.group_scales

    @property
    def zeros(self) -> Tensor:
        return self.group_zeros

    def write_rows(self, start: int, codes: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` of the layer: their codes ``(r, in)`` in [0, 15], scales and zeros ``(r, n_groups)``."""
        groups = codes.to(torch.uint8).view(len(codes), -1, 2, _GROUP_BYTES)  # inputs i and i + 16 of each group
        self.codes[start : start + len(codes)] = (groups[:, :, 0] | groups[:, :, 1] << 4).view(len(codes), -1)
        self._write_groups(start, scales, zeros)

    def write_pairs(self, start: int, pairs: Tensor, span: int, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` from codes packed two to a byte as ggml stores them (``span``: inputs ``j`` and
        ``j + span`` share a byte): with a span of 16 (Q4_0, Q4_1) the bytes are this layer's, copied as they
        are."""
        if span != _GROUP_BYTES:
            self.write_rows(start, unpaired(pairs.reshape(len(pairs), -1), span), scales, zeros)
            return
        self.codes[start : start + len(pairs)] = pairs.reshape(len(pairs), -1)
        self._write_groups(start, scales, zeros)

    def _write_groups(self, start: int, scales: Tensor, zeros: Tensor) -> None:
        self.scales[start : start + len(scales)] = scales.to(torch.bfloat16)
        self.zeros[start : start + len(zeros)] = zeros.to(torch.bfloat16)

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        """The reference: every weight ``(q - 8) · scale + zero`` from the buffers, in torch."""
        rows = slice(None) if outputs is None else outputs.to(self.codes.device)
        codes, scales, zeros = self.codes[rows], self.scales[rows], self.zeros[rows]
        groups = codes.view(len(codes), -1, 1, _GROUP_BYTES)
        levels = torch.cat([groups & 15, groups >> 4], dim=2).view(len(codes), -1, BLOCK).float()
        return ((levels - 8) * scales.float()[..., None] + zeros.float()[..., None]).view(len(codes), -1)

    def _tile_rows(self) -> int:
        return QuantizedLinear._tile_rows(self)  # any rows: each is read where it lies

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        """Rows ``start`` to ``end`` widened by the kernel's library: the numbers :meth:`_decoded` gives."""
        return dequantize(self.codes[start:end], self.scales[start:end], self.zeros[start:end], out)

    def _make_product(self) -> Callable[[Tensor], Tensor]:
        """A few rows: the int4 × int8 kernel. From :data:`WIDEN_ROWS` rows on (a prompt, a batch), the same
        int8-rounded inputs times the weights widened a tile of rows at a time, by PyTorch's float matrix
        product: equal up to float rounding, and several times faster there (docs/quantization.md)."""
        codes, scales, zeros = self.codes, self.scales, self.zeros
        tile = max(1, WIDEN_TILE_WEIGHTS // self.in_features)

        def product(x: Tensor) -> Tensor:
            if x.size(0) < WIDEN_ROWS:
                return linear(x, codes, scales, zeros)
            inputs = rounded_activations(x).T.contiguous()  # (in, batch): each tile's outputs are rows of y^T
            y = x.new_empty(len(codes), x.size(0))
            weights = x.new_empty(min(tile, len(codes)), self.in_features)
            for start in range(0, len(codes), tile):
                end = min(start + tile, len(codes))
                w = dequantize(codes[start:end], scales[start:end], zeros[start:end], weights[: end - start])
                torch.mm(w, inputs, out=y[start:end])
            return y.T.contiguous()

        return product

    def _format(self) -> str:
        return "int4, group_size=32, qkv's kernel"


__all__ = ["KernelInt4Linear"]
