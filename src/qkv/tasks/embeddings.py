"""Sentence embeddings and semantic search with a BERT encoder.

A sentence becomes one vector as sentence-transformers makes it:

    text ─ WordPiece ─ [CLS] tokens [SEP] (cut to max_length) ─ BERT ─ mean over real tokens ─ v / ‖v‖₂

Normalised vectors make cosine similarity a dot product, cos(a, b) = a·b, so semantic search is one matrix
product and a top-k. Sentences are encoded in batches of similar length (sorted by token count), each padded
only to its own longest: a sentence's vector does not depend on the others in its batch (padding is masked),
so sorting changes the speed, not the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data import pad
from ..device import device_of, to_device
from ..footprint import activation_bytes, check_fits
from ..models import BERT, mean_pool
from ..tokenizers import WordPieceTokenizer

POOLINGS = ("mean", "cls", "max")


def frame(tokenizer: WordPieceTokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Every text as ``[CLS] tokens [SEP]``, at most ``max_length`` tokens in all."""
    return [tokenizer.wrap(ids, max_length) for ids in tokenizer.encode_batch(texts)]


def pool(hidden: Tensor, attention_mask: Tensor, how: str = "mean") -> Tensor:
    """One vector per sentence from its token states.

    ``mean``: the mean of the real tokens (sentence-transformers' default); ``cls``: the [CLS] state;
    ``max``: the element-wise maximum over the real tokens.

    Shape:
        hidden ``(B, T, D)``, attention_mask ``(B, T)`` bool -> ``(B, D)``.
    """
    if how == "mean":
        return mean_pool(hidden, attention_mask)
    if how == "cls":
        return hidden[:, 0]
    if how == "max":
        return hidden.masked_fill(~attention_mask.unsqueeze(-1), float("-inf")).amax(1)
    raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {how!r}")


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, got one str; wrap it in a list")
    if not texts:
        raise ValueError("no sentences to embed: give at least one")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")


@torch.no_grad()
def embed(
    model: BERT,
    tokenizer: WordPieceTokenizer,
    texts: Sequence[str],
    *,
    pooling: str = "mean",
    normalize: bool = True,
    max_length: int | None = None,
    batch_size: int = 32,
) -> Tensor:
    """Sentence vectors of ``texts``, in their order.

    Args:
        model: the encoder (put in eval mode here).
        tokenizer: its WordPiece tokenizer.
        texts: the sentences.
        pooling: ``mean``, ``cls`` or ``max`` (see :func:`pool`).
        normalize: scale every vector to unit length (L2), so that dot products are cosines.
        max_length: longest input in tokens, [CLS] and [SEP] included (default: the model's ``max_seq_len``);
            longer sentences are cut at the end.
        batch_size: sentences per forward pass.

    Returns:
        ``(len(texts), d_model)`` float32.

    Raises:
        ValueError: for no texts, a bad pooling, or a max_length outside [3, max_seq_len].
    """
    _check_texts(texts)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    limit = model.config.max_seq_len
    max_length = limit if max_length is None else max_length
    if not 3 <= max_length <= limit:
        raise ValueError(f"max_length must be in [3, {limit}] (the model's max_seq_len), got {max_length}")
    model.eval()
    ids = frame(tokenizer, texts, max_length)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first, similar lengths together
    out = torch.empty(len(ids), model.config.d_model)
    device = device_of(model)
    rows, longest = min(batch_size, len(ids)), len(ids[order[0]])  # the first batch is the largest
    check_fits(activation_bytes(model.config, rows, longest, training=False),
               f"encoding {rows:,} sentences of {longest:,} tokens at once", device=device)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = pad([ids[i] for i in rows], tokenizer.pad_id)  # (B, T)
        mask = torch.arange(batch.size(1))[None, :] < torch.tensor([len(ids[i]) for i in rows])[:, None]  # (B, T)
        batch, mask = to_device(batch, device), to_device(mask, device)
        hidden = model(batch, attention_mask=mask)  # (B, T, D)
        vectors = pool(hidden, mask, pooling).float()  # (B, D)
        out[rows] = (F.normalize(vectors, p=2, dim=-1) if normalize else vectors).cpu()
    return out


def cosine_similarity(a: Tensor, b: Tensor) -> Tensor:
    """cos(a_i, b_j) for every pair of rows. Shape ``(N, D)``, ``(M, D)`` -> ``(N, M)``."""
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(1):
        raise ValueError(f"expected (N, D) and (M, D) vectors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def search(queries: Tensor, corpus: Tensor, k: int = 5) -> tuple[Tensor, Tensor]:
    """The ``k`` corpus vectors nearest to each query by cosine similarity.

    Returns:
        ``(scores, indices)``, both ``(Q, min(k, N))``, best first.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    scores = cosine_similarity(queries, corpus)  # (Q, N)
    return scores.topk(min(k, corpus.size(0)), dim=-1)


@torch.no_grad()
def self_attention(
    model: BERT, tokenizer: WordPieceTokenizer, text: str, *, layer: int = -1, head: int | None = None,
    max_length: int | None = None,
) -> tuple[Tensor, list[str]]:
    """The self-attention weights of one sentence, with its tokens as labels.

    Args:
        layer: which layer (negative counts from the last).
        head: which head; None averages over the heads.

    Returns:
        ``(weights (T, T), tokens)``: row i is how much token i attends to each token.

    Raises:
        ValueError: for a layer or head the model does not have.
    """
    cfg = model.config
    if not -cfg.n_layers <= layer < cfg.n_layers:
        raise ValueError(f"layer must be in [{-cfg.n_layers}, {cfg.n_layers - 1}], got {layer}")
    if head is not None and not 0 <= head < cfg.n_heads:
        raise ValueError(f"head must be in [0, {cfg.n_heads - 1}], got {head}")
    model.eval()
    ids = frame(tokenizer, [text], max_length or cfg.max_seq_len)[0]
    weights = model(torch.tensor([ids], device=device_of(model)), return_attention=True).attention  # (1, H, T, T)s
    att = weights[layer][0]  # (H, T, T)
    att = att.mean(0) if head is None else att[head]  # (T, T)
    return att, [tokenizer.id_to_token(i) for i in ids]
