"""Decoder-only language model (GPT): the Transformer's decoder without cross-attention.

    ids ─ token embedding (+ positions) ─ N × [causal self-attention, FFN] ─ final norm ─ Linear ─ logits

GPT-2 style by default (LayerNorm, learned positions, GELU, biases); the config switches give the LLaMA
family (RMSNorm, rotary positions, SwiGLU, grouped key/value heads, no biases), and the blocks of the families
since (:func:`decoder_layer`): layers of their own kinds (local or global, with or without rotary positions),
norms around each sub-layer's output, scaled or capped scores, embeddings and logits.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor, nn

from ..config import GPTConfig, LayerSpec
from ..nn import (
    Decoder,
    DecoderCache,
    DecoderLayer,
    RotaryEmbedding,
    padding_mask,
    segment_mask,
    segment_positions,
)
from ..nn.moe import MoEFeedForward, balancing_loss
from ..nn.unpadded import first_in_rows, in_rows, spread, take, unpadded, zeros_at_padding
from . import common
from .common import WithAttention


def decoder_layer(cfg: GPTConfig, spec: LayerSpec, rope: RotaryEmbedding | None) -> DecoderLayer:
    """One layer of a decoder-only model: causal self-attention with this layer's window and rotary positions
    (``spec``), then the feed-forward network, each in a residual connection with the config's norms."""
    whole_norms = {}
    if cfg.qk_norm_whole:  # over all the heads' queries and all the keys, not head by head
        whole_norms = {"q_norm": common.norm(cfg, cfg.n_heads * cfg.head_dim), "qk_norm_whole": True,
                       "k_norm": common.norm(cfg, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim)}
    attention = common.attention(cfg, causal=True, rope=rope if spec.rotary else None, window=spec.window,
                                 scale=cfg.attention_scale, softcap=cfg.attention_softcap, **whole_norms)
    in_norms = not cfg.branch_norm or cfg.norm_first  # OLMo 2's norms are in the branches alone
    feed_forward = common.feed_forward(cfg) if cfg.n_experts is None or spec.dense else MoEFeedForward(
        cfg.d_model, cfg.expert_d_ff or cfg.d_ff, cfg.n_experts, cfg.expert_top_k, activation=cfg.activation,
        normalize=cfg.expert_normalize, shared_d_ff=cfg.shared_expert_d_ff, bias=cfg.bias)
    return DecoderLayer(
        self_attn=attention, cross_attn=None, feed_forward=feed_forward,
        self_attn_norm=common.norm(cfg) if in_norms else None, cross_attn_norm=None,
        ffn_norm=common.norm(cfg) if in_norms else None,
        self_attn_out_norm=common.norm(cfg) if cfg.branch_norm else None,
        ffn_out_norm=common.norm(cfg) if cfg.branch_norm else None,
        dropout=cfg.dropout, norm_first=cfg.norm_first, residual_scale=cfg.residual_scale,
    )


def _layers(cfg: GPTConfig) -> list[DecoderLayer]:
    """Every layer, those with the same rotary positions sharing one embedding (its angles computed once a step)."""
    ropes: dict[tuple, RotaryEmbedding | None] = {}
    layers = []
    for i in range(cfg.n_layers):
        spec = cfg.layer(i)
        key = (spec.rope_base, spec.rope_scaled)
        if spec.rotary and key not in ropes:
            ropes[key] = common.rotary(cfg, base=spec.rope_base, scaled=spec.rope_scaled)
        layers.append(decoder_layer(cfg, spec, ropes.get(key)))
    return layers


