"""Where a ViT looks: the [CLS] token's attention over the patches, per layer and head, and attention rollout.

Row 0 of a layer's attention ``(H, 1 + N, 1 + N)`` says how much the [CLS] token takes from itself and from each
of the N patches; laid out on the patch grid it is a map over the image. One layer's map tells only what that
layer mixes in, and after the first layer every token is already a mixture, so Abnar & Zuidema (2020) follow
the flow through all layers: average each layer's heads, add the identity for the residual path
(``½ A + ½ I``, rows renormalised), and multiply the layers' matrices from the first to the last. The [CLS]
row of that product, the *rollout*, says how much of each input patch reached the [CLS] token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _grid(n_tokens: int, grid: tuple[int, int] | None) -> tuple[int, int]:
    rows, cols = grid or (math.isqrt(n_tokens - 1),) * 2
    if rows * cols != n_tokens - 1:
        raise ValueError(f"{n_tokens} tokens are not [CLS] and a {rows}x{cols} patch grid; pass grid=(rows, cols)")
    return rows, cols


def cls_attention(attention: Sequence[Tensor], *, image: int = 0, grid: tuple[int, int] | None = None) -> Tensor:
    """The [CLS] row of every layer and head of one image, on the patch grid.

    Args:
        attention: ``n_layers`` tensors ``(B, H, 1 + N, 1 + N)``, as ``ViT(..., return_attention=True)`` gives.
        image: which image of the batch.
        grid: ``(rows, cols)`` of the patches (default: square).

    Returns:
        ``(n_layers, H, rows, cols)``: the weight the [CLS] token gives each patch (its weight on itself left out).
    """
    rows, cols = _grid(attention[0].size(-1), grid)
    return torch.stack([a[image, :, 0, 1:].float().reshape(-1, rows, cols) for a in attention])


def attention_rollout(attention: Sequence[Tensor], *, image: int = 0, grid: tuple[int, int] | None = None) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of one image: ``(rows, cols)``, how much of each patch reached
    the [CLS] token through every layer (heads averaged, the residual path counted as half of each layer)."""
    rows, cols = _grid(attention[0].size(-1), grid)
    flow = None
    for a in attention:
        mixed = a[image].float().mean(dim=0)  # (T, T): the layer's heads averaged
        mixed = 0.5 * mixed + 0.5 * torch.eye(mixed.size(0), device=mixed.device)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        flow = mixed if flow is None else mixed @ flow  # later layers read the mixture the earlier ones made
    return flow[0, 1:].reshape(rows, cols)
