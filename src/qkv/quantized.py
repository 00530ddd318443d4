"""Weight-only quantization: linear layers that store their weights in 8 or 4 bits.

Decoding one token of a small model reads every weight once and does little arithmetic with each, so its speed
is the speed of reading weights. Storing them in fewer bits reads fewer bytes; PyTorch's CPU kernels widen the
weights on the fly. Those kernels are fast with bf16 activations only (measured timings: docs/quantization.md),
so a quantized layer rounds its input and output to bf16 (8 significant bits: a relative error of at most 0.2%);
everything between the layers (norms, attention, residuals) stays in fp32. The scales are stored in bf16 too, so
:meth:`QuantizedLinear.dequantized` is exactly what the kernel multiplies.

One class per format over a shared base: :class:`QuantizedLinear` holds what every format shares (the sizes, the
bias, the outlier columns, the forward pass, the output layer's exact largest outputs, the outline of
:meth:`~QuantizedLinear.from_linear`); :class:`Int8Linear` and :class:`Int4Linear` each hold their own encoding,
decoding and CPU product. :data:`FORMATS` names them for :func:`quantize`.

**int8, per output channel (symmetric)** (:class:`Int8Linear`). Row *j* of W (the weights of output *j*) gets one
scale, ``s_j = max_i |W_ji| / 127``; the stored codes are ``q_ji = round(W_ji / s_j)`` in [-127, 127] and
``W_ji ≈ s_j · q_ji``. Then ``y_j = s_j · Σ_i x_i q_ji``: one multiplication per output, after the sum.
Kernel: ``torch.ops.aten._weight_int8pack_mm`` (inputs padded to a multiple of 16 wide: other widths crash it).
It reads the weights once per input row, so its time grows with the rows; from 32 rows on (a prompt, a batch of
sentences) a layer instead widens ``s_j · q_ji`` to bf16 weights and uses PyTorch's bf16 matrix product, which
reuses each weight across rows and is several times faster with hundreds of rows (measured timings:
docs/quantization.md), for one more rounding of each weight (at most 0.2% of it, under half an int8 step). The
widened copy lives for one product only, so the model stays at 8 bits. (Not done for int4: unpacking its groups
in Python costs more than the kernel saves below about 100 rows.)

**int4, group-wise (asymmetric)** (:class:`Int4Linear`). Each row is cut into groups of ``group_size``
consecutive inputs; a group with smallest weight *lo* and largest *hi* gets a scale ``s = (hi - lo) / 15`` and a
zero point ``z = lo + 8 s`` (the middle of its range), and codes ``q = round((W - z) / s) + 8`` in [0, 15], so
``W ≈ (q - 8) · s + z``: sixteen levels spread over the group's own range (a zero point as well as a scale,
because a group's weights need not be centred on 0). This is the line PyTorch's kernel
(``_weight_int4pack_mm_for_cpu``) computes. Smaller groups follow the weights more closely and cost more
scales (two bf16 numbers per group: 32 inputs a group add 1 bit a weight).

Only ``nn.Linear`` layers are quantized (every projection, feed-forward and output layer); embeddings, norms and
biases stay in fp32, an embedding because a step reads one row of it, not all. A tied output layer gets its
own quantized copy of the embedding table, which stays in fp32 for the lookup. With int4, the output layer
(the one a model names as ``output_layer``) is quantized to int8 instead, as llama.cpp keeps it at higher
precision: its errors move the logits directly, and near-tied tokens swap (SmolLM2's output table, stored as
Q8_0 in its GGUF file, comes back with 9% error at 4 bits and 1.2% at 8).

**Weights read quantized** (:mod:`qkv.interop.at_rest`). A GGUF file's weights go straight into these layers,
never through a float32 copy of the model. Which formats are taken over exactly and which are quantized again:

* **Q4_0, Q4_1, Q4_K: repacked.** Their blocks are this int4 format with groups of 32 (``W = d (q - 8)``,
  ``W = d q + m``, and per 32-weight sub-block ``W = d·sc q - dmin·m``), so their 4-bit codes are taken over as
  stored. qkv's own kernel (:mod:`qkv.kernels`, the default wherever it is built) keeps each group's scale and
  offset in fp16, as the file does (Q4_0 and Q4_1 exactly); this class rounds them to bf16: at most 2⁻⁹ of each,
  a weight error under a thirtieth of one 4-bit step.
* **Q8_0** is held as stored by qkv's kernel (int8 codes, an fp16 scale per 32 inputs), and so are **Q6_K** and
  **Q5_K** (:class:`~qkv.kernel_layers.KernelInt6Linear`, :class:`~qkv.kernel_layers.KernelInt5Linear`) where
  every tensor of a layer is of that kind, ``mode`` is ``"auto"`` and the kernel runs its AVX-512 variant
  (:func:`qkv.interop.at_rest.holds_k_quants`); **F16, BF16, F32 matrices** (and the
  K-quants otherwise) are quantized again, to int8 per 32 inputs there (per output row with PyTorch's kernel,
  :class:`Int8Linear`, which also takes Q8_0 again per row), or to int4 when asked, from their decoded values a
  few hundred rows at a time: half an int8 step of the block's (the row's) largest weight.
* **The token table**: int8 as above (a K-quant as stored), one copy shared with a tied output layer
  (:class:`QuantizedEmbedding`); looked up, a row is widened to fp32. On SmolLM2-135M the whole model read this way
  keeps perplexity within 1.5% of float32 on a short text (tested), 0.03% on 20,000 characters through qkv's kernel
  (docs/quantization.md).

A Hugging Face folder's bf16, fp16 or fp32 weights are read the same way, a slice at a time, into float32
layers or (``--quantize int8|int4``) these formats, the codes those of :func:`quantize` on the whole model.

**Outlier inputs (optional, needs calibration text).** A layer's error is ``Σ_i x_i (Ŵ_ji - W_ji)``: the rounding
of column *i* is multiplied by input *i*. Some inputs are several times larger than the rest, the same ones for
every text (in all-MiniLM-L6-v2 up to 17× the median), and their columns' rounding dominates the error.
:func:`input_magnitudes` runs the model on calibration text (:data:`CALIBRATION_TEXT`) and records each layer's
mean ``|x_i|``; given those, :func:`quantize` keeps the ``outliers`` columns with the largest inputs in fp32: they
are left out of the scales' ranges, and the layer adds ``x[..., cols] @ (W - Ŵ)[:, cols]ᵀ`` to the kernel's
output, so they count with their fp32 weights. LLM.int8() splits out outlier features the same way (at run time,
for activations); here calibration fixes them, for weights. 16 columns a layer halve all-MiniLM-L6-v2's largest
change of a cosine similarity and raise SmolLM2's greedy agreement with fp32, for one more small product a layer
(about 15% of a decoding step). Scaling the outlier columns instead (AWQ) does not help per-channel int8: scaled
columns raise their rows' largest weight, and with it every step. With int4 on SmolLM2 it does not help either:
the groups already sit on the GGUF file's own 4-bit levels, which zeroed columns would move.

**A decoding step.** :func:`quantize` first builds each self-attention of an encoder or decoder layer again as a
:class:`~qkv.nn.StackedSelfAttention` (its Q, K and V projections one layer) and each gated feed-forward as a
:class:`~qkv.nn.StackedFeedForward` (its gate and up projections one layer), see :func:`stack_projections`: rows
stacked, so the codes and outputs are those of the separate layers, in fewer, larger products, each with a fixed
cost on a CPU. The output layer recomputes each row's largest outputs in fp32 from its codes
(:meth:`QuantizedLinear._exact_largest`): the bf16 output rounds logits near 16 to steps of 1/16, enough to tie
the two best tokens and flip greedy's choice.

The codes are held in the layouts PyTorch's CPU kernels read (int8 rows; int4 in blocks of rows, 32 or 64 by the
CPU's vector width, see :class:`Int4Linear`), so each layer is one copy of its weights, multiplied by as it is.
The state-dict keys of a quantized model are those of the model it was made from, except the stacked layers
(``self_attn.qkv_proj``, ``feed_forward.gate_up``) and int4's ``scales_and_zeros``; qkv itself writes no quantized
model to disk (the command line quantizes after loading).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .options import DEFAULT_GROUP_SIZE, GROUP_SIZES

INT8_WIDTH_STEP = 16  # PyTorch's int8 kernel reads inputs in sixteens (other widths crash it): pad to a multiple
WIDEN_ROWS = 32  # int8: from this many input rows on, a bf16 product with widened weights beats the kernel ...
WIDEN_MAX_WEIGHTS = 1 << 22  # ... for layers small enough to widen quickly (not a 49k-row output table)


def _bf16(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest bf16 value, kept in fp32."""
    return x.to(torch.bfloat16).float()


