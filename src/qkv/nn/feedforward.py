"""The position-wise feed-forward network: the same two-layer MLP applied to every position alone.

    FFN(x)    = W_2 · act(W_1 x + b_1) + b_2          act = ReLU (the paper) or GELU (GPT, BERT)
    SwiGLU(x) = W_2 · (SiLU(W_g x) ⊙ W_1 x)            (Shazeer 2020; LLaMA)

Attention mixes information across positions; this is where each position is transformed on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .stacked import stack_linears

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact, erf-based (BERT)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's sigmoid approximation of GELU
}
GATED = {"swiglu": F.silu}


class FeedForward(nn.Module):
    """Linear -> activation -> dropout -> Linear, or its gated variant (SwiGLU).

    Args:
        d_model: input and output width.
        d_ff: hidden width (4 * d_model in the paper; about 8/3 * d_model for SwiGLU).
        activation: ``relu``, ``gelu``, ``gelu_tanh``, ``quick_gelu``, ``silu`` or ``swiglu``.
        dropout: dropout on the hidden activations during training.
        bias: whether the linear layers have biases.

    Raises:
        ValueError: for an unknown activation.

    Shape:
        ``(B, T, d_model)`` -> ``(B, T, d_model)``.
    """

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "relu", dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS and activation not in GATED:
            known = sorted([*ACTIVATIONS, *GATED])
            raise ValueError(f"activation must be one of {known}, got {activation!r}")
        self.activation = activation
        self.act = GATED.get(activation) or ACTIVATIONS[activation]
        self.up = nn.Linear(d_model, d_ff, bias=bias)  # W_1
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if activation in GATED else None  # W_g
        self.down = nn.Linear(d_ff, d_model, bias=bias)  # W_2
        self.dropout = nn.Dropout(dropout)
        self.gate_up: nn.Module | None = None  # W_g and W_1 as one layer, after stack_projections()

    def stack_projections(self) -> bool:
        """Replace the gate W_g and W_1 by one layer whose rows are theirs, stacked (``gate_up``): the same
        numbers in one product instead of two (see :meth:`MultiHeadAttention.stack_projections`). Returns whether
        it did: not without a gate, if they are stacked already, or if they are not plain ``nn.Linear`` layers."""
        stacked = None if self.gate is None or self.gate_up is not None else stack_linears((self.gate, self.up))
        if stacked is None:
            return False
        self.gate_up, self.gate, self.up = stacked, None, None
        return True

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            hidden = self.act(gate) * up  # (B, T, d_ff)
        elif self.gate is None:
            hidden = self.act(self.up(x))  # (B, T, d_ff)
        else:
            hidden = self.act(self.gate(x)) * self.up(x)  # (B, T, d_ff)
        return self.down(self.dropout(hidden) if self.training else hidden)  # dropout: the identity in eval
