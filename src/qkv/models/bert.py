"""Encoder-only model (BERT): the Transformer's encoder, bidirectional, no causal mask.

    ids + positions + token types ─ LayerNorm ─ N × [self-attention, FFN] (Post-Norm) ─ hidden states
                                                                          └ pooler: tanh(W h_[CLS])

Every token sees every other, which is what makes it the half that understands: its hidden states feed
sentence embeddings (:func:`mean_pool`), classifiers (:class:`BERTClassifier`, on the pooler) and
masked-language modelling (:class:`BERTForMaskedLM`), each a small head on the same :class:`BERT`.

    BERTForMaskedLM:  hidden ─ dense ─ GELU ─ LayerNorm ─ · Eᵀ + b  -> a score for every vocabulary token
    BERTClassifier:   pooled (tanh(W h_[CLS]) or mean of h) ─ dropout ─ linear -> a score for every label
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import BERTClassifierConfig, BERTConfig
from ..nn import Encoder, LayerNorm, padding_mask
from . import common
from .common import WithAttention


class BERT(common.Model):
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

    @overload
    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None, *,
                return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None, *,
                return_attention: Literal[True]) -> WithAttention: ...

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_attention: bool = False,
    ) -> Tensor | WithAttention:
        """Contextual hidden states for every token.

        Args:
            ids: token ids ``(B, T)``.
            attention_mask: ``(B, T)``, True/1 for real tokens; defaults to ``ids != pad_id``.
            token_type_ids: segment ids ``(B, T)``; default all 0.
            return_attention: also return the attention weights.

        Returns:
            hidden ``(B, T, d_model)``; with ``return_attention``, ``WithAttention(hidden, attention)`` where
            attention is a list of ``n_layers`` tensors ``(B, H, T, T)``, one per layer: row i is how much token
            i attends to each token (zero for padding).
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
        return WithAttention(hidden, weights) if return_attention else hidden

    def pool(self, hidden: Tensor) -> Tensor:
        """BERT's pooled output: tanh(W h_0 + b) of the first ([CLS]) token. Shape ``(B, T, D)`` -> ``(B, D)``."""
        if self.pooler is None:
            raise ValueError("this BERT was built with pooler=False; build it with pooler=True to pool")
        return torch.tanh(self.pooler(hidden[:, 0]))


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """The mean of the real tokens' states: Σ_t m_t h_t / Σ_t m_t, padding left out.

    This is how sentence-transformers turns a BERT into a sentence encoder (all-MiniLM-L6-v2 was trained
    with it): every token's state counts, not only [CLS]'s. A row without real tokens gives zeros, not NaN.

    Shape:
        hidden ``(B, T, D)``, attention_mask ``(B, T)`` (bool or 0/1) -> ``(B, D)``.
    """
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, D)


class MaskedLMHead(nn.Module):
    """BERT's masked-language-model head: logits = LayerNorm(GELU(W h + b)) · Eᵀ + b_vocab.

    The output matrix is the token embedding E itself (weight tying, as in BERT), so the head owns only the
    transform and a bias per vocabulary entry, and takes E as an argument.

    Shape:
        hidden ``(..., D)``, embedding ``(V, D)`` -> logits ``(..., V)``.
    """

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden: Tensor, embedding: Tensor) -> Tensor:
        x = self.norm(F.gelu(self.dense(hidden)))  # (..., D)
        return F.linear(x, embedding, self.bias)  # (..., V)


class BERTForMaskedLM(common.Model):
    """A :class:`BERT` with the masked-language-model head: predicts the tokens hidden behind ``[MASK]``.

    Shape:
        ids ``(B, T)`` -> logits ``(B, T, vocab_size)``, or ``(N, vocab_size)`` for the N selected positions.
    """

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BERT(config)
        self.head = MaskedLMHead(config)
        common.init_weights(self.head, config)

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        select: Tensor | None = None,
    ) -> Tensor:
        """Vocabulary logits.

        Args:
            ids, attention_mask, token_type_ids: as for :meth:`BERT.forward`.
            select: boolean ``(B, T)``; if given, only those positions are scored and the logits come flat,
                ``(N, V)`` in row-major order. Training scores the 15% masked tokens only, which spares
                85% of the largest matrix product (d_model x vocabulary).
        """
        hidden = self.bert(ids, attention_mask, token_type_ids)  # (B, T, D)
        if select is not None:
            hidden = hidden[common.check_mask(select, ids, "select")]  # (N, D)
        return self.head(hidden, self.bert.tok_emb.weight)


class BERTClassifier(common.Model):
    """A :class:`BERT` with a linear classifier on its sentence vector (see :class:`BERTClassifierConfig`).

    Shape:
        ids ``(B, T)`` -> logits ``(B, n_labels)``.
    """

    def __init__(self, config: BERTClassifierConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BERT(config)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.n_labels)
        common.init_weights(self.classifier, config)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
                ) -> Tensor:
        if attention_mask is None:
            attention_mask = ids != self.config.pad_id if self.config.pad_id is not None else torch.ones_like(ids)
        hidden = self.bert(ids, attention_mask, token_type_ids)  # (B, T, D)
        if self.config.pooling == "pooler":
            pooled = self.bert.pool(hidden)  # (B, D)
        else:
            pooled = mean_pool(hidden, common.check_mask(attention_mask, ids, "attention_mask"))  # (B, D)
        return self.classifier(self.dropout(pooled))  # (B, n_labels)
