"""A float32 linear layer whose decoding products run on qkv's own kernel.

PyTorch computes the product of one input row (or a few: a decoding step's) with its BLAS's matrix-vector routine,
on one thread; reading the weights is all such a product does, and one core reads them at a fraction of the memory
bandwidth the others would add. :class:`FloatLinear` is ``nn.Linear`` (the same weights, state dict and results to
float rounding) whose products of at most ``FEW`` rows go to :func:`qkv.kernels.ops.linear`, the output rows split
over PyTorch's threads; more rows, a gradient, another dtype or device keep PyTorch's product. A model read to
decode in float32 on a CPU holds its layers so (:func:`qkv.quantize.float_layers`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ops

FEW = 8  # the most rows a product of which qkv's kernel computes (beyond, PyTorch's threaded matrix product wins)


class FloatLinear(nn.Linear):
    """``nn.Linear``, its products of a few rows (decoding) on qkv's kernel (:func:`qkv.kernels.ops.linear`)."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if x.numel() <= FEW * x.size(-1) and w.dtype == x.dtype and w.is_contiguous() and ops.applies(x):
            return ops.linear(x, w, self.bias)
        return F.linear(x, w, self.bias)

    @classmethod
    def adopt(cls, linear: nn.Linear) -> FloatLinear:
        """``linear`` itself, now of this class (its parameters and hooks kept, nothing copied)."""
        linear.__class__ = cls
        return linear


def product(layer: nn.Module, x: Tensor) -> Tensor:
    """``layer(x)`` in a decoding step already found to run on qkv's own operations
    (:func:`qkv.kernels.ops.applies`; ``x`` contiguous): straight through the layer's bound kernel call where it has
    one (a quantized layer that is its product alone: :meth:`qkv.quantized.QuantizedLinear._make_lean`), as a module
    otherwise. A module call and its checks cost microseconds, and a small model's step makes a hundred of them."""
    lean = layer.__dict__.get("_lean")
    return layer(x) if lean is None else lean(x)
