"""Encoder and decoder layers, and the stacks made of them.

Each sub-layer (attention or feed-forward) sits inside a residual connection with a norm, in one of two
arrangements:

    Post-Norm (the 2017 paper, BERT):   x = Norm(x + Dropout(Sublayer(x)))
    Pre-Norm  (GPT-2, LLaMA):           x = x + Dropout(Sublayer(Norm(x)))

Pre-Norm keeps an un-normalised path from input to output, so deep stacks train without warmup tricks; it
then needs one final norm after the last layer. Two newer arrangements also normalise what a sub-layer adds
(its *branch*), so that no layer can add without bound to the stream:

    Sandwich  (Gemma 2 and 3):          x = x + Norm_out(Sublayer(Norm(x)))
    Branch    (OLMo 2):                 x = x + Norm_out(Sublayer(x))

and a branch may be scaled before it is added (Granite's ``residual_multiplier``).

The layers receive their parts (attention modules, feed-forward network, norms) ready-made: the model
builders in :mod:`qkv.models` decide which attention, which norm, which activation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from ..kernels import ops
from .attention import KVCache, MultiHeadAttention, StackedSelfAttention
from .feedforward import StackedFeedForward
from .norm import RMSNorm
from .unpadded import Unpadded


def _residual(x: Tensor, norm: nn.Module | None, dropout: nn.Module, norm_first: bool, sublayer,
              out_norm: nn.Module | None = None, scale: float = 1.0) -> tuple:
    """Apply ``sublayer`` inside a residual connection; returns (new x, the sublayer's extra output).

    ``norm`` is at the sub-layer's input (Pre-Norm) or after the addition (Post-Norm), or absent (None);
    ``out_norm`` normalises the branch before it is added, and ``scale`` multiplies it.
    Dropout is the identity outside training, so it is not called then (a decoding step saves a module call a
    sub-layer)."""
    before = norm is not None and norm_first
    out, extra = sublayer(norm(x) if before else x)
    if out_norm is not None:
        out = out_norm(out)
    if dropout.training:
        out = dropout(out)
    if scale != 1.0:
        out = out * scale
    if norm is None or norm_first:
        return x + out, extra
    return norm(x + out), extra


class EncoderLayer(nn.Module):
    """Self-attention then a feed-forward network, each in a residual connection.

    Args:
        self_attn: the self-attention (not causal in an encoder).
        feed_forward: the position-wise feed-forward network.
        self_attn_norm: norm around the attention sub-layer.
        ffn_norm: norm around the feed-forward sub-layer.
        dropout: dropout on each sub-layer's output before the residual addition.
        norm_first: Pre-Norm (True) or Post-Norm (False).

    Shape:
        x ``(B, T, d_model)``, key_padding_mask ``(B, T)`` -> ``(B, T, d_model)``.
    """

    def __init__(
        self,
        *,
        self_attn: MultiHeadAttention,
        feed_forward: nn.Module,
        self_attn_norm: nn.Module,
        ffn_norm: nn.Module,
        dropout: float = 0.0,
        norm_first: bool = True,
    ) -> None:
        super().__init__()
        self.self_attn, self.feed_forward = self_attn, feed_forward
        self.self_attn_norm, self.ffn_norm = self_attn_norm, ffn_norm
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        def attend(h: Tensor):
            return self.self_attn(
                h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, positions=positions,
                need_weights=need_weights,
            )

        x, weights = _residual(x, self.self_attn_norm, self.dropout, self.norm_first, attend)
        x, _ = _residual(x, self.ffn_norm, self.dropout, self.norm_first, lambda h: (self.feed_forward(h), None))
        return x, weights


class LayerCache:
    """The KV caches of one decoder layer: its self-attention (room for ``capacity`` positions to start with)
    and (if any) its cross-attention."""

    def __init__(self, capacity: int | None = None) -> None:
        self.self_attn = KVCache(capacity)
        self.cross_attn = KVCache()

    def reorder(self, index: Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, then a feed-forward network.

    With ``cross_attn=None`` this is the decoder-only (GPT) block: the same layer with the middle sub-layer
    removed, since there is no encoder to look at.

    Args:
        self_attn: causal self-attention.
        cross_attn: attention from the decoder to the encoder output, or None for decoder-only models.
        feed_forward: the position-wise feed-forward network.
        self_attn_norm, cross_attn_norm, ffn_norm: the norm of each sub-layer (``cross_attn_norm`` None
            exactly when ``cross_attn`` is); None for a sub-layer normalised in its branch alone (OLMo 2).
        self_attn_out_norm, ffn_out_norm: norms of what the self-attention and the feed-forward network add to the
            stream (Gemma's sandwich, OLMo 2), or None.
        dropout: dropout on each sub-layer's output before the residual addition.
        norm_first: Pre-Norm (True) or Post-Norm (False).
        residual_scale: each sub-layer's output times this before it is added (Granite).

    Shape:
        x ``(B, T, d_model)``, memory ``(B, S, d_model)``, memory_key_padding_mask ``(B, S)`` ->
        ``(B, T, d_model)``.
    """

    def __init__(
        self,
        *,
        self_attn: MultiHeadAttention,
        cross_attn: MultiHeadAttention | None,
        feed_forward: nn.Module,
        self_attn_norm: nn.Module | None,
        cross_attn_norm: nn.Module | None,
        ffn_norm: nn.Module | None,
        self_attn_out_norm: nn.Module | None = None,
        ffn_out_norm: nn.Module | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        residual_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if (cross_attn is None) != (cross_attn_norm is None):
            raise ValueError("cross_attn and cross_attn_norm must be given together")
        for name, norm, out_norm in (("self_attn", self_attn_norm, self_attn_out_norm),
                                     ("ffn", ffn_norm, ffn_out_norm)):
            if norm is None and out_norm is None:
                raise ValueError(f"{name} needs a norm: {name}_norm, {name}_out_norm or both")
        self.self_attn, self.cross_attn, self.feed_forward = self_attn, cross_attn, feed_forward
        self.self_attn_norm, self.cross_attn_norm, self.ffn_norm = self_attn_norm, cross_attn_norm, ffn_norm
        self.self_attn_out_norm, self.ffn_out_norm = self_attn_out_norm, ffn_out_norm
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first
        self.residual_scale = residual_scale

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
        unpadded: Unpadded | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Returns ``(x, self-attention weights, cross-attention weights)``; weights None unless asked.
        ``unpadded``: ``x`` is a padded batch's real tokens end to end (:mod:`qkv.nn.unpadded`)."""
        if (memory is None and key_padding_mask is None and attn_mask is None and not need_weights
                and unpadded is None and self._decodes(x, cache)):
            return self._decode(x, positions, cache), None, None
        if unpadded is not None and self.cross_attn is not None:
            raise ValueError("unpadded tokens take no cross-attention (its memory is in padded rows)")
        if (memory is None) != (self.cross_attn is None):
            raise ValueError(
                "this layer has cross-attention and needs the encoder output (memory)"
                if memory is None
                else "this decoder-only layer has no cross-attention; do not pass memory"
            )

        def attend_self(h: Tensor):
            return self.self_attn(
                h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, positions=positions,
                cache=None if cache is None else cache.self_attn, need_weights=need_weights, unpadded=unpadded,
            )

        def attend_memory(h: Tensor):
            return self.cross_attn(
                h, memory, key_padding_mask=memory_key_padding_mask,
                cache=None if cache is None else cache.cross_attn, need_weights=need_weights,
            )

        scale = self.residual_scale
        x, self_weights = _residual(x, self.self_attn_norm, self.dropout, self.norm_first, attend_self,
                                    self.self_attn_out_norm, scale)
        cross_weights = None
        if self.cross_attn is not None:
            x, cross_weights = _residual(x, self.cross_attn_norm, self.dropout, self.norm_first, attend_memory)
        x, _ = _residual(x, self.ffn_norm, self.dropout, self.norm_first, lambda h: (self.feed_forward(h), None),
                         self.ffn_out_norm, scale)
        return x, self_weights, cross_weights

    def _decodes(self, x: Tensor, cache: LayerCache | None) -> bool:
        """Whether :meth:`_decode` computes this step: a decoder-only Pre-Norm layer with RMSNorms and stacked
        self-attention, not training, whose attention decodes this step in one call (with no mask or weights)."""
        if cache is None or not self.norm_first:
            return False
        modules = self._modules  # read once: each submodule of a module is a lookup through nn.Module
        attention, attn_norm, ffn_norm = modules["self_attn"], modules.get("self_attn_norm"), modules.get("ffn_norm")
        return (modules.get("cross_attn") is None and not modules["dropout"].training
                and type(attn_norm) is RMSNorm and type(ffn_norm) is RMSNorm and attn_norm.fused and ffn_norm.fused
                and isinstance(attention, StackedSelfAttention) and attention.decodes(x, cache.self_attn))

    def _decode(self, x: Tensor, positions: Tensor | None, cache: LayerCache) -> Tensor:
        """A few new tokens a row through the layer, as :meth:`forward` computes them, with fewer calls: each norm,
        the attention (:meth:`StackedSelfAttention._decode`), and the residual sum with the norm after it
        (:func:`qkv.kernels.ops.add_rms_norm`) one call of qkv's own each."""
        attn_norm, ffn_norm, scale = self.self_attn_norm, self.ffn_norm, self.residual_scale
        out = self.self_attn._decode(ops.rms_norm(x, attn_norm.gains(), attn_norm.eps), positions, cache.self_attn)
        out = _branch_normed(self.self_attn_out_norm, out)
        x, h = ops.add_rms_norm(x, out if scale == 1.0 else out * scale, ffn_norm.gains(), ffn_norm.eps)
        ffn = self.feed_forward
        out = ffn.decode(h) if type(ffn) is StackedFeedForward else ffn(h)
        out = _branch_normed(self.ffn_out_norm, out)
        return x + (out if scale == 1.0 else out * scale)


def _branch_normed(norm: nn.Module | None, out: Tensor) -> Tensor:
    """A decoding step's sub-layer output through the norm on its branch (Gemma's), if any: an RMSNorm's one call of
    qkv's own straight away (a module call costs more than the norm of a row)."""
    if norm is None:
        return out
    return ops.rms_norm(out, norm.gains(), norm.eps) if type(norm) is RMSNorm and norm.fused else norm(out)


class Encoder(nn.Module):
    """N encoder layers, then a final norm (Pre-Norm stacks need it; Post-Norm ones pass None).

    Shape:
        x ``(B, S, d_model)``, key_padding_mask ``(B, S)`` -> ``(B, S, d_model)``.
    """

    def __init__(self, layers: Sequence[EncoderLayer], norm: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Returns ``(x, per-layer attention weights)``; the list is empty unless ``need_weights``."""
        all_weights = []
        for layer in self.layers:
            x, weights = layer(x, key_padding_mask=key_padding_mask, positions=positions, need_weights=need_weights)
            if need_weights:
                all_weights.append(weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, all_weights


class DecoderCache:
    """KV caches for every layer of a decoder, and the number of positions decoded so far.

    ``capacity``: how many positions to allocate room for at once (a guess is fine: the caches grow).
    """

    def __init__(self, n_layers: int, capacity: int | None = None) -> None:
        self.layers = [LayerCache(capacity) for _ in range(n_layers)]

    def __len__(self) -> int:
        return len(self.layers[0].self_attn)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index``, e.g. the surviving hypotheses of a beam search step."""
        for layer in self.layers:
            layer.reorder(index)

    def extend(self, other: DecoderCache) -> None:
        """Add ``other``'s rows after these, right-aligned (a decoder-only model's self-attention caches: see
        :meth:`~qkv.nn.attention.KVCache.extend`)."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.self_attn.extend(theirs.self_attn)

    def drop_left(self, n: int) -> None:
        """Forget every row's first ``n`` positions."""
        for layer in self.layers:
            layer.self_attn.drop_left(n)

    def drop_right(self, n: int) -> None:
        """Forget every row's last ``n`` positions (speculative decoding's rejected drafts)."""
        for layer in self.layers:
            layer.self_attn.drop_right(n)


class Decoder(nn.Module):
    """N decoder layers, then a final norm (or None for Post-Norm).

    Shape:
        x ``(B, T, d_model)``, memory ``(B, S, d_model)`` -> ``(B, T, d_model)``.
    """

    def __init__(self, layers: Sequence[DecoderLayer], norm: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def new_cache(self, capacity: int | None = None) -> DecoderCache:
        return DecoderCache(len(self.layers), capacity)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
        need_weights: bool = False,
        checkpointing: bool = False,
        unpadded: Unpadded | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Returns ``(x, self-attention weights per layer, cross-attention weights per layer)``.

        ``attn_mask`` (boolean, True = may attend, broadcastable to ``(B, H, T, T_k)``) is added to every layer's
        self-attention masks (packed rows: :func:`~qkv.nn.segment_mask`). ``checkpointing`` (training):
        activation checkpointing, each layer's activations recomputed in the backward pass instead of kept,
        for about a third more compute; the memory of one layer's activations instead of all of them.
        ``unpadded``: ``x`` ``(1, N, d_model)`` is a padded batch's real tokens end to end
        (:mod:`qkv.nn.unpadded`), and so is the result."""
        self_weights, cross_weights = [], []
        for i, layer in enumerate(self.layers):
            options = dict(key_padding_mask=key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                           attn_mask=attn_mask, positions=positions, cache=None if cache is None else cache.layers[i],
                           need_weights=need_weights, unpadded=unpadded)
            if checkpointing and torch.is_grad_enabled():
                x, sw, cw = torch.utils.checkpoint.checkpoint(layer, x, memory, use_reentrant=False, **options)
            else:
                x, sw, cw = layer(x, memory, **options)
            if need_weights:
                self_weights.append(sw)
                if cw is not None:
                    cross_weights.append(cw)
        if self.norm is not None:
            x = self.norm(x)
        return x, self_weights, cross_weights
