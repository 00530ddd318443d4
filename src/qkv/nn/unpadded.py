"""A padded batch's real tokens laid end to end, so that padding costs no products; and a token that several
examples share, computed once.

A batch of sequences of different lengths is padded to its longest: ``(B, T)`` positions, of which only ``N`` are
real. Every layer but attention works on each position alone (the projections, the feed-forward network, the
norms, the residual sums), so it may as well see the ``N`` real tokens in one row ``(1, N, D)``: the same numbers
for them, and none of the work on padding, which in a batch of chats is a fifth of every product. Attention is
the one place where positions meet: it lays its queries, keys and values out in rows again, each row's real
tokens first and the padding after them (:func:`first_in_rows`), attends, and takes the real positions' outputs back
out. Laid out so, a causal attention needs no padding mask: every position before a real token is real, and the
fused kernel applies the causal mask itself.

**Shared tokens.** Examples that begin alike (every chat of a template that writes the same system prompt before
each conversation) hold the same vectors at those first tokens in every layer: a token's vectors depend only on
it and the tokens before it in its example. Such positions may hold *one* token: its products are done once, and
attention lays its keys and values out in every row that holds it. Its gradient is then the sum of what each copy
would have had: the same loss and gradients as computing every copy (tested), with the work of the shared
beginning done once a batch rather than once a row. :func:`shared_tokens` finds them.

The indices are found where the batch is made, on the host, so that the forward pass waits on nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class Unpadded(NamedTuple):
    """Which tokens of a ``(B, T)`` batch run, and where they lie: ``index`` ``(N,)`` the flat position among the
    ``B·T`` of each token (its first copy, where several positions hold it), in order; ``real`` ``(B, T)`` True at
    the real positions; ``source`` ``(B·T,)`` the token each position holds (0 at padding). (Tensors only, so that
    a compiled layer takes it with any ``B``, ``T`` and ``N``.)"""

    index: Tensor
    real: Tensor
    source: Tensor


def unpadded(index: Tensor, shape: tuple[int, int], copies: Tensor | None = None) -> Unpadded:
    """The :class:`Unpadded` of a ``shape`` ``(B, T)`` batch whose tokens are at flat positions ``index``.

    ``copies`` ``(B, T)``: the token (``0 … N-1``, in the order of ``index``) each position holds, −1 at padding,
    where several positions hold one (:func:`shared_tokens`); by default each real position holds its own."""
    b, t = shape
    if copies is None:
        copies = index.new_full((b * t,), -1).index_copy_(0, index, torch.arange(index.numel(), device=index.device))
    copies = copies.flatten()
    return Unpadded(index, (copies >= 0).view(b, t), copies.clamp(min=0))


def first_in_rows(where: Unpadded) -> Unpadded:
    """The same tokens with each row's real positions first, in their order, and its padding after: where a
    left-padded row's tokens would lie alone (a right-padded batch's layout is its own)."""
    target = _places(where)
    b, t = where.real.shape
    return Unpadded(target.index_select(0, where.index), torch.arange(t, device=target.device) < where.real.sum(
        -1, keepdim=True), in_rows(where, where.source.view(b, t)).flatten())


def _places(where: Unpadded) -> Tensor:
    """``(B·T,)``: each real position's place in :func:`first_in_rows`'s layout; ``B·T`` (out of it) for padding."""
    b, t = where.real.shape
    rank = where.real.long().cumsum(-1) - 1  # (B, T): each real position's place among its row's
    place = torch.arange(b, device=rank.device)[:, None] * t + rank
    return torch.where(where.real, place, b * t).flatten()


def in_rows(where: Unpadded, x: Tensor) -> Tensor:
    """What each position of the batch has, ``x`` ``(B, T, ...)``, where :func:`first_in_rows` lays the position
    out (0 at padding)."""
    b, t = where.real.shape
    rows = x.new_zeros(b * t + 1, *x.shape[2:]).index_copy_(0, _places(where), x.flatten(0, 1))
    return rows[:-1].view(x.shape)


def take(where: Unpadded, x: Tensor) -> Tensor:
    """The tokens of ``x`` ``(B, T, ...)``, end to end: ``(1, N, ...)``."""
    return x.flatten(0, 1).index_select(0, where.index)[None]


def spread(where: Unpadded, x: Tensor) -> Tensor:
    """The tokens ``x`` ``(1, N, ...)`` back at every position that holds them ``(B, T, ...)``; the padding holds
    the first token's (attention never lets a real query see it; :func:`zeros_at_padding` clears it)."""
    b, t = where.real.shape
    return x[0].index_select(0, where.source).view(b, t, *x.shape[2:])  # keeps only the index for backward


def zeros_at_padding(where: Unpadded, x: Tensor) -> Tensor:
    """``x`` ``(B, T, ...)`` with zeros at the padding."""
    return x.masked_fill(~where.real.view(*where.real.shape, *(1,) * (x.dim() - 2)), 0)


def shared_tokens(rows: Sequence[Sequence[Sequence[int]]], width: int, *, share: bool = True
                  ) -> tuple[Tensor, Tensor]:
    """``(index, copies)`` for :func:`unpadded`: ``rows`` of examples (each a list of token ids, laid end to end
    from the start of its row, the rest of the ``width`` padding), the positions that begin like an earlier example
    holding its tokens. A position holds an earlier one's token when its example's tokens up to it are the earlier
    one's, token for token (a tree of the examples' beginnings). ``share=False``: every position its own token."""
    tree: dict[tuple[int, int], int] = {}
    index: list[int] = []
    copies = [[-1] * width for _ in rows]
    examples = 0
    for r, row in enumerate(rows):
        at = 0
        for ids in row:
            node, examples = (-1 if share else -1 - examples), examples + 1  # where its tree starts
            for j, token in enumerate(ids):
                node = tree.setdefault((node, token), len(tree))
                if node == len(index):  # a new token
                    index.append(r * width + at + j)
                copies[r][at + j] = node
            at += len(ids)
    return torch.tensor(index, dtype=torch.long), torch.tensor(copies, dtype=torch.long).view(len(rows), width)
