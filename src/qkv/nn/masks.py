"""Attention masks, with one convention for all of qkv.

A mask is a boolean tensor and ``True`` means *may attend*: entry ``[..., i, j]`` says whether query ``i``
may look at key ``j``. Masks broadcast against attention scores of shape ``(B, H, T_q, T_k)``, so a
``(T_q, T_k)`` structural mask and a ``(B, 1, 1, T_k)`` padding mask combine with ``&``.

PyTorch's ``nn.MultiheadAttention`` uses the opposite polarity (``True`` = ignore); code that calls it
converts with ``~mask`` at the boundary. ``F.scaled_dot_product_attention`` shares ours.

With a KV cache the queries are the *last* ``T_q`` of ``T_k`` positions: query ``i`` sits at absolute
position ``T_k - T_q + i``. Every structural mask here takes that offset into account, so the same function
serves a full forward pass (``T_q == T_k``) and one step of incremental decoding (``T_q == 1``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _query_key_positions(t_q: int, t_k: int, device: torch.device | None) -> tuple[Tensor, Tensor]:
    if t_q > t_k:
        raise ValueError(f"more queries than keys: T_q={t_q} > T_k={t_k}; queries must be the last keys")
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]  # (T_q, 1)
    k_pos = torch.arange(t_k, device=device)[None, :]  # (1, T_k)
    return q_pos, k_pos


def causal_mask(t_q: int, t_k: int | None = None, *, device: torch.device | None = None) -> Tensor:
    """Lower-triangular mask: a query may attend to itself and to earlier positions only.

    Args:
        t_q: number of queries.
        t_k: number of keys (defaults to ``t_q``); the queries are the last ``t_q`` key positions.
        device: where to build the mask.

    Shape:
        Output ``(T_q, T_k)``, ``True`` where key position <= query position.
    """
    q_pos, k_pos = _query_key_positions(t_q, t_q if t_k is None else t_k, device)
    return k_pos <= q_pos


def sliding_window_mask(
    t_q: int, t_k: int | None = None, *, window: int, causal: bool = True, device: torch.device | None = None
) -> Tensor:
    """Local attention: each query sees only keys fewer than ``window`` positions away.

    Causal: query at position ``p`` sees keys ``p - window + 1 .. p`` (the last ``window`` positions,
    itself included). Not causal: keys ``p - window + 1 .. p + window - 1`` (a band of the same half-width).

    Shape:
        Output ``(T_q, T_k)``.
    """
    if window < 1:
        raise ValueError(f"window must be a positive number of positions, got window={window}")
    q_pos, k_pos = _query_key_positions(t_q, t_q if t_k is None else t_k, device)
    distance = q_pos - k_pos  # (T_q, T_k): how far back each key lies
    if causal:
        return (distance >= 0) & (distance < window)
    return distance.abs() < window


def padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """``True`` for real tokens, ``False`` for padding.

    Shape:
        ids ``(B, T)`` -> ``(B, T)`` boolean.
    """
    return ids != pad_id


def key_padding_to_attention(key_padding_mask: Tensor) -> Tensor:
    """Lift a per-key ``(B, T_k)`` padding mask to broadcast against scores ``(B, H, T_q, T_k)``."""
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be bool (True = real token), got dtype {key_padding_mask.dtype}")
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must have shape (B, T_k), got {tuple(key_padding_mask.shape)}")
    return key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k)


def segment_mask(segments: Tensor) -> Tensor:
    """Packed rows: several sequences laid end to end in one row, each attending to itself only.

    Training on short examples packs them into full rows, so no compute is spent on padding; each example must
    then see none of its neighbours (with the causal mask on top: its own earlier tokens only). ``segments``
    numbers each token's example; a query may attend to a key of the same number.

    Shape:
        segments ``(B, T)`` integers -> ``(B, 1, T, T)``.
    """
    if segments.dim() != 2:
        raise ValueError(f"segments must have shape (B, T), got {tuple(segments.shape)}")
    return (segments[:, :, None] == segments[:, None, :])[:, None]  # (B, 1, T_q, T_k)


def segment_positions(segments: Tensor) -> Tensor:
    """Each token's position within its own example of a packed row (0 at each example's first token), so that
    a packed example has the positions it would have alone.

    Shape:
        segments ``(B, T)`` -> ``(B, T)`` long.
    """
    index = torch.arange(segments.size(-1), device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]  # where a new example begins
    return index - torch.where(starts, index, 0).cummax(dim=-1).values