def check_int4(name: str, in_features: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"the int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"cannot quantize {name} to int4: its {in_features} inputs are not divisible by the group "
                         f"size {group_size}; choose a group size that divides every layer's width")


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W stored in fewer bits: what every format shares (see the module's text).

    A format (:class:`Int8Linear`, :class:`Int4Linear`) registers its ``codes`` and ``scales`` (and whatever else
    it stores) and says how to fill them from fp32 weights (``_encode``), what weights they stand for
    (``_decoded``) and how PyTorch's CPU kernel multiplies by them (``_make_product``). This class keeps the rest:
    the bias, the input columns kept in fp32 (``outliers``), the forward pass, and the output layer's largest
    outputs computed in fp32 (``exact_largest``, set by :func:`quantize`).

    Args:
        in_features: input width.
        out_features: output width.
        bias: whether the layer adds a bias (kept in fp32).
        outliers: how many input columns stay in fp32.

    Raises:
        ValueError: ``outliers`` outside 0 to ``in_features``.

    Shape:
        x ``(..., in_features)`` -> ``(..., out_features)``.
    """

    mode: str  # the format's name in quantize(): "int8" or "int4"
    input_dtype = torch.bfloat16  # what the CPU product takes (PyTorch's kernels: bf16)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        super().__init__()
        if not 0 <= outliers <= in_features:
            raise ValueError(f"outliers must be between 0 and the layer's {in_features} inputs, got {outliers}")
        self.in_features, self.out_features, self.outliers = in_features, out_features, outliers
        if outliers:  # input columns kept in fp32
            self.register_buffer("outlier_columns", torch.zeros(outliers, dtype=torch.long))
            self.register_buffer("outlier_weights", torch.zeros(outliers, out_features))  # (W - Ŵ)[:, cols]ᵀ
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._product: Callable[[Tensor], Tensor] | None = None  # the kernel call, made on first use
        self._lean: Callable[[Tensor], Tensor] | None = None  # decoding's call, where it is the product alone
        self.exact_largest = False  # an output layer: see _exact_largest (set by quantize)

    @property
    def exact_largest(self) -> bool:
        """Each row's largest outputs computed again in fp32 (an output layer: see :meth:`_exact_largest`)."""
        return self._exact_largest_on

    @exact_largest.setter
    def exact_largest(self, on: bool) -> None:
        self._exact_largest_on = on
        self._forget_product()

    def _forget_product(self) -> None:
        """The kernel's calls are made again at the next use (new codes, moved buffers, another output rule)."""
        self._product = self._lean = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, outlier_columns: Tensor | None = None, **options) -> QuantizedLinear:
        """The quantized copy of ``linear`` in this format; ``outlier_columns`` (input indices) stay in fp32;
        ``options`` are the format's own (:class:`Int4Linear`'s ``group_size``)."""
        n_outliers = 0 if outlier_columns is None else len(outlier_columns)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, outliers=n_outliers,
                    **options)
        with torch.no_grad():
            w = linear.weight.detach().float().cpu()
            if n_outliers:
                columns = outlier_columns.detach().long().cpu()
                layer.outlier_columns.copy_(columns)
                outlier_weights = w[:, columns]
                w = w.index_fill(1, columns, 0.0)  # out of the scales' ranges
            layer._encode(w)
            if n_outliers:  # what the fp32 columns add to the codes' own value there (0 for int8, not for int4)
                layer.outlier_weights.copy_((outlier_weights - layer._decoded()[:, columns]).T)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach().float())
        return layer.to(linear.weight.device)

    def _encode(self, w: Tensor) -> None:
        """Fill the codes and scales from the fp32 weight ``w`` ``(out_features, in_features)``, outlier columns
        zero."""
        raise NotImplementedError

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        """The codes times their scales (outlier columns zero), fp32: every row, or the rows of ``outputs``."""
        raise NotImplementedError

    def _make_product(self) -> Callable[[Tensor], Tensor]:
        """The function ``(rows, in_features) bf16 -> (rows, out_features) bf16`` that runs PyTorch's CPU kernel on
        the codes in its own layout."""
        raise NotImplementedError

    def _tile_rows(self) -> int:
        """How many output rows the backward pass widens at a time (about :data:`BACKWARD_TILE_WEIGHTS` weights)."""
        return max(1, BACKWARD_TILE_WEIGHTS // self.in_features)

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        """Rows ``start`` to ``end`` of :meth:`_decoded`, written into ``out`` ``(end - start, in_features)``
        fp32 (the same numbers); returns ``out``. A format reads its rows where they lie; this default gathers
        them."""
        return out.copy_(self._decoded(torch.arange(start, end)))

    def dequantized(self, outputs: Tensor | None = None) -> Tensor:
        """The fp32 weight the codes stand for, ``(out_features, in_features)``, outlier columns included: the
        reference the kernel is tested against. Only the rows of ``outputs`` if given."""
        weights = self._decoded(outputs)
        if self.outliers:
            extra = self.outlier_weights.T if outputs is None else self.outlier_weights.T[outputs]
            weights = weights.index_add(1, self.outlier_columns, extra)
        return weights

    def _exact_largest(self, x: Tensor, y: Tensor) -> Tensor:
        """``y`` (from the kernel, in bf16) with each row's largest outputs computed again in fp32: those within
        2⁻⁶ of the row's maximum, which holds every output that could be the largest before the bf16 rounding
        (bf16 keeps 8 significant bits). x ``(rows, in_features)`` fp32, y ``(rows, out_features)`` fp32, bias
        included."""
        top = y.amax(dim=-1, keepdim=True)
        rows, outputs = (y >= top - top.abs() * 2**-6).nonzero(as_tuple=True)
        exact = (x[rows] * self.dequantized(outputs)).sum(-1)
        if self.bias is not None:
            exact = exact + self.bias[outputs]
        return y.index_put((rows, outputs), exact)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._forget_product()  # new codes: repack on next use
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):  # moved or cast: the kernel call must see the new buffers
        self._forget_product()
        return super()._apply(fn, *args, **kwargs)

    def _cpu_product(self) -> Callable[[Tensor], Tensor]:
        """The format's CPU product, made once: a decoding step calls each layer once a token, so work that does
        not depend on the input (repacking, padding, looking up buffers) is done there, not at every call."""
        if self._product is None:
            self._product = self._make_product()
            if self.outliers and self.input_dtype == torch.float32:
                self._product = self._without_outlier_inputs(self._product)
            if self.bias is None and not self.outliers and not self.exact_largest:
                self._lean = self._make_lean()
        return self._product

    def _make_lean(self) -> Callable[[Tensor], Tensor] | None:
        """Decoding's product, where the layer is the product alone (no bias, outlier columns or exact largest
        outputs): ``x`` ``(..., in_features)`` contiguous float32 with no gradient, called straight from
        :meth:`forward` (each Python step a decoding token takes costs microseconds, and a small model's step is
        hundreds of products). None where the format has none (qkv's kernel layers do)."""
        return None

    def _without_outlier_inputs(self, product: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """``product`` for a kernel that quantizes its inputs per block (qkv's): an outlier input would coarsen the
        other inputs of its block, so the outlier columns go to the kernel as zeros and their codes' share is
        added in fp32 (the same sum: the codes' values there, times the inputs)."""
        columns = self.outlier_columns
        codes_there = self._decoded()[:, columns].T.contiguous()  # (outliers, out_features)

        def without(x: Tensor) -> Tensor:
            return torch.addmm(product(x.index_fill(1, columns, 0.0)), x.index_select(1, columns), codes_there)

        return without

    def forward(self, x: Tensor) -> Tensor:
        lean = self._lean
        if (lean is not None and not torch.compiler.is_compiling() and not x.requires_grad and x.is_contiguous()
                and x.dtype == torch.float32 and x.device.type == "cpu"):
            return lean(x)
        flat = x.reshape(-1, self.in_features)
        if self._plain(x):  # decoding's common case: the product alone, nothing converted or added
            return self._cpu_product()(flat.contiguous()).view(*x.shape[:-1], self.out_features)
        rows = flat.to(self.input_dtype).contiguous()
        if x.is_cpu and not (rows.requires_grad and torch.is_grad_enabled()):  # no backward: the kernel alone
            y = self._cpu_product()(rows).to(x.dtype)
        elif x.is_cpu:
            y = _QuantizedProduct.apply(rows, self).to(x.dtype)
        else:  # the kernels are the CPU's; elsewhere, widen the weights
            y = (rows.float() @ self._decoded().to(x.device).T).to(torch.bfloat16).to(x.dtype)
        if self.outliers:
            y = torch.addmm(y, flat.index_select(1, self.outlier_columns), self.outlier_weights)
        if self.bias is not None:
            y = y + self.bias
        if self.exact_largest:
            y = self._exact_largest(flat.float(), y.float()).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _plain(self, x: Tensor) -> bool:
        """Whether ``x``'s product is the kernel's alone: on the CPU, in the kernel's input type, no backward, no
        bias, outlier columns or exact largest outputs to add."""
        return (x.dtype == self.input_dtype and x.is_cpu and self.bias is None and not self.outliers
                and not self.exact_largest and not (x.requires_grad and torch.is_grad_enabled()))

    def _format(self) -> str:
        return self.mode

    def extra_repr(self) -> str:
        outliers = f", {self.outliers} fp32 columns" if self.outliers else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._format()}{outliers}"


