"""Encoder-only model (BERT): the Transformer's encoder, bidirectional, no causal mask.

    ids + positions + token types ─ LayerNorm ─ N × [self-attention, FFN] (Post-Norm) ─ hidden states
                                                                          └ pooler: tanh(W h_[CLS])

Every token sees every other, which is what makes it the half that understands: its hidden states feed
sentence embeddings (mean pooling), classifiers (the pooler) and masked-language modelling.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import BERTConfig
from ..nn import Encoder, LayerNorm, padding_mask
from . import common


class BERT(nn.Module):
    """Encoder-only Transformer configured by a :class:`BERTConfig`.

    Shape:
        ids ``(B, T)``, attention_mask ``(B, T)``, token_type_ids ``(B, T)`` -> hidden ``(B, T, d_model)``.
    """

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = common.absolute_positions(cfg)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.emb_norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.encoder = Encoder([common.encoder_layer(cfg, common.rotary(cfg)) for _ in range(cfg.n_layers)],
                               common.final_norm(cfg))
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        common.init_weights(self, cfg)

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_attention: bool = False,
    ):
        """Contextual hidden states for every token.

        Args:
            ids: token ids ``(B, T)``.
            attention_mask: ``(B, T)``, True/1 for real tokens; defaults to ``ids != pad_id``.
            token_type_ids: segment ids ``(B, T)``; default all 0.
            return_attention: also return the per-layer weights ``(B, H, T, T)``.

        Returns:
            hidden ``(B, T, d_model)``, or ``(hidden, [weights per layer])``.
        """
        cfg = self.config
        common.check_ids(ids, cfg.vocab_size)
        if attention_mask is None and cfg.pad_id is not None:
            attention_mask = padding_mask(ids, cfg.pad_id)
        elif attention_mask is not None:
            attention_mask = common.check_mask(attention_mask, ids, "attention_mask")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        else:
            common.check_ids(token_type_ids, cfg.type_vocab_size, "token_type_ids")
            if token_type_ids.shape != ids.shape:
                shapes = f"{tuple(ids.shape)}, got {tuple(token_type_ids.shape)}"
                raise ValueError(f"token_type_ids must have the shape of ids {shapes}")

        x = self.tok_emb(ids) + self.type_emb(token_type_ids)  # (B, T, D)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.size(1), device=ids.device))
        x = self.emb_dropout(self.emb_norm(x))
        hidden, weights = self.encoder(x, key_padding_mask=attention_mask, need_weights=return_attention)
        return (hidden, weights) if return_attention else hidden

    def pool(self, hidden: Tensor) -> Tensor:
        """BERT's pooled output: tanh(W h_0 + b) of the first ([CLS]) token. Shape ``(B, T, D)`` -> ``(B, D)``."""
        if self.pooler is None:
            raise ValueError("this BERT was built with pooler=False; build it with pooler=True to pool")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        return common.num_parameters(self, exclude_embeddings=exclude_embeddings)
