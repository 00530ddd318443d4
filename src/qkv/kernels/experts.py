"""A mixture of experts' decoding step in two calls of qkv's kernel.

Decoding one token, :class:`~qkv.nn.moe.MoEFeedForward` runs its k experts in turn: two products each (the stacked
gate and up projections, then the down projection), and the activation, weighting and sum between them, some ten
PyTorch calls an expert. With every expert a 4-bit layer of qkv's kernel (a GGUF file's Q4 experts, read at rest),
:func:`decode_step` does the same in two calls of the kernel, each running all k experts' products in one parallel
region (``qkv_linear_x8_picked`` in ``q4.c``): the gate and up projections of the token's input, quantized once,
then each expert's down projection of its own hidden row. The numbers are those of the experts one by one (the
same blocks times the same int8 activations), summed in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..nn import StackedFeedForward
from . import available, bound_picked
from .layer import KernelInt4Linear


def decode_step(experts: nn.ModuleList) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """``(token (1, d), weights (1, k), picked (1, k)) -> (1, d)`` for these experts, or None unless each is a stacked
    gated feed-forward network of plain 4-bit kernel layers (no bias, no fp32 columns) of one shape."""
    if not available() or not all(type(e) is StackedFeedForward for e in experts):
        return None
    layers = [(e.gate_up, e.down) for e in experts]
    if not all(type(layer) is KernelInt4Linear and layer.bias is None and not layer.outliers
               for pair in layers for layer in pair):
        return None
    first = experts[0]
    shapes = {(gu.in_features, gu.out_features, down.out_features) for gu, down in layers}
    if len(shapes) > 1 or first.gate_up.codes.device.type != "cpu":
        return None
    gate_up = bound_picked([layer._blocks() for layer, _ in layers], first.gate_up.out_features)
    down = bound_picked([layer._blocks() for _, layer in layers], first.down.out_features)
    def step(token: Tensor, weights: Tensor, picked: Tensor) -> Tensor:
        ids = picked.reshape(-1).contiguous()
        hidden = first.activate(gate_up(token.float().contiguous(), ids, True)).contiguous()  # (k, ff)
        return torch.mm(weights.float(), down(hidden, ids, False)).to(token.dtype)  # Σ_j w_j · down_j(h_j)

    return step


__all__ = ["decode_step"]
