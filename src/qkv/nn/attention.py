"""Attention: scaled dot-product attention and the multi-head module built on it.

Masks are boolean and ``True`` means *may attend* (see :mod:`qkv.nn.masks`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .masks import causal_mask, key_padding_to_attention, sliding_window_mask
from .position import RotaryEmbedding
from .stacked import stack_linears


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, written out as the notes derive it.

    Each query scores every key by a dot product; dividing by √d_k keeps the scores' variance near 1 so the
    softmax does not saturate as d_k grows; the softmax turns scores into weights that sum to 1; the output
    is the weighted average of the values.

    Masked keys get the most negative finite score instead of -inf, so a query whose keys are *all* masked
    gets a uniform (finite) softmax that is then zeroed: its output is 0 and its gradient finite, never NaN.

    Args:
        q: queries.
        k: keys.
        v: values.
        mask: boolean, ``True`` = may attend, broadcastable to ``(..., T_q, T_k)``.
        dropout_p: dropout on the attention weights (applied whenever > 0, as in PyTorch's functional).
        bias: added to the scores before the softmax, broadcastable to ``(..., T_q, T_k)`` (Swin's relative
            position bias: a learned score for each offset between query and key).

    Returns:
        ``(output, weights)``; ``weights`` are the softmax probabilities before dropout.

    Shape:
        q ``(..., T_q, d_k)``, k ``(..., T_k, d_k)``, v ``(..., T_k, d_v)`` ->
        output ``(..., T_q, d_v)``, weights ``(..., T_q, T_k)``.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T_q, T_k)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)  # only changes rows with no allowed key
    attended = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights


class KVCache:
    """Keys and values already computed for one attention module, for incremental decoding.

    Self-attention appends the new position's key and value at every step, so step *t* costs O(t) instead of
    recomputing the whole prefix. Cross-attention keys and values come from the encoder output, which does
    not change while decoding: they are stored on the first step and reused.

    The keys and values are written in place into buffers allocated ahead (``capacity`` positions, or the
    first append's length): a step copies one position in and allocates nothing. A sequence that outgrows the
    buffers moves to buffers twice as long, so growing to *n* positions costs O(log n) allocations, not *n*
    concatenations. ``k`` and ``v`` are views of the filled part.

    Shape:
        k, v ``(B, H_kv, T_cached, head_dim)``.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be a positive number of positions or None, got {capacity}")
        self.capacity = capacity
        self._k: Tensor | None = None  # (B, H_kv, room, head_dim), filled up to `length`
        self._v: Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` ``(B, H_kv, t, head_dim)`` after the cached positions; returns every cached key
        and value, these included."""
        if self._k is not None and k.size(0) != self._k.size(0):
            raise ValueError(f"batch size {k.size(0)} does not match the cache's {self._k.size(0)}")
        end = self.length + k.size(2)
        if self._k is None or end > self._k.size(2):
            self._grow(k, v, end)
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self.k, self.v

    def _grow(self, k: Tensor, v: Tensor, needed: int) -> None:
        room = max(needed, self.capacity or 0, 2 * (0 if self._k is None else self._k.size(2)))
        old_k, old_v = self.k, self.v
        self._k = k.new_empty(*k.shape[:2], room, k.size(3))
        self._v = v.new_empty(*v.shape[:2], room, v.size(3))
        if old_k is not None and old_v is not None:
            self._k[:, :, : self.length] = old_k
            self._v[:, :, : self.length] = old_v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search reorders hypotheses this way)."""
        if self._k is not None and self._v is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: h heads attend in parallel in subspaces of width d_model / h.

        head_i = Attention(X W_i^Q, Y W_i^K, Y W_i^V),   MHA(X, Y) = Concat(head_1..head_h) W^O

    Self-attention when ``Y = X``; cross-attention when ``Y`` is another sequence (the encoder output).

    Options (all off by default, each a small, separate step below):

    * ``causal``: query ``i`` sees keys ``<= i`` only (decoder self-attention).
    * ``window``: local attention; a query sees only keys fewer than ``window`` positions away.
    * ``n_kv_heads < n_heads``: grouped-query attention; each key/value head serves ``n_heads / n_kv_heads``
      query heads, shrinking the KV cache by the same factor.
    * ``gated``: output ⊙ σ(X W_g), a learned sigmoid gate per feature applied to the concatenated heads
      before W^O, which lets a head's contribution be switched off for a token.
    * ``rotary``: rotate queries and keys by their positions (RoPE) in self-attention.

    Without ``need_weights`` the core runs on :func:`torch.nn.functional.scaled_dot_product_attention`
    (fused kernels); with it, on the explicit :func:`scaled_dot_product_attention`. The two agree.

    Args:
        d_model: model width.
        n_heads: number of query heads; must divide ``d_model``.
        n_kv_heads: number of key/value heads (defaults to ``n_heads``); must divide ``n_heads``.
        dropout: dropout on the attention weights during training.
        bias: whether the projections have biases.
        causal: apply the causal mask.
        window: sliding-window size in positions, or None for full attention.
        gated: add the sigmoid output gate.
        rotary: a :class:`RotaryEmbedding` for queries and keys, or None.

    Raises:
        ValueError: on inconsistent sizes.

    Shape:
        query ``(B, T_q, d_model)``, key_value ``(B, T_k, d_model)`` -> output ``(B, T_q, d_model)``,
        weights ``(B, n_heads, T_q, T_k)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = False,
        window: int | None = None,
        gated: bool = False,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
        if window is not None and window < 1:
            raise ValueError(f"window must be a positive number of positions or None, got {window}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        if rotary is not None and rotary.head_dim != self.head_dim:
            raise ValueError(f"rotary head_dim={rotary.head_dim} != d_model/n_heads={self.head_dim}")
        self.dropout, self.causal, self.window = dropout, causal, window

        kv_dim = n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.gate_proj = nn.Linear(d_model, d_model, bias=bias) if gated else None
        self.rotary = rotary
        self.qkv_proj: nn.Module | None = None  # W^Q, W^K, W^V as one layer, after stack_projections()

    def _split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, Dh)

    def stack_projections(self) -> bool:
        """Replace W^Q, W^K and W^V by one layer whose rows are theirs, stacked (``qkv_proj``): self-attention only.

        The same numbers, in one product instead of three, and rotary positions turn Q and K in one operation
        instead of two. Decoding one token multiplies by small matrices, and each product and each small
        operation has a fixed cost on a CPU: :func:`qkv.quantize.quantize` stacks them. Returns whether it did:
        not if they are stacked already or are not plain ``nn.Linear`` layers.
        """
        stacked = None if self.qkv_proj is not None else stack_linears((self.q_proj, self.k_proj, self.v_proj))
        if stacked is None:
            return False
        self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = stacked, None, None, None
        return True

    def _project(self, query: Tensor, key_value: Tensor | None, positions: Tensor | None,
                 cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        """Q ``(B, H, T_q, Dh)``, and K and V ``(B, H_kv, T_k, Dh)`` with every cached position: heads split,
        rotary positions applied, the new keys and values appended to ``cache``."""
        is_cross = key_value is not None
        b, t_q, _ = query.shape
        if self.qkv_proj is not None:
            if is_cross:
                raise ValueError("this attention's projections are stacked for self-attention; do not pass key_value")
            h, h_kv = self.n_heads, self.n_kv_heads
            qkv = self.qkv_proj(query).view(b, t_q, h + 2 * h_kv, self.head_dim).transpose(1, 2)
            qk, v = qkv[:, : h + h_kv], qkv[:, h + h_kv :]
            if self.rotary is not None:
                qk = self.rotary(qk, self._positions(positions, cache, t_q, query.device))
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self._split_heads(self.q_proj(query), self.n_heads)  # (B, H, T_q, Dh)
            if is_cross and cache is not None and len(cache):
                return q, cache.k, cache.v  # the encoder output has not changed since the first step
            source = key_value if is_cross else query
            k = self._split_heads(self.k_proj(source), self.n_kv_heads)  # (B, H_kv, T_new, Dh)
            v = self._split_heads(self.v_proj(source), self.n_kv_heads)
            if self.rotary is not None and not is_cross:
                positions = self._positions(positions, cache, t_q, query.device)
                q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    @staticmethod
    def _positions(positions: Tensor | None, cache: KVCache | None, t_q: int, device: torch.device) -> Tensor:
        """The queries' positions: as given, else continuing from the cache."""
        if positions is not None:
            return positions
        past = len(cache) if cache is not None else 0
        return torch.arange(past, past + t_q, device=device)

    def _structural_mask(self, t_q: int, t_k: int, device: torch.device) -> Tensor | None:
        if self.window is not None:
            return sliding_window_mask(t_q, t_k, window=self.window, causal=self.causal, device=device)
        if self.causal and t_q > 1:  # a single newest query may see every cached key
            return causal_mask(t_q, t_k, device=device)
        return None

    def forward(
        self,
        query: Tensor,
        key_value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        attn_bias: Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key_value`` (itself when None).

        Args:
            query: ``(B, T_q, d_model)``.
            key_value: ``(B, T_k, d_model)`` for cross-attention, None for self-attention.
            key_padding_mask: ``(B, T_k)`` boolean, ``True`` = real key. With a cache, it covers every cached
                key plus the new ones.
            attn_mask: extra boolean mask broadcastable to ``(B, n_heads, T_q, T_k)``, ``True`` = may attend.
            attn_bias: float scores added before the softmax, broadcastable to ``(B, n_heads, T_q, T_k)``.
            positions: positions of the queries, ``(T_q,)`` or ``(B, T_q)``, for rotary embeddings; by
                default they continue from the cache.
            cache: a :class:`KVCache` to read and extend (incremental decoding).
            need_weights: also return the attention weights (runs the explicit path).

        Returns:
            ``(output, weights)``, ``weights`` None unless requested.
        """
        if query.dim() != 3 or query.size(-1) != self.d_model:
            raise ValueError(f"query must have shape (B, T, {self.d_model}), got {tuple(query.shape)}")
        is_cross = key_value is not None
        if is_cross and (key_value.dim() != 3 or key_value.size(0) != query.size(0)):
            raise ValueError(
                f"key_value must have shape (B={query.size(0)}, T_k, {self.d_model}), "
                f"got {tuple(key_value.shape)}"
            )
        b, t_q, _ = query.shape

        q, k, v = self._project(query, key_value, positions, cache)
        t_k = k.size(2)

        # The common square causal case needs no mask tensor: the fused kernel applies it itself.
        # (Decided by an `if`: under torch.compile with dynamic shapes the size test is symbolic, the `if` turns it
        # into a guard, and the kernel gets a plain bool.)
        fused_causal = False
        if self.causal and self.window is None and t_q == t_k > 1 and not need_weights and \
                key_padding_mask is None and attn_mask is None and attn_bias is None:
            fused_causal = True
        mask = None if fused_causal else self._structural_mask(t_q, t_k, query.device)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (b, t_k):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T_k)=({b}, {t_k}), got {tuple(key_padding_mask.shape)}"
                )
            kpm = key_padding_to_attention(key_padding_mask)  # (B, 1, 1, T_k)
            mask = kpm if mask is None else mask & kpm
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise TypeError(f"attn_mask must be bool (True = may attend), got dtype {attn_mask.dtype}")
            mask = attn_mask if mask is None else mask & attn_mask

        # Grouped-query: query head h reads key/value head h // group. The fused kernels share the key/value
        # heads themselves (enable_gqa); the explicit path repeats them.
        grouped = self.n_kv_heads != self.n_heads
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            if grouped:
                group = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T_k, Dh)
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, attn_bias)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p,
                                                 is_causal=fused_causal, enable_gqa=grouped)
        else:
            # A query with no allowed key would be NaN on some kernels: let it see everything, then zero it.
            has_key = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
            allowed = mask | ~has_key
            if attn_bias is not None:  # one float mask: the bias where allowed, -inf elsewhere
                allowed = torch.where(allowed, attn_bias.to(q.dtype), float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 enable_gqa=grouped)
            out = out.masked_fill(~has_key, 0.0)

        out = out.transpose(1, 2).reshape(b, t_q, self.d_model)  # (B, T_q, H * Dh)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(query))
        return self.out_proj(out), weights