BACKWARD_TILE_WEIGHTS = 1 << 18  # the backward pass dequantizes this many weights at a time (1 MB of float32)


class _QuantizedProduct(torch.autograd.Function):
    """``y = x Ŵᵀ`` by the format's CPU kernel, which has no backward pass of its own; the backward pass is
    ``∂L/∂x = ∂L/∂y · Ŵ``, with Ŵ (:meth:`QuantizedLinear._decoded`) widened to float32 a tile of output rows
    at a time into one buffer, so that training through a quantized layer (QLoRA) never holds its float32 weights
    whole, nor makes new memory for every tile. The weights themselves get no gradient: they are frozen codes."""

    @staticmethod
    def forward(ctx, rows: Tensor, layer: QuantizedLinear) -> Tensor:
        ctx.layer, ctx.dtype = layer, rows.dtype
        return layer._cpu_product()(rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        layer = ctx.layer
        tile = layer._tile_rows()
        grad = grad.float()
        out = grad.new_zeros(grad.size(0), layer.in_features)
        weights = grad.new_empty(min(tile, layer.out_features), layer.in_features)
        for start in range(0, layer.out_features, tile):
            end = min(start + tile, layer.out_features)
            out.addmm_(grad[:, start:end], layer._decoded_rows(start, end, weights[: end - start]))  # (rows, in)
        return out.to(ctx.dtype), None


class Int8Linear(QuantizedLinear):
    """W stored as int8 with one bf16 scale per output channel: ``W_ji ≈ s_j · q_ji``, ``s_j = max_i |W_ji| / 127``.

    Buffers: ``codes`` ``(out_features, in_features)`` int8, ``scales`` ``(out_features,)`` bf16.
    """

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, outliers: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, outliers=outliers)
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16))

    @staticmethod
    def encoded(w: Tensor) -> dict[str, Tensor]:
        """The codes ``(rows, in)`` int8 and scales ``(rows,)`` of fp32 rows ``w``."""
        scales = _bf16(w.abs().amax(dim=1).clamp(min=1e-12) / 127)
        return {"codes": (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), "scales": scales}

    def _encode(self, w: Tensor) -> None:
        self.write_rows(0, **self.encoded(w))

    def write_rows(self, start: int, codes: Tensor, scales: Tensor) -> None:
        """Rows ``start ...`` of the layer: their codes ``(r, in)`` int8 and scales ``(r,)``."""
        self.codes[start : start + len(codes)] = codes
        self.scales[start : start + len(codes)] = scales.to(torch.bfloat16)
        self._forget_product()  # the kernel's copy of the codes, padded to its width step, is made again

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        codes, scales = (self.codes, self.scales) if outputs is None else (self.codes[outputs], self.scales[outputs])
        return codes.float() * scales.float()[:, None]

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        return out.copy_(self.codes[start:end]).mul_(self.scales[start:end].float()[:, None])

    def _make_product(self) -> Callable[[Tensor], Tensor]:
        codes, scales, kernel = self.codes, self.scales, torch.ops.aten._weight_int8pack_mm
        pad = -self.in_features % INT8_WIDTH_STEP
        padded = F.pad(codes, (0, pad)) if pad else codes  # columns of zeros
        widen = codes.numel() <= WIDEN_MAX_WEIGHTS

        def product(x: Tensor) -> Tensor:
            if widen and x.size(0) >= WIDEN_ROWS:
                return F.linear(x, codes.to(torch.bfloat16) * scales[:, None])  # weights rounded to bf16
            return kernel(F.pad(x, (0, pad)) if pad else x, padded, scales)

        return product


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F  # the low nibble of each of eight bytes


