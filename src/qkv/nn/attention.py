"""Attention: scaled dot-product attention and the multi-head module built on it.

Masks are boolean and ``True`` means *may attend* (see :mod:`qkv.nn.masks`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ops
from .linear import product
from .masks import causal_mask, key_padding_to_attention, sliding_window_mask
from .norm import RMSNorm
from .position import RotaryEmbedding
from .stacked import stack_linears
from .unpadded import Unpadded, spread, take


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0, bias: Tensor | None = None,
    *, scale: float | None = None, softcap: float | None = None,
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
        scale: the scores' factor in place of 1/√d_k (Gemma's ``query_pre_attn_scalar``, Granite's
            ``attention_multiplier``).
        softcap: scores squashed into ``(-softcap, softcap)`` as ``softcap · tanh(scores / softcap)`` before the bias
            and masks (Gemma 2): no score can dominate the softmax without bound.

    Returns:
        ``(output, weights)``; ``weights`` are the softmax probabilities before dropout.

    Shape:
        q ``(..., T_q, d_k)``, k ``(..., T_k, d_k)``, v ``(..., T_k, d_v)`` ->
        output ``(..., T_q, d_v)``, weights ``(..., T_q, T_k)``.
    """
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (..., T_q, T_k)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
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
        self.starts: list[int] | None = None  # where each row's positions begin, once rows of different lengths
        # were joined (extend); None: every row fills the cache (any padding is then an attention mask's business)

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
        if self.starts is not None:
            self.starts = [self.starts[i] for i in index.tolist()]

    def extend(self, other: KVCache) -> None:
        """Add ``other``'s rows after these, both right-aligned: the side with fewer positions is padded on the left
        with zeros, and ``starts`` says where each row begins, so that attention reads each row's own keys only
        (:meth:`MultiHeadAttention._rows_alone`; continuous batching: sequences that join a running batch)."""
        if other._k is None or other._v is None:
            return
        if self._k is None or self._v is None:
            self._k, self._v, self.length = other._k, other._v, other.length
            self.starts = other.starts or [0] * other._k.size(0)
            return
        width = max(self.length, other.length)
        self.starts = [s + width - part.length for part in (self, other) for s in part.starts or [0] * part.k.size(0)]
        rows = self._k.size(0) + other._k.size(0)
        room = max(2 * width, self._k.size(2))  # as _grow doubles: the next positions need no copy
        k = self._k.new_zeros(rows, self._k.size(1), room, self._k.size(3))
        v = self._v.new_zeros(rows, self._v.size(1), room, self._v.size(3))
        for part, start in ((self, 0), (other, self._k.size(0))):
            end = start + part.k.size(0)
            k[start:end, :, width - part.length : width] = part.k
            v[start:end, :, width - part.length : width] = part.v
        self._k, self._v, self.length = k, v, width

    def drop_left(self, n: int) -> None:
        """Forget every row's first ``n`` positions (columns that no row uses any more); no copy is made."""
        if self._k is not None and self._v is not None and n > 0:
            self._k, self._v, self.length = self._k[:, :, n:], self._v[:, :, n:], self.length - n
            self.starts = None if self.starts is None else [max(0, s - n) for s in self.starts]

    def drop_right(self, n: int) -> None:
        """Forget every row's last ``n`` positions (drafted tokens the model did not accept: speculative decoding);
        the next append writes over them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} of {self.length} cached positions")
        self.length -= n


class MultiHeadAttention(nn.Module):
    """Multi-head attention: h heads attend in parallel in subspaces of width d_model / h (or ``head_dim``).

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
    * ``q_norm``, ``k_norm``: normalise each head's queries and keys (over its ``head_dim`` features) before
      the rotation (Qwen3, Gemma 3); with ``qk_norm_whole``, all the heads' queries together, and all the keys
      (OLMo 2).
    * ``scale``, ``softcap``: another factor than 1/√d_k on the scores; scores capped with tanh (see
      :func:`scaled_dot_product_attention`).

    Without ``need_weights`` the core runs on :func:`torch.nn.functional.scaled_dot_product_attention`
    (fused kernels); with it, on the explicit :func:`scaled_dot_product_attention`. The two agree.
    :class:`StackedSelfAttention` is the same self-attention with W^Q, W^K and W^V held as one layer.

    Args:
        d_model: model width.
        n_heads: number of query heads; must divide ``d_model`` unless ``head_dim`` is given.
        n_kv_heads: number of key/value heads (defaults to ``n_heads``); must divide ``n_heads``.
        dropout: dropout on the attention weights during training.
        bias: whether the projections have biases.
        qkv_bias: whether the query, key and value projections have biases (None: as ``bias``).
        causal: apply the causal mask.
        window: sliding-window size in positions, or None for full attention.
        gated: add the sigmoid output gate.
        rotary: a :class:`RotaryEmbedding` for queries and keys, or None.
        head_dim: features per head (default ``d_model / n_heads``); the heads side by side are
            ``n_heads * head_dim`` wide, which W^O maps back to ``d_model``.
        q_norm, k_norm: norms over ``head_dim`` for each head's queries and keys (both or neither), or None.
        qk_norm_whole: ``q_norm`` and ``k_norm`` normalise the whole projections (``n_heads * head_dim`` and
            ``n_kv_heads * head_dim`` features), before the heads are split.
        scale: the scores' factor (None: 1/√head_dim).
        softcap: cap the scores at ±softcap with tanh (None: no cap); it takes the explicit path.

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
        qkv_bias: bool | None = None,
        causal: bool = False,
        window: int | None = None,
        gated: bool = False,
        rotary: RotaryEmbedding | None = None,
        head_dim: int | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        qk_norm_whole: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm must be given together")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
        if window is not None and window < 1:
            raise ValueError(f"window must be a positive number of positions or None, got {window}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.inner_dim = n_heads * self.head_dim  # the heads side by side
        if rotary is not None and rotary.head_dim != self.head_dim:
            raise ValueError(f"rotary head_dim={rotary.head_dim} != the heads' head_dim={self.head_dim}")
        self.dropout, self.causal, self.window = dropout, causal, window

        self._make_input_projections(bias if qkv_bias is None else qkv_bias)  # one layer in StackedSelfAttention
        self.out_proj = nn.Linear(self.inner_dim, d_model, bias=bias)
        self.gate_proj = nn.Linear(d_model, self.inner_dim, bias=bias) if gated else None
        self.rotary = rotary
        self.q_norm, self.k_norm, self.qk_norm_whole = q_norm, k_norm, qk_norm_whole
        self.scale, self.softcap = scale, softcap

    def options(self) -> dict:
        """The constructor's arguments besides the sizes and layers: what a copy of this attention is built with
        (:meth:`StackedSelfAttention.from_attention`)."""
        return dict(n_kv_heads=self.n_kv_heads, dropout=self.dropout, causal=self.causal, window=self.window,
                    gated=self.gate_proj is not None, rotary=self.rotary, head_dim=self.head_dim, q_norm=self.q_norm,
                    k_norm=self.k_norm, qk_norm_whole=self.qk_norm_whole, scale=self.scale, softcap=self.softcap)

    def _make_input_projections(self, bias: bool) -> None:
        kv_dim = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.d_model, self.inner_dim, bias=bias)
        self.k_proj = nn.Linear(self.d_model, kv_dim, bias=bias)
        self.v_proj = nn.Linear(self.d_model, kv_dim, bias=bias)

    def _split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, Dh)

    @staticmethod
    def _in_rows(y: Tensor, unpadded: Unpadded | None) -> Tensor:
        """A projection's output in the rows attention reads: unpadded tokens ``(1, N, ·)`` laid out ``(B, T, ·)``."""
        return y if unpadded is None else spread(unpadded, y)

    def _project(self, query: Tensor, key_value: Tensor | None, positions: Tensor | None,
                 cache: KVCache | None, unpadded: Unpadded | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Q ``(B, H, T_q, Dh)``, and K and V ``(B, H_kv, T_k, Dh)`` with every cached position: heads split,
        rotary positions applied, the new keys and values appended to ``cache``; ``unpadded`` tokens laid out
        in their rows first (``positions`` are then the rows')."""
        is_cross = key_value is not None
        whole = self.qk_norm_whole
        q = self._split_heads(self._in_rows(self._normed(self.q_proj(query), self.q_norm, whole), unpadded),
                              self.n_heads)  # (B, H, T_q, Dh)
        q = self._normed(q, self.q_norm, not whole)
        if is_cross and cache is not None and len(cache):
            return q, cache.k, cache.v  # the encoder output has not changed since the first step
        source = key_value if is_cross else query
        k = self._split_heads(self._in_rows(self._normed(self.k_proj(source), self.k_norm, whole), unpadded),
                              self.n_kv_heads)  # (B, H_kv, T_new, Dh)
        v = self._split_heads(self._in_rows(self.v_proj(source), unpadded), self.n_kv_heads)
        k = self._normed(k, self.k_norm, not whole)
        if self.rotary is not None and not is_cross:
            positions = self._positions(positions, cache, q.size(2), query.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    @staticmethod
    def _normed(x: Tensor, norm: nn.Module | None, here: bool) -> Tensor:
        """``norm(x)`` where this is the place of the queries' or keys' norm (per head, or over the projection)."""
        return norm(x) if here and norm is not None else x

    @staticmethod
    def _positions(positions: Tensor | None, cache: KVCache | None, t_q: int, device: torch.device) -> Tensor:
        """The queries' positions: as given, else continuing from the cache."""
        if positions is not None:
            return positions
        past = len(cache) if cache is not None else 0
        return torch.arange(past, past + t_q, device=device)

    def _check_inputs(self, query: Tensor, key_value: Tensor | None) -> None:
        if query.dim() != 3 or query.size(-1) != self.d_model:
            raise ValueError(f"query must have shape (B, T, {self.d_model}), got {tuple(query.shape)}")
        if key_value is not None and (key_value.dim() != 3 or key_value.size(0) != query.size(0)):
            raise ValueError(
                f"key_value must have shape (B={query.size(0)}, T_k, {self.d_model}), "
                f"got {tuple(key_value.shape)}"
            )

    def _fused_causal(self, t_q: int, t_k: int, *, other_masks: bool, need_weights: bool) -> bool:
        """Whether the fused kernel applies the causal mask itself: the common square causal case, with no other
        mask or bias and no weights asked for, needs no mask tensor.

        (A Python ``bool``: under torch.compile with dynamic shapes the size test is symbolic, ``if`` turns it
        into a guard, and the kernel gets a plain bool: ``bool()`` alone would hand it the symbolic one.)"""
        if self.causal and self.window is None and t_q == t_k > 1 and not need_weights and not other_masks:  # noqa: SIM103
            return True
        return False

    def _structural_mask(self, t_q: int, t_k: int, device: torch.device) -> Tensor | None:
        if self.window is not None:
            return sliding_window_mask(t_q, t_k, window=self.window, causal=self.causal, device=device)
        if self.causal and t_q > 1:  # a single newest query may see every cached key
            return causal_mask(t_q, t_k, device=device)
        return None

    def _mask(self, b: int, t_q: int, t_k: int, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
              device: torch.device) -> Tensor | None:
        """Every boolean mask in one, broadcastable to ``(B, H, T_q, T_k)``: the structural one (causal, window),
        the keys' padding and ``attn_mask``; None when nothing is masked."""
        mask = self._structural_mask(t_q, t_k, device)
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
        return mask

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attn_bias: Tensor | None, *,
                fused_causal: bool, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The heads' outputs ``(B, H, T_q, Dh)`` and, if ``need_weights``, their weights ``(B, H, T_q, T_k)``:
        the explicit :func:`scaled_dot_product_attention` when the weights are wanted, else PyTorch's fused one."""
        # Grouped-query: query head h reads key/value head h // group. The fused kernels share the key/value
        # heads themselves (enable_gqa); the explicit path repeats them.
        grouped = self.n_kv_heads != self.n_heads
        dropout_p = self.dropout if self.training else 0.0
        if need_weights or self.softcap is not None:  # PyTorch's kernels cap no scores
            if grouped:
                group = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T_k, Dh)
            if fused_causal:  # the causal mask the fused kernel would have made
                mask = self._structural_mask(q.size(2), k.size(2), q.device)
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, attn_bias, scale=self.scale,
                                                        softcap=self.softcap)
            return out, weights if need_weights else None
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p,
                                                 is_causal=fused_causal, enable_gqa=grouped, scale=self.scale)
            return out, None
        # A query with no allowed key would be NaN on some kernels: let it see everything, then zero it.
        has_key = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
        allowed = mask | ~has_key
        if attn_bias is not None:  # one float mask: the bias where allowed, -inf elsewhere
            allowed = torch.where(allowed, attn_bias.to(q.dtype), float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, enable_gqa=grouped,
                                             scale=self.scale)
        return out.masked_fill(~has_key, 0.0), None

    def _rows_alone(self, q: Tensor, k: Tensor, v: Tensor, starts: list[int]) -> Tensor:
        """The new queries of each row (one, or a few: speculative decoding's drafts), each attending to its own
        keys from ``starts[row]`` on, as it would alone: the same call on the same numbers, so a row decoded among
        rows of other lengths (continuous batching) gets the very result it gets alone; a mask over the padding
        would give the same up to rounding, which int8-rounded activations can turn into other tokens."""
        heads = []
        for row, start in enumerate(starts):
            keys = k.size(2) - start
            heads.append(self._attend(q[row : row + 1], k[row : row + 1, :, start:], v[row : row + 1, :, start:],
                                      self._structural_mask(q.size(2), keys, q.device), None, fused_causal=False,
                                      need_weights=False)[0])
        return torch.cat(heads)

    def _output(self, heads: Tensor, query: Tensor) -> Tensor:
        """The heads concatenated ``(B, T_q, H * Dh)``, gated by the query if ``gated``, times W^O."""
        b, t_q, _ = query.shape
        out = heads.transpose(1, 2).reshape(b, t_q, self.inner_dim)  # (B, T_q, H * Dh)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(query))
        return self.out_proj(out)

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
        unpadded: Unpadded | None = None,
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
            unpadded: ``query`` is a padded batch's real tokens end to end, ``(1, N, d_model)`` (a token that
                several positions hold, once), and where they lie in the ``(B, T)`` rows they attend in, each
                row's real tokens first
                (:func:`~qkv.nn.unpadded.first_in_rows`): projected as they are, the projections laid out in
                those rows, the output ``(1, N, d_model)`` again. ``positions`` and ``attn_mask`` are the rows';
                the padding after the real tokens is masked for the keys unless the attention is causal (then
                no real token sees it). Self-attention only, no cache, no weights.

        Returns:
            ``(output, weights)``, ``weights`` None unless requested.
        """
        self._check_inputs(query, key_value)
        ragged = cache is not None and cache.starts is not None and any(cache.starts)  # rows of different lengths
        masks = key_padding_mask is not None or attn_mask is not None or attn_bias is not None
        if ragged and (need_weights or masks):
            raise ValueError("a cache of rows of different lengths (qkv.batching) takes no mask or bias, and gives no "
                             "attention weights")
        if unpadded is not None and (key_value is not None or cache is not None or need_weights):
            raise ValueError("unpadded tokens attend to themselves (self-attention), with no cache and no weights")
        q, k, v = self._project(query, key_value, positions, cache, unpadded)  # (B, H, T_q, Dh), (B, H_kv, T_k, Dh)
        if ragged:
            return self._output(self._rows_alone(q, k, v, cache.starts), query), None
        if unpadded is not None and not self.causal:  # causal: every key before a real query is real
            key_padding_mask = unpadded.real if key_padding_mask is None else key_padding_mask & unpadded.real
            masks = True
        b, t_q, t_k = q.size(0), q.size(2), k.size(2)
        fused_causal = self._fused_causal(t_q, t_k, other_masks=masks, need_weights=need_weights)
        mask = None if fused_causal else self._mask(b, t_q, t_k, key_padding_mask, attn_mask, query.device)
        heads, weights = self._attend(q, k, v, mask, attn_bias, fused_causal=fused_causal, need_weights=need_weights)
        if unpadded is not None:  # the real queries' outputs, end to end again: (1, H, N, Dh)
            heads = take(unpadded, heads.transpose(1, 2)).transpose(1, 2)
        return self._output(heads, query), weights


DECODED = 32  # the most new tokens a row that qkv's own attention (StackedSelfAttention._decode) computes in one call


class StackedSelfAttention(MultiHeadAttention):
    """Self-attention with W^Q, W^K and W^V held as one layer, ``qkv_proj``: ``[Q | K | V] = X [W^Q; W^K; W^V]ᵀ``.

    The attention of :class:`MultiHeadAttention` (the same arguments), with its projection step done as one
    product instead of three, and rotary positions turning Q and K in one operation instead of two. Decoding one
    token multiplies by small matrices, and each product and each small operation has a fixed cost on a CPU:
    :func:`qkv.quantize.quantize` builds one from each self-attention (:meth:`from_attention`) before it quantizes
    the layers. Self-attention only: it takes no ``key_value``.

    Raises:
        ValueError: on inconsistent sizes; when called with a ``key_value``.
    """

    def _make_input_projections(self, bias: bool) -> None:
        kv_dim = self.n_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(self.d_model, self.inner_dim + 2 * kv_dim, bias=bias)

    @classmethod
    def from_attention(cls, attention: MultiHeadAttention, qkv_proj: nn.Module | None = None
                       ) -> StackedSelfAttention | None:
        """``attention`` with its W^Q, W^K, W^V stacked, rows in that order, so that the outputs are theirs side
        by side; its other layers and its rotary embedding are taken over, not copied. ``qkv_proj``, if given, is
        that stacked layer, made elsewhere (from a file's weights, already quantized), and ``attention``'s own
        three are not read. None unless ``attention`` is a plain :class:`MultiHeadAttention` whose projections
        are plain ``nn.Linear`` layers (or ``qkv_proj`` is given)."""
        if type(attention) is not MultiHeadAttention:
            return None
        if qkv_proj is None:
            qkv_proj = stack_linears((attention.q_proj, attention.k_proj, attention.v_proj))
        if qkv_proj is None:
            return None
        with torch.device("meta"):  # the layers made here are replaced at once by attention's own
            stacked = cls(attention.d_model, attention.n_heads, **attention.options())
        stacked.qkv_proj, stacked.out_proj, stacked.gate_proj = qkv_proj, attention.out_proj, attention.gate_proj
        return stacked.train(attention.training)

    def forward(self, query: Tensor, key_value: Tensor | None = None, *, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, attn_bias: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, need_weights: bool = False,
                unpadded: Unpadded | None = None) -> tuple[Tensor, Tensor | None]:
        """:meth:`MultiHeadAttention.forward`; a decoding step on a CPU (a few new tokens a row at most, a cache, no
        mask, bias or weights asked for) in one call of qkv's own (:meth:`_decode`)."""
        if (key_value is None and key_padding_mask is None and attn_mask is None and attn_bias is None
                and not need_weights and unpadded is None and self.decodes(query, cache)):
            return self._decode(query, positions, cache), None
        return super().forward(query, key_value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                               attn_bias=attn_bias, positions=positions, cache=cache, need_weights=need_weights,
                               unpadded=unpadded)

    def decodes(self, query: Tensor, cache: KVCache | None) -> bool:
        """Whether :meth:`_decode` computes this step (with no mask, bias or weights asked for): at most
        ``DECODED`` new tokens a row (one when decoding, a few when checking drafts: then each gets the numbers it
        gets alone), a cache of float32 positions whose numbers lie side by side (as it makes them) or none yet, no
        score cap, and :func:`qkv.kernels.ops.applies` (query/key norms are applied first, by their own modules)."""
        if cache is None or query.size(1) > DECODED or self.softcap is not None:
            return False
        k = cache._k
        fits = k is None or (k.dtype == torch.float32 and k.stride(3) == 1 and k.stride(2) == k.size(3))
        return fits and ops.applies(query)

    def _decode(self, query: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor:
        """A few new tokens a row, as :meth:`forward` computes them, in one call
        (:func:`qkv.kernels.ops.decode_attention`): their queries and keys turned by the rotary positions, their keys
        and values written into the cache, each query's attention over its row's cached positions up to its own
        (``cache.starts`` on, the last ``window``); then W^O."""
        b, t = query.shape[:2]
        qkv = product(self.qkv_proj, query).view(b, t, -1)
        if self.q_norm is not None:
            qkv = self._qk_normed(qkv)
        length = len(cache)
        if cache._k is None or length + t > cache._k.size(2):
            like = qkv.new_empty(b, self.n_kv_heads, 1, self.head_dim)
            cache._grow(like, like, length + t)
        tables = None
        if self.rotary is not None:
            tables = self.rotary.cos_sin(self._positions(positions, cache, t, query.device))
        starts = None if cache.starts is None or not any(cache.starts) else torch.tensor(cache.starts)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        heads = ops.decode_attention(qkv.contiguous(), self.n_heads, self.n_kv_heads, self.head_dim, tables,
                                     self.head_dim if self.rotary is None else self.rotary.rotary_dim,
                                     self.rotary is not None and self.rotary.interleaved, cache._k, cache._v, length,
                                     starts, self.window, scale)
        cache.length = length + t
        out = heads.view(b, t, self.inner_dim)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(query))
        return product(self.out_proj, out)

    def _qk_normed(self, qkv: Tensor) -> Tensor:
        """``qkv`` ``(B, t, width)`` with its queries and keys normalised by ``q_norm`` and ``k_norm`` as
        :meth:`_project` normalises them (each head's, or the whole projections'), the values as they are."""
        d_q, d_kv = self.inner_dim, self.n_kv_heads * self.head_dim
        if qkv.size(0) * qkv.size(1) == 1 and all(type(n) is RMSNorm and n.fused for n in (self.q_norm, self.k_norm)):
            row = qkv.view(-1)  # one token: its queries and keys normed where they lie, one call each
            for part, norm in ((row[:d_q], self.q_norm), (row[d_q : d_q + d_kv], self.k_norm)):
                ops.rms_norm(part if self.qk_norm_whole else part.view(-1, self.head_dim), norm.gains(), norm.eps,
                             in_place=True)
            return qkv
        q, k, v = qkv.split([d_q, d_kv, d_kv], dim=-1)
        if not self.qk_norm_whole:
            q, k = q.unflatten(-1, (self.n_heads, self.head_dim)), k.unflatten(-1, (self.n_kv_heads, self.head_dim))
        return torch.cat([self.q_norm(q).flatten(2), self.k_norm(k).flatten(2), v], dim=-1)

    def _project(self, query: Tensor, key_value: Tensor | None, positions: Tensor | None,
                 cache: KVCache | None, unpadded: Unpadded | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if key_value is not None:
            raise ValueError("this attention's projections are stacked for self-attention; do not pass key_value")
        h, h_kv = self.n_heads, self.n_kv_heads
        qkv = self.qkv_proj(query)
        if self.q_norm is not None and self.qk_norm_whole:  # over all the heads' queries, and all the keys
            d_q, d_kv = self.inner_dim, h_kv * self.head_dim
            qkv = torch.cat([self.q_norm(qkv[..., :d_q]), self.k_norm(qkv[..., d_q : d_q + d_kv]),
                             qkv[..., d_q + d_kv :]], dim=-1)
        qkv = self._in_rows(qkv, unpadded)
        b, t_q, _ = qkv.shape
        qkv = qkv.view(b, t_q, h + 2 * h_kv, self.head_dim).transpose(1, 2)  # (B, H + 2 H_kv, T, Dh)
        qk, v = qkv[:, : h + h_kv], qkv[:, h + h_kv :]
        if self.q_norm is not None and not self.qk_norm_whole:  # each with its own gains: Q and K apart
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        if self.rotary is not None:
            qk = self.rotary(qk, self._positions(positions, cache, t_q, query.device))
        q, k = qk[:, :h], qk[:, h:]
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v