class GPT(common.Model):
    """Decoder-only Transformer configured by a :class:`GPTConfig`.

    Shape:
        ids ``(B, T)`` -> logits ``(B, T, vocab_size)``.
    """

    output_layer = "lm_head"  # the layer that writes the logits (kept at 8 bits by qkv.quantize's int4)
    checkpointing = False  # training: recompute each layer's activations in the backward pass (see Decoder)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.tok_emb = nn.Embedding(cfg.table_rows(cfg.vocab_size), cfg.d_model)
        self.positions = common.absolute_positions(cfg)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.decoder = Decoder(_layers(cfg), common.norm(cfg) if cfg.norm_first or cfg.branch_norm else None)
        self.lm_head = nn.Linear(cfg.d_model, cfg.table_rows(cfg.vocab_size), bias=False)
        common.init_weights(self, cfg, residual_layers=cfg.n_layers)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def routing_balance(self) -> Tensor | None:
        """How evenly the last forward's tokens went to the experts: the Switch Transformer's balancing loss over
        every layer's routing (:func:`~qkv.nn.moe.balancing_loss`: k when they share the tokens and the
        probability evenly, up to k·E when one expert takes them all); None for a dense model."""
        logits = [m.router_logits for m in self.modules() if isinstance(m, MoEFeedForward)]
        if not logits or logits[0] is None:
            return None
        return balancing_loss(logits, self.config.expert_top_k)

    def balance_loss(self) -> Tensor | None:
        """:meth:`routing_balance` weighted as the config says (``balance_loss``): what training adds to the loss of
        a mixture of experts; None for a dense model."""
        balance = self.routing_balance()
        return None if balance is None else self.config.balance_loss * balance

    def new_cache(self, capacity: int | None = None) -> DecoderCache:
        """An empty KV cache with room for ``capacity`` positions to start with (it grows as needed)."""
        return self.decoder.new_cache(capacity)

    @overload
    def forward(self, ids: Tensor, *, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                segments: Tensor | None = None, cache: DecoderCache | None = None, last_only: bool = False,
                logits_at: Tensor | None = None, real: Tensor | None = None, copies: Tensor | None = None,
                return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, ids: Tensor, *, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                segments: Tensor | None = None, cache: DecoderCache | None = None, last_only: bool = False,
                logits_at: Tensor | None = None, real: Tensor | None = None, copies: Tensor | None = None,
                return_attention: Literal[True]) -> WithAttention: ...

    def forward(
        self,
        ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        segments: Tensor | None = None,
        cache: DecoderCache | None = None,
        last_only: bool = False,
        logits_at: Tensor | None = None,
        real: Tensor | None = None,
        copies: Tensor | None = None,
        return_attention: bool = False,
    ) -> Tensor | WithAttention:
        """Next-token logits for every position.

        Args:
            ids: token ids ``(B, T)``; with a cache, only the new ones.
            attention_mask: ``(B, T_past + T)``, True/1 for real tokens. Defaults to ``ids != pad_id`` when
                the config has a pad_id (and no cache is used). Positions then count real tokens only, so a
                left-padded sequence gets the same positions as it would alone.
            positions: explicit positions ``(T,)`` or ``(B, T)``; by default they follow the mask or cache.
            segments: packed rows ``(B, T)``: each token's example number; a token attends to its own example's
                earlier tokens only, and positions restart at 0 with each example (no cache).
            cache: from :meth:`new_cache`; extended in place.
            last_only: logits for the last position only, ``(B, 1, vocab_size)``: all that decoding needs, and
                the output layer is the largest product of a step (49k × 576 in SmolLM2).
            logits_at: the logits of these positions only, flat indices into the ``B · T`` positions ``(N,)``:
                training that learns a few tokens of each row (a chat's answers) needs no others, and the
                ``(B, T, vocab_size)`` logits are most of such a step's memory. The result is ``(N, vocab_size)``.
            real: the flat indices ``(N,)`` of the batch's real tokens among its ``B · T`` positions, found on the
                host (as ``logits_at``): every layer but attention then runs on those ``N`` tokens alone, none of
                its products on padding (:mod:`qkv.nn.unpadded`), and the other positions are padding; positions
                count the real tokens, as ``attention_mask`` has them. No ``attention_mask``, cache,
                ``last_only`` or attention weights.
            copies: with ``real``, where several positions hold one token, ``(B, T)``: the token (its place in
                ``real``, which then lists each token's first position) each position holds, −1 at padding.
                Examples that begin alike (a chat template's system prompt) do the work of those tokens once
                (:func:`qkv.nn.unpadded.shared_tokens`); the same logits and gradients.
            return_attention: also return the attention weights.

        Returns:
            logits ``(B, T, vocab_size)``; with ``return_attention``, ``WithAttention(logits, attention)`` where
            attention is a list of ``n_layers`` tensors ``(B, H, T, T_past + T)``, one per layer: row i is how
            much position i attends to each cached and new position (zero for later positions and masked
            ones). ``T_past`` is the number of cached positions (0 without a cache).
        """
        cfg = self.config
        common.check_ids(ids, cfg.vocab_size)
        past = 0 if cache is None else len(cache)
        b, t = ids.shape
        where = rows = None
        if copies is not None and (real is None or copies.shape != ids.shape):
            raise ValueError(f"copies must come with real and have the shape of ids {tuple(ids.shape)}")
        if real is not None:
            if attention_mask is not None or cache is not None or last_only or return_attention:
                raise ValueError("real (the batch's real tokens) takes no attention_mask, cache, last_only or "
                                 "return_attention")
            where = unpadded(real, (b, t), copies)
            rows = first_in_rows(where)  # where attention lays them out: each row's first, the padding after
        elif attention_mask is None and cfg.pad_id is not None and cache is None:
            attention_mask = padding_mask(ids, cfg.pad_id)
        if attention_mask is not None:
            attention_mask = common.check_mask(attention_mask, ids.new_empty(b, past + t), "attention_mask")
        counted = attention_mask if where is None else where.real  # positions count the real tokens
        if counted is not None and positions is None and segments is None:
            positions = (counted.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
        attn_mask = None
        if segments is not None:
            if cache is not None or segments.shape != ids.shape:
                raise ValueError(f"segments must have the shape of ids {tuple(ids.shape)}, without a cache; got "
                                 f"{tuple(segments.shape)}")
            positions = segment_positions(segments) if positions is None else positions
            if rows is not None:  # the segments as attention lays the positions out
                segments = in_rows(where, segments)
            attn_mask = segment_mask(segments)  # (B, 1, T, T)
        if positions is None:
            positions = torch.arange(past, past + t, device=ids.device)

        x = self.tok_emb(ids)  # (B, T, D)
        if cfg.embedding_scale != 1.0:
            x = x * cfg.embedding_scale
        if self.positions is not None:
            x = x + self.positions(positions)
        if where is not None:  # (1, N, D): the real tokens end to end; their positions as attention lays them out
            x, positions = take(where, x), in_rows(where, positions.expand(b, t))
        x, weights, _ = self.decoder(
            self.emb_dropout(x), key_padding_mask=attention_mask, attn_mask=attn_mask, positions=positions,
            cache=cache, need_weights=return_attention, checkpointing=self.checkpointing and self.training,
            unpadded=rows,
        )
        x = x[:, -1:] if last_only else x
        if where is not None and logits_at is None:
            x = zeros_at_padding(where, spread(where, x))  # (B, T, D)
        elif where is not None:  # the tokens that logits_at's positions hold
            logits_at = where.source.index_select(0, logits_at)
        if logits_at is not None:
            x = x.flatten(0, 1).index_select(0, logits_at)  # (N, D)
        logits = self.lm_head(x)[..., : cfg.vocab_size]  # the table's padding rows are never a token
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        return WithAttention(logits, weights) if return_attention else logits
