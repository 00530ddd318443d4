"""Normalisation over the feature dimension, written out.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * γ + β     (var biased: divide by d, not d - 1)
    RMSNorm(x)   = x / sqrt(mean(x²) + eps) * γ                  (no centring, no bias; LLaMA)
                 = x / sqrt(mean(x²) + eps) * (1 + w)            (Gemma: gains kept as their offset from 1)

Both are computed in float32 whatever the input dtype (bf16 sums of squares lose too much), then cast back.

Each module has two paths that agree (the tests check both against PyTorch's modules): the formula written out,
and PyTorch's fused kernel, which runs forward and backward about 4x faster on a CPU because it reads the
activations once instead of once per elementary operation. ``fused=True`` (the default) picks the kernel; set
``module.fused = False`` to run the formula. Without gradients, in float32 on a CPU, RMSNorm's kernel is qkv's own
(:mod:`qkv.kernels.ops`: one call, where PyTorch's takes several for a row of a few hundred numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ops


class LayerNorm(nn.Module):
    """Layer normalisation (Ba et al. 2016), matching ``nn.LayerNorm`` over the last dimension.

    Args:
        d_model: feature width.
        eps: added to the variance (1e-5 in PyTorch and GPT-2, 1e-12 in BERT).
        bias: learn the shift β (GPT-2 and BERT do; some recent models drop it).

    Shape:
        ``(..., d_model)`` -> same.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True, fused: bool = True) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(d_model))  # γ
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None  # β

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps).type_as(x)
        xf = x.float()
        mean = xf.mean(dim=-1, keepdim=True)
        var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + self.eps) * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich 2019), matching ``nn.RMSNorm``.

    Args:
        d_model: feature width.
        eps: added to the mean square (1e-5 or 1e-6 in LLaMA-style models).
        unit_offset: the gains are ``1 + weight`` (Gemma stores them so: a weight of 0 is the identity, and weight
            decay pulls the gains towards 1, not 0).

    Shape:
        ``(..., d_model)`` -> same.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6, fused: bool = True, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.fused, self.unit_offset = eps, fused, unit_offset
        self.weight = nn.Parameter(torch.zeros(d_model) if unit_offset else torch.ones(d_model))  # γ, or γ - 1
        self._offset_gains: tuple[tuple[int, int], Tensor] | None = None  # decoding's 1 + weight, and for which weight

    def gains(self) -> Tensor:
        """γ, in float32 (bf16 weights would take the fused kernel's slow path). Gains of ``1 + weight`` are kept
        while decoding (inference mode) until the weight changes: a step of Gemma's reads each layer's six norms."""
        w = self.weight
        if not self.unit_offset:
            return w if w.dtype == torch.float32 else w.float()
        if not torch.is_inference_mode_enabled() or w.is_inference():  # (an inference tensor counts no versions)
            return w.float() + 1.0
        key = (w.data_ptr(), w._version)  # a new tensor, or one written in place, makes them again
        if self._offset_gains is None or self._offset_gains[0] != key:
            self._offset_gains = key, w.float() + 1.0
        return self._offset_gains[1]

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and ops.applies(x):  # decoding on a CPU: qkv's own, one call (qkv.kernels.ops)
            return ops.rms_norm(x, self.gains(), self.eps)
        if self.fused:
            return F.rms_norm(x.float(), self.weight.shape, self.gains(), self.eps).type_as(x)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.gains()).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}" + (", gains 1 + weight" if self.unit_offset else "")


def build_norm(kind: str, d_model: int, *, eps: float, bias: bool = True, unit_offset: bool = False) -> nn.Module:
    """``"layer"`` -> :class:`LayerNorm`, ``"rms"`` -> :class:`RMSNorm` (``unit_offset``: gains ``1 + weight``)."""
    if kind == "layer":
        if unit_offset:
            raise ValueError("gains of 1 + weight (norm_offset) are an RMSNorm's; norm='layer' has none")
        return LayerNorm(d_model, eps=eps, bias=bias)
    if kind == "rms":
        return RMSNorm(d_model, eps=eps, unit_offset=unit_offset)
    raise ValueError(f"norm must be 'layer' or 'rms', got {kind!r}")
