"""The position-wise feed-forward network: the same two-layer MLP applied to every position alone.

    FFN(x)    = W_2 · act(W_1 x + b_1) + b_2          act = ReLU (the paper) or GELU (GPT, BERT)
    SwiGLU(x) = W_2 · (SiLU(W_g x) ⊙ W_1 x)            (Shazeer 2020; LLaMA)
    GeGLU(x)  = W_2 · (GELU(W_g x) ⊙ W_1 x)            (Shazeer 2020; Gemma, with GELU's tanh form)

Attention mixes information across positions; this is where each position is transformed on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ops
from .linear import product
from .stacked import stack_linears

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact, erf-based (BERT)
    "gelu_tanh": ops.gelu_tanh,  # GPT-2's approximation (on qkv's own where it applies: PyTorch's is slow on a CPU)
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's sigmoid approximation of GELU
    "relu2": lambda x: F.relu(x).square(),  # ReLU squared (So et al. 2021, "Primer"; the GPT-2 speedruns)
}
GATED = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": ACTIVATIONS["gelu_tanh"]}


class FeedForward(nn.Module):
    """Linear -> activation -> dropout -> Linear, or its gated variant (SwiGLU, GeGLU); :class:`StackedFeedForward` is
    the gated one with W_g and W_1 held as one layer.

    Args:
        d_model: input and output width.
        d_ff: hidden width (4 * d_model in the paper; about 8/3 * d_model for SwiGLU).
        activation: ``relu``, ``relu2`` (ReLU squared: sparse like ReLU, smooth at zero like GELU, and cheaper
            than either), ``gelu``, ``gelu_tanh``, ``quick_gelu``, ``silu``, or a gated one: ``swiglu``, ``geglu``
            or ``geglu_tanh``.
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
        self._make_hidden_projections(d_model, d_ff, bias)  # W_1 and W_g: one stacked layer in StackedFeedForward
        self.down = nn.Linear(d_ff, d_model, bias=bias)  # W_2
        self.dropout = nn.Dropout(dropout)

    def _make_hidden_projections(self, d_model: int, d_ff: int, bias: bool) -> None:
        self.up = nn.Linear(d_model, d_ff, bias=bias)  # W_1
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if self.activation in GATED else None  # W_g

    def _hidden(self, x: Tensor) -> Tensor:
        """``act(W_1 x)``, or ``SiLU(W_g x) ⊙ W_1 x`` when gated: ``(B, T, d_ff)``."""
        if self.gate is None:
            return self.act(self.up(x))
        return self.act(self.gate(x)) * self.up(x)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self._hidden(x)  # (B, T, d_ff)
        return self.down(self.dropout(hidden) if self.training else hidden)  # dropout: the identity in eval


class StackedFeedForward(FeedForward):
    """A gated feed-forward with W_g and W_1 held as one layer, ``gate_up``: ``[W_g x | W_1 x] = [W_g; W_1] x``.

    The network of :class:`FeedForward` (the same arguments; a gated activation), with one product instead of two
    for the gate and the hidden layer: fewer, larger products for a decoding step on a CPU (see
    :class:`qkv.nn.StackedSelfAttention`). :func:`qkv.quantize.quantize` builds one from each gated feed-forward
    (:meth:`from_feed_forward`).

    Raises:
        ValueError: for an activation that is not gated.
    """

    def _make_hidden_projections(self, d_model: int, d_ff: int, bias: bool) -> None:
        if self.activation not in GATED:
            raise ValueError(f"only a gated activation ({', '.join(sorted(GATED))}) has a gate to stack with W_1, "
                             f"got {self.activation!r}")
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias)  # [W_g; W_1]

    @classmethod
    def from_feed_forward(cls, ffn: FeedForward, gate_up: nn.Module | None = None) -> StackedFeedForward | None:
        """``ffn`` with its W_g and W_1 stacked, in that order; its W_2 and dropout are taken over, not copied.
        ``gate_up``, if given, is that stacked layer, made elsewhere (from a file's weights, already quantized).
        None unless ``ffn`` is a plain gated :class:`FeedForward` whose layers are plain ``nn.Linear`` layers (or
        ``gate_up`` is given)."""
        if type(ffn) is not FeedForward or ffn.gate is None:
            return None
        if gate_up is None:
            gate_up = stack_linears((ffn.gate, ffn.up))
        if gate_up is None:
            return None
        with torch.device("meta"):  # the layers made here are replaced at once by ffn's own
            stacked = cls(ffn.up.in_features, ffn.up.out_features, activation=ffn.activation, dropout=ffn.dropout.p)
        stacked.gate_up, stacked.down, stacked.dropout = gate_up, ffn.down, ffn.dropout
        return stacked.train(ffn.training)

    def _hidden(self, x: Tensor) -> Tensor:
        return self.activate(self.gate_up(x))  # (B, T, d_ff)

    def decode(self, x: Tensor) -> Tensor:
        """:meth:`forward` in a decoding step that runs on qkv's own operations (:func:`qkv.kernels.ops.applies`,
        not training): the products straight through their kernel calls (:func:`qkv.nn.linear.product`)."""
        return product(self.down, self.activate(product(self.gate_up, x)))

    def activate(self, gate_up: Tensor) -> Tensor:
        """``act(gate) * up`` of ``[gate | up]`` side by side ``(..., 2 d_ff)``: qkv's own call where it applies
        (:mod:`qkv.kernels.ops`), else PyTorch's; a mixture of experts' decoding step takes it from here too."""
        if self.activation in ops.ACTIVATIONS and ops.applies(gate_up):
            return ops.gated(gate_up, self.activation)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
