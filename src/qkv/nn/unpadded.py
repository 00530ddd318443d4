"""A padded batch's real tokens laid end to end, so that padding costs no products.

A batch of sequences of different lengths is padded to its longest: ``(B, T)`` positions, of which only ``N`` are
real. Every layer but attention works on each position alone (the projections, the feed-forward network, the
norms, the residual sums), so it may as well see the ``N`` real tokens in one row ``(1, N, D)``: the same numbers
for them, and none of the work on padding, which in a batch of chats is a fifth of every product. Attention is
the one place where positions meet: it lays its queries, keys and values out in rows again, each row's real
tokens first and zeros after them (:func:`first_in_rows`), attends, and takes the real positions' outputs back
out. Laid out so, a causal attention needs no padding mask: every position before a real token is real, and the
fused kernel applies the causal mask itself.

The indices are found where the batch is made, on the host (``real.flatten().nonzero()``), so that the forward
pass waits on nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Unpadded(NamedTuple):
    """Which of a ``(B, T)`` batch's positions are real: ``index`` ``(N,)`` their flat positions among the ``B·T``,
    in order; ``real`` ``(B, T)`` True there. (Tensors only, so that a compiled layer takes it with any
    ``B``, ``T`` and ``N``.)"""

    index: Tensor
    real: Tensor


def unpadded(index: Tensor, shape: tuple[int, int]) -> Unpadded:
    """The :class:`Unpadded` of a ``shape`` ``(B, T)`` batch whose real tokens are at flat positions ``index``."""
    b, t = shape
    return Unpadded(index, index.new_zeros(b * t, dtype=bool).index_fill(0, index, True).view(b, t))


def first_in_rows(where: Unpadded) -> Unpadded:
    """The same tokens with each row's real ones first, in their order, and its padding after: where a left-padded
    row's tokens would lie alone (a right-padded batch's layout is its own)."""
    b, t = where.real.shape
    rank = where.real.long().cumsum(-1) - 1  # (B, T): each real token's place among its row's
    rows = torch.arange(b, device=rank.device)[:, None] * t
    index = (rows + rank).flatten().index_select(0, where.index)
    return Unpadded(index, torch.arange(t, device=rank.device) < where.real.sum(-1, keepdim=True))


def take(where: Unpadded, x: Tensor) -> Tensor:
    """The real positions of ``x`` ``(B, T, ...)``, end to end: ``(1, N, ...)``."""
    return x.flatten(0, 1).index_select(0, where.index)[None]


def spread(where: Unpadded, x: Tensor) -> Tensor:
    """``x`` ``(1, N, ...)`` back in its rows ``(B, T, ...)``, zeros at the padding."""
    b, t = where.real.shape
    rows = x.new_zeros(b * t, *x.shape[2:]).index_put_((where.index,), x[0])  # keeps only the index for backward
    return rows.view(b, t, *x.shape[2:])