class Int4Linear(QuantizedLinear):
    """W stored as int4 in groups of ``group_size`` inputs, each with a bf16 scale and zero point:
    ``W ≈ (q - 8) · s + z``.

    Buffers, in the layout PyTorch's CPU kernel reads, so that it multiplies by them as they are (no second,
    repacked copy): ``codes`` ``(rows, in_features / 2)`` uint8 and ``scales_and_zeros`` ``(n_groups, rows, 2)``
    bf16, ``rows`` being ``out_features`` rounded up to 16 (the extra rows are zero weights). In ``codes`` the
    rows go in blocks of :func:`int4_block` rows (32 where PyTorch's kernel runs on AVX2, 64 on AVX-512; the
    last block shorter when ``rows`` is not a multiple), each block input by input: for each input column, a
    byte per two rows of the block — rows ``i`` and ``i + block / 2`` (in a shorter last block: ``2i`` and
    ``2i + 1``), the first in the low nibble. :func:`int4_slots` computes where a code lies; :meth:`write_rows`
    and :meth:`_decoded` go through it; :func:`int4_block` finds the block against the kernel's own converter.
    ``scales`` and ``zeros`` are ``(out_features, n_groups)`` views.

    Raises:
        ValueError: a group size PyTorch's kernel does not take, or one that does not divide ``in_features``.
    """

    mode = "int4"

    def __init__(self, in_features: int, out_features: int, *, group_size: int = DEFAULT_GROUP_SIZE,
                 bias: bool = False, outliers: int = 0) -> None:
        check_int4("the layer", in_features, group_size)
        super().__init__(in_features, out_features, bias=bias, outliers=outliers)
        self.group_size = group_size
        rows = -(-out_features // 16) * 16
        self.register_buffer("codes", torch.full((rows, in_features // 2), 0x88, dtype=torch.uint8))  # code 8: 0
        self.register_buffer("scales_and_zeros", torch.zeros(in_features // group_size, rows, 2,
                                                             dtype=torch.bfloat16))

    @property
    def scales(self) -> Tensor:
        return self.scales_and_zeros[:, : self.out_features, 0].T

    @property
    def zeros(self) -> Tensor:
        return self.scales_and_zeros[:, : self.out_features, 1].T

    @staticmethod
    def encoded(w: Tensor, group_size: int) -> dict[str, Tensor]:
        """The codes ``(rows, in)`` uint8 in [0, 15], scales and zeros ``(rows, n_groups)`` of fp32 rows ``w``."""
        groups = w.view(w.size(0), -1, group_size)  # (out, n_groups, group)
        lows, highs = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = _bf16((highs - lows).clamp(min=1e-12) / 15)
        zeros = _bf16(lows + 8 * scales)
        codes = ((groups - zeros[..., None]) / scales[..., None]).round().add(8).clamp(0, 15)
        return {"codes": codes.to(torch.uint8).view(w.size(0), -1), "scales": scales, "zeros": zeros}

    def _encode(self, w: Tensor) -> None:
        self.write_rows(0, **self.encoded(w, self.group_size))

    def write_rows(self, start: int, codes: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` of the layer: their codes ``(r, in)`` in [0, 15], scales and zeros ``(r, n_groups)``."""
        codes = codes.to(torch.uint8)
        end, n_rows, block = start + len(codes), self.codes.size(0), int4_block()
        whole = start % block == 0 and (end % block == 0 or end == self.out_features)
        if whole:  # whole blocks: a reshape, not a scatter
            padded = F.pad(codes, (0, 0, 0, (-len(codes)) % 16), value=8)
            full, half = len(padded) // block * block, block // 2
            blocks = padded[:full].view(-1, 2, half, self.in_features)  # rows i and i + half of each block
            bytes_ = self.codes[start : start + full].view(-1, self.in_features, half)  # a block: input by input
            torch.bitwise_left_shift(blocks[:, 1].transpose(1, 2), 4, out=bytes_)  # written in place
            bytes_ |= blocks[:, 0].transpose(1, 2)
            if full < len(padded):  # the shorter last block: rows 2i and 2i + 1
                size = len(padded) - full
                tail = padded[full:].view(size // 2, 2, self.in_features)
                self.codes[start + full : start + len(padded)] = (tail[:, 0] | tail[:, 1] << 4).T.reshape(
                    size, self.in_features // 2)
        else:
            slots, nibbles = int4_slots(torch.arange(start, end), self.in_features, n_rows)
            data = self.codes.view(-1)
            for nibble in (0, 1):  # two rows share each byte: one nibble at a time keeps the other
                chosen = nibbles == nibble
                at = slots[chosen]
                data[at] = (data[at] & (0xF0 >> 4 * nibble)) | (codes[chosen] << 4 * nibble)
        self.scales[start : start + len(codes)] = scales.to(torch.bfloat16)
        self.zeros[start : start + len(codes)] = zeros.to(torch.bfloat16)

    def write_pairs(self, start: int, pairs: Tensor, span: int, scales: Tensor, zeros: Tensor) -> None:
        """Rows ``start ...`` from codes packed two to a byte as ggml stores them (see :func:`unpaired`):
        ``pairs`` ``(r, ...)``, each row ``in / 2`` bytes. Whole blocks of rows (:func:`int4_block`) go byte to
        byte, never a byte per code (a model's codes are gigabytes): one copy turns each row's bytes input by
        input, then rows ``i`` and ``i + block / 2`` meet in one byte by a shift and a mask, eight bytes at a
        time."""
        block = int4_block()
        if start % block or len(pairs) % block or self.in_features % (2 * span):
            self.write_rows(start, unpaired(pairs.reshape(len(pairs), -1), span), scales, zeros)
            return
        runs, half = self.in_features // (2 * span), block // 2
        rows = pairs.reshape(-1, 2, half, runs, span)  # (block, rows i / i + half, i, run, j)
        turned = torch.empty(len(rows), 2, runs, span * half, dtype=torch.uint8)  # (block, rows, run, (j, i))
        turned.view(len(rows), 2, runs, span, half).copy_(rows.permute(0, 1, 3, 4, 2))
        low, high = turned.view(torch.int64).unbind(1)  # eight bytes a number: the masks act on each byte
        out = self.codes[start : start + len(pairs)].view(len(rows), runs, 2, span * half).view(torch.int64)
        first, second = out[:, :, 0], out[:, :, 1]  # inputs j, then j + span: low nibbles, then high ones
        torch.bitwise_and(low, _LOW_NIBBLES, out=first)
        first |= (high & _LOW_NIBBLES) << 4
        torch.bitwise_right_shift(low, 4, out=second)
        second &= _LOW_NIBBLES
        second |= high & ~_LOW_NIBBLES
        self.scales[start : start + len(pairs)] = scales.to(torch.bfloat16)
        self.zeros[start : start + len(pairs)] = zeros.to(torch.bfloat16)

    def _decoded(self, outputs: Tensor | None = None) -> Tensor:
        rows = torch.arange(self.out_features) if outputs is None else outputs.cpu()
        slots, nibbles = int4_slots(rows, self.in_features, self.codes.size(0))
        codes = (self.codes.view(-1)[slots.to(self.codes.device)] >> (4 * nibbles[:, None]).to(self.codes.device)) & 15
        scales, zeros = self.scales[rows.to(self.codes.device)], self.zeros[rows.to(self.codes.device)]
        levels = codes.float().view(len(rows), -1, self.group_size)  # (rows, n_groups, group)
        weights = (levels - 8) * scales.float()[..., None] + zeros.float()[..., None]
        return weights.view(len(rows), self.in_features)

    def _tile_rows(self) -> int:
        block = int4_block()  # whole blocks of rows: each is a reshape of its bytes (see _decoded_rows)
        return max(1, super()._tile_rows() // block) * block

    def _decoded_rows(self, start: int, end: int, out: Tensor) -> Tensor:
        """Whole blocks of rows (:func:`int4_block`) straight from their bytes, input by input: the low nibbles
        are the block's first half of rows, the high ones its second half; other rows through :meth:`_decoded`."""
        block = int4_block()
        whole = (end - start) // block * block if start % block == 0 else 0
        if whole:
            half = block // 2
            bytes_ = self.codes[start : start + whole].view(-1, self.in_features, half)  # (blocks, input, i)
            rows = out[:whole].view(-1, 2, half, self.in_features)  # (blocks, first / second half, i, input)
            rows[:, 0].copy_((bytes_ & 15).transpose(1, 2))
            rows[:, 1].copy_((bytes_ >> 4).transpose(1, 2))
            levels = out[:whole].view(whole, -1, self.group_size)  # as _decoded computes them: the same numbers
            levels.sub_(8).mul_(self.scales[start : start + whole].float()[..., None])
            levels.add_(self.zeros[start : start + whole].float()[..., None])
        if whole < end - start:
            out[whole:].copy_(self._decoded(torch.arange(start + whole, end)))
        return out

    def _make_product(self) -> Callable[[Tensor], Tensor]:
        int4_block()
        codes, scales_and_zeros, kernel = self.codes, self.scales_and_zeros, torch.ops.aten._weight_int4pack_mm_for_cpu
        group_size, out_features, padded = self.group_size, self.out_features, self.codes.size(0) != self.out_features

        def product(x: Tensor) -> Tensor:
            y = kernel(x, codes, group_size, scales_and_zeros)
            return y[:, :out_features] if padded else y

        return product

    def _format(self) -> str:
        return f"int4, group_size={self.group_size}"


def unpaired(pairs: Tensor, span: int) -> Tensor:
    """Codes packed two to a byte as ggml stores them, one code per byte in the inputs' order: in each run of
    ``2 · span`` inputs, byte ``j`` holds input ``j`` in its low nibble and input ``j + span`` in its high one.
    ``(rows, in / 2)`` uint8 -> ``(rows, in)``."""
    runs = pairs.reshape(len(pairs), -1, span)
    codes = torch.empty(len(pairs), runs.size(1), 2, span, dtype=torch.uint8)
    torch.bitwise_and(runs, 0x0F, out=codes[:, :, 0])
    torch.bitwise_right_shift(runs, 4, out=codes[:, :, 1])
    return codes.view(len(pairs), -1)


def int4_slots(rows: Tensor, in_features: int, n_rows: int, block: int | None = None) -> tuple[Tensor, Tensor]:
    """Where the codes of ``rows`` lie in an :class:`Int4Linear`'s ``codes`` of ``n_rows`` rows (a multiple of
    16): the flat byte of each ``(row, input)`` ``(len(rows), in_features)``, and each row's nibble (0: low).
    The rows go in blocks of ``block`` rows (default: this CPU's, :func:`int4_block`); a whole block pairs rows
    ``i`` and ``i + block / 2`` in a byte, a shorter last block rows ``2i`` and ``2i + 1``."""
    block = block or int4_block()
    start = rows // block * block
    within = rows - start
    size = (n_rows - start).clamp(max=block)  # rows in the row's block
    whole = size == block
    offset = torch.where(whole, within % (block // 2), within // 2)
    nibbles = torch.where(whole, within // (block // 2), within % 2)
    slots = (start * (in_features // 2) + offset)[:, None] + torch.arange(in_features)[None, :] * (size // 2)[:, None]
    return slots, nibbles


_BLOCK: int | None = None


def int4_block() -> int:
    """The rows of a block in PyTorch's int4 CPU layout: 32 where its kernel runs on AVX2, 64 on AVX-512; found
    once a process by packing a tracer with PyTorch's own converter and comparing it with the layout
    :func:`int4_slots` describes for each. A PyTorch whose layout is neither fails here, in one sentence, not
    with wrong numbers. (So an int4 layer's ``codes`` hold the layout of the CPU that wrote them.)"""
    global _BLOCK
    if _BLOCK is not None:
        return _BLOCK
    n_rows, in_features = 112, 64  # a whole block and a shorter one under either layout
    tracer = torch.randint(0, 16, (n_rows, in_features), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(tracer, 1).flatten().to(torch.int32)
    for block in (32, 64):
        slots, nibbles = int4_slots(torch.arange(n_rows), in_features, n_rows, block)
        shifted = (tracer << (4 * nibbles[:, None]).to(torch.int32)).flatten()
        if torch.equal(torch.zeros(theirs.numel(), dtype=torch.int32).index_add_(0, slots.flatten(), shifted), theirs):
            _BLOCK = block
            return block
    raise RuntimeError(f"PyTorch {torch.__version__}'s int4 kernel reads another layout of codes than qkv writes "
                       "(qkv.quantized.int4_slots); use --quantize int8 or none")


FORMATS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


class QuantizedEmbedding(nn.Module):
    """An embedding table held as an :class:`Int8Linear`'s codes and scales: row ``i`` is ``s_i · q_i``, looked up
    and widened to fp32 as it is read. A model whose output layer is its embedding table (tied) passes that
    layer, so one 8-bit copy serves both the lookup and the logits.

    Shape:
        ids ``(...)`` -> ``(..., embedding_dim)`` fp32.
    """

    def __init__(self, table: Int8Linear) -> None:
        super().__init__()
        self.table = table

    @property
    def num_embeddings(self) -> int:
        return self.table.out_features

    @property
    def embedding_dim(self) -> int:
        return self.table.in_features

    def forward(self, ids: Tensor) -> Tensor:
        return self.table._decoded(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.mode}"


__all__ = ["FORMATS", "Int4Linear", "Int8Linear", "QuantizedEmbedding", "QuantizedLinear", "check_int4", "int4_block",
           "int4_slots", "unpaired"]
