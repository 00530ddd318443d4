"""The encoder-decoder Transformer (Vaswani et al. 2017), the notes' translation model.

    source ids ─ embed·√d + positions ─ Encoder ─────────────── memory
                                                                  │ (cross-attention)
    target ids ─ embed·√d + positions ─ Decoder (causal) ─────────┴─ Linear ─ softmax ─ next-token probs

Training feeds the whole shifted target at once (teacher forcing); the causal mask keeps each position
from seeing its future. Translating runs the encoder once and the decoder one token at a time, with a KV
cache so each step costs only the new position: :meth:`Transformer.start_decoding` gives the
:class:`TransformerDecoding` that greedy and beam search drive.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, overload

import torch
from torch import Tensor, nn

from ..config import TransformerConfig
from ..nn import Decoder, DecoderCache, Encoder, padding_mask
from . import common
from .common import WithAttention


class Transformer(common.Model):
    """Encoder-decoder Transformer configured by a :class:`TransformerConfig`.

    Example:
        >>> cfg = TransformerConfig(src_vocab_size=1000, tgt_vocab_size=1200, d_model=64, n_heads=4, n_layers=2)
        >>> logits = Transformer(cfg)(src, tgt_in)  # (B, T_tgt, 1200)

    Shape:
        src ``(B, S)``, tgt ``(B, T)`` token ids, padding = ``pad_id`` -> logits ``(B, T, tgt_vocab_size)``.

    Attention maps:
        With ``return_attention=True``, :meth:`forward`, :meth:`encode` and :meth:`decode` return a
        :class:`~qkv.models.common.WithAttention` ``(output, attention)``. ``attention`` holds one tensor per
        layer, ``(B, H, T_query, T_key)``, each row a distribution over the keys (zero on padded source keys):

        * ``"encoder"``: ``n_encoder_layers`` tensors ``(B, H, S, S)`` (:meth:`encode` returns this list alone);
        * ``"decoder_self"``: ``n_decoder_layers`` tensors ``(B, H, T, T_past + T)``, zero above the diagonal;
        * ``"decoder_cross"``: ``n_decoder_layers`` tensors ``(B, H, T, S)``.

        :meth:`forward` gives all three keys, :meth:`decode` the two decoder ones. ``T_past`` is the number of
        cached positions (0 without a cache).
    """

    output_layer = "lm_head"  # the layer that writes the logits (kept at 8 bits by qkv.quantize's int4)
    # The vocabulary layer was named out_proj until 2026-11-24: checkpoints from then load.
    renamed_weights: ClassVar[dict[str, str]] = {"out_proj.weight": "lm_head.weight"}

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.src_emb = nn.Embedding(cfg.table_rows(cfg.src_vocab_size), cfg.d_model)
        self.tgt_emb = self.src_emb if cfg.share_embeddings else \
            nn.Embedding(cfg.table_rows(cfg.tgt_vocab_size), cfg.d_model)
        self.positions = common.absolute_positions(cfg)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        rope = common.rotary(cfg)
        self.encoder = Encoder(
            [common.encoder_layer(cfg, rope) for _ in range(cfg.n_encoder_layers)], common.final_norm(cfg)
        )
        self.decoder = Decoder(
            [common.decoder_layer(cfg, rope, cross=True) for _ in range(cfg.n_decoder_layers)], common.final_norm(cfg)
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.table_rows(cfg.tgt_vocab_size), bias=cfg.output_bias)  # vocabulary
        common.init_weights(self, cfg)
        if cfg.tie_output:
            self.lm_head.weight = self.tgt_emb.weight

    def _embed(self, ids: Tensor, table: nn.Embedding, start: int = 0) -> Tensor:
        x = table(ids)  # (B, T, D)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        if self.positions is not None:
            x = x + self.positions(torch.arange(start, start + ids.size(1), device=ids.device))
        return self.emb_dropout(x)

    def source_mask(self, src: Tensor) -> Tensor | None:
        """``(B, S)`` boolean, True for real source tokens (None when the config has no pad_id)."""
        return None if self.config.pad_id is None else padding_mask(src, self.config.pad_id)

    @overload
    def encode(self, src: Tensor, *, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def encode(self, src: Tensor, *, return_attention: Literal[True]) -> WithAttention: ...

    def encode(self, src: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        """Run the encoder: source ids ``(B, S)`` -> memory ``(B, S, d_model)``; with ``return_attention``,
        ``WithAttention(memory, encoder weights)`` (see the class docstring)."""
        memory, weights = self._encode(src, need_weights=return_attention)
        return WithAttention(memory, weights) if return_attention else memory

    def _encode(self, src: Tensor, *, need_weights: bool) -> tuple[Tensor, list[Tensor]]:
        common.check_ids(src, self.config.src_vocab_size, "src")
        return self.encoder(
            self._embed(src, self.src_emb), key_padding_mask=self.source_mask(src), need_weights=need_weights
        )

    @overload
    def decode(self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               cache: DecoderCache | None = None, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def decode(self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               cache: DecoderCache | None = None, return_attention: Literal[True]) -> WithAttention: ...

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        memory_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
        return_attention: bool = False,
    ) -> Tensor | WithAttention:
        """Run the decoder over target ids and return next-token logits.

        Args:
            tgt: target ids ``(B, T)``; with a cache, only the new ones (usually one per step).
            memory: encoder output ``(B, S, d_model)``.
            memory_mask: ``(B, S)`` boolean, True for real source tokens (see :meth:`source_mask`).
            cache: from :meth:`new_cache`; extended in place.
            return_attention: also return the decoder's weights (see the class docstring).

        Returns:
            logits ``(B, T, tgt_vocab_size)``, or ``WithAttention(logits, {"decoder_self", "decoder_cross"})``.
        """
        logits, self_w, cross_w = self._decode(tgt, memory, memory_mask, cache, need_weights=return_attention)
        if return_attention:
            return WithAttention(logits, {"decoder_self": self_w, "decoder_cross": cross_w})
        return logits

    def _decode(self, tgt: Tensor, memory: Tensor, memory_mask: Tensor | None, cache: DecoderCache | None, *,
                need_weights: bool) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """-> logits ``(B, T, V)``, self- and cross-attention weights per layer (empty unless need_weights)."""
        common.check_ids(tgt, self.config.tgt_vocab_size, "tgt")
        if memory.dim() != 3 or memory.size(-1) != self.config.d_model:
            raise ValueError(f"memory must have shape (B, S, {self.config.d_model}), got {tuple(memory.shape)}")
        common.check_batch(tgt, memory, "tgt", "memory")
        if memory_mask is not None:
            memory_mask = common.check_mask(memory_mask, memory[..., 0], "memory_mask")
        start = 0 if cache is None else len(cache)
        # Right padding needs no target padding mask: the causal mask already hides later (padding) keys.
        x, self_w, cross_w = self.decoder(
            self._embed(tgt, self.tgt_emb, start),
            memory,
            memory_key_padding_mask=memory_mask,
            cache=cache,
            need_weights=need_weights,
        )
        return self.lm_head(x)[..., : self.config.tgt_vocab_size], self_w, cross_w  # padding rows: never a token

    def new_cache(self, capacity: int | None = None) -> DecoderCache:
        """An empty KV cache with room for ``capacity`` positions to start with (it grows as needed)."""
        return self.decoder.new_cache(capacity)

    def start_decoding(self, src: Tensor, *, use_cache: bool = True) -> TransformerDecoding:
        """The source ``(B, S)`` encoded once, ready for :mod:`qkv.generation`'s greedy and beam search: the
        decoding adapter every encoder-decoder model offers (see :class:`TransformerDecoding`)."""
        return TransformerDecoding(self, src, use_cache=use_cache)

    @overload
    def forward(self, src: Tensor, tgt: Tensor, *, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, src: Tensor, tgt: Tensor, *, return_attention: Literal[True]) -> WithAttention: ...

    def forward(self, src: Tensor, tgt: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        """Teacher-forced pass: logits ``(B, T, tgt_vocab_size)`` for every target position; with
        ``return_attention``, ``WithAttention(logits, {"encoder", "decoder_self", "decoder_cross"})`` (see the
        class docstring)."""
        common.check_ids(src, self.config.src_vocab_size, "src")
        common.check_ids(tgt, self.config.tgt_vocab_size, "tgt")
        common.check_batch(src, tgt, "src", "tgt")
        memory, enc_w = self._encode(src, need_weights=return_attention)  # (B, S, D)
        logits, self_w, cross_w = self._decode(tgt, memory, self.source_mask(src), None, need_weights=return_attention)
        if return_attention:
            return WithAttention(logits, {"encoder": enc_w, "decoder_self": self_w, "decoder_cross": cross_w})
        return logits


class TransformerDecoding:
    """A :class:`Transformer` as :mod:`qkv.generation` sees every model (an ``IncrementalDecoder``): the source
    encoded once, then one decoder step per token with the KV cache; beam search reorders the cache, the
    encoder output and the source mask together.

    Without the cache (``use_cache=False``) every step re-runs the decoder over the whole prefix: the reference
    the cache is checked against, and what the cache saves.
    """

    def __init__(self, model: Transformer, src: Tensor, *, use_cache: bool = True) -> None:
        self.model = model
        self.memory = model.encode(src)  # (B, S, D)
        self.memory_mask = model.source_mask(src)  # (B, S)
        self.cache = model.new_cache(capacity=64) if use_cache else None  # grows for longer outputs
        self.prefix: Tensor | None = None
        self.batch_size, self.device = src.size(0), src.device

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(B, t)``: the newest tokens -> logits ``(B, V)`` of the next one."""
        if self.cache is None:
            self.prefix = tokens if self.prefix is None else torch.cat([self.prefix, tokens], dim=1)
            tokens = self.prefix
        logits = self.model.decode(tokens, self.memory, memory_mask=self.memory_mask, cache=self.cache)
        return logits[:, -1]

    def reorder(self, index: Tensor) -> None:
        """Keep (and duplicate) batch rows ``index``."""
        self.memory = self.memory.index_select(0, index)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)
        if self.prefix is not None:
            self.prefix = self.prefix.index_select(0, index)
        self.batch_size = index.numel()
