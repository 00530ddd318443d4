"""Several linear layers that read the same input, as one.

``[y_1, y_2, ...] = x [W_1; W_2; ...]ᵀ + [b_1; b_2; ...]``: stacking the weight rows (and biases) gives one layer
whose outputs are the separate layers' outputs side by side, in one matrix product instead of several.
:class:`~qkv.nn.StackedSelfAttention` and :class:`~qkv.nn.StackedFeedForward` are built with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def stack_linears(layers: Sequence[nn.Module]) -> nn.Linear | None:
    """One ``nn.Linear`` whose rows are those of ``layers``, in order; None unless every one is a plain
    ``nn.Linear`` (a quantized layer, for instance, cannot be stacked this way)."""
    if any(type(layer) is not nn.Linear for layer in layers):
        return None
    weight = torch.cat([layer.weight.detach() for layer in layers])
    stacked = nn.Linear(weight.size(1), weight.size(0), bias=layers[0].bias is not None, device=weight.device,
                        dtype=weight.dtype)
    with torch.no_grad():
        stacked.weight.copy_(weight)
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([layer.bias.detach() for layer in layers]))
    return stacked
