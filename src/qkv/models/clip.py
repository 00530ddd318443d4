"""CLIP (Radford et al. 2021): an image encoder and a text encoder trained together, so that in one embedding
space an image and its caption have the highest cosine similarity among a batch.

    pixels (B, C, H, W) ─ ViT ─ [CLS] state ─ W_img ─ normalise ─ I (B, d_proj)
    ids (B, T) ─ causal text Transformer ─ end-of-text state ─ W_txt ─ normalise ─ T (B, d_proj)
                                                      logits = exp(s) · I Tᵀ  (B, B)

Training reads a batch of B pairs. Every image is scored against every caption by cosine similarity, a B×B
matrix whose diagonal holds the true pairs, and the loss is a cross-entropy in both directions with the
diagonal as targets: each image must pick its caption among the B, and each caption its image,

    L = ½ [ CE(logits, diag) + CE(logitsᵀ, diag) ],      logits_ij = cos(I_i, T_j) / τ.

The temperature τ is learned, stored as s = log(1/τ) (so that it stays positive), starts at τ = 0.07
(s = 2.6592) and is clamped so that the logits are never scaled by more than 100, as CLIP does.

Nothing in the model knows the labels of any task. A classifier is written in words instead: embed
"a photo of a {label}." for every class under several templates, average and renormalise, and give an image
the class whose text embedding is nearest (:func:`zero_shot_classifier`, :func:`zero_shot_predict`). The
same two embeddings retrieve captions for images and images for captions (:func:`retrieval_recall`).

The image encoder is qkv's :class:`~qkv.models.vit.ViT` with CLIP's switches (a norm before the first layer,
no patch bias, QuickGELU); its final norm is CLIP's ``post_layernorm`` on the [CLS] state. The text encoder is
GPT-2's causal stack read once: the end-of-text token, last in the caption, is the only one that has seen all
of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import CLIPConfig, CLIPTextConfig
from ..data import pad_with_mask
from ..nn import Decoder, padding_mask
from . import common
from .common import WithAttention
from .vit import ViT

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(s) = 1/τ


class TextEncoder(common.Model):
    """CLIP's text encoder: token embeddings + learned positions, causal Pre-Norm layers, a final norm.

    The layers are GPT's decoder blocks without cross-attention (``CLIPTextModel``); the text's vector is the
    state of the end-of-text token (:meth:`pool`).

    Shape:
        ids ``(B, T)``, attention_mask ``(B, T)`` -> hidden ``(B, T, d_model)``.
    """

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = common.absolute_positions(cfg)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        rope = common.rotary(cfg)
        self.decoder = Decoder([common.decoder_layer(cfg, rope, cross=False) for _ in range(cfg.n_layers)],
                               common.final_norm(cfg))
        common.init_weights(self, cfg)

    @overload
    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                return_attention: Literal[True]) -> WithAttention: ...

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                return_attention: bool = False) -> Tensor | WithAttention:
        """Hidden states of every token, after the final norm.

        Args:
            ids: token ids ``(B, T)``.
            attention_mask: ``(B, T)``, True/1 for real tokens; defaults to ``ids != pad_id`` (or none).
            return_attention: also return the attention weights.

        Returns:
            hidden ``(B, T, d_model)``; with ``return_attention``, ``WithAttention(hidden, attention)`` where
            attention is a list of ``n_layers`` tensors ``(B, H, T, T)``, zero above the diagonal (causal).
        """
        cfg = self.config
        common.check_ids(ids, cfg.vocab_size)
        if attention_mask is None and cfg.pad_id is not None:
            attention_mask = padding_mask(ids, cfg.pad_id)
        elif attention_mask is not None:
            attention_mask = common.check_mask(attention_mask, ids, "attention_mask")
        x = self.tok_emb(ids)  # (B, T, D)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.size(1), device=ids.device))
        hidden, weights, _ = self.decoder(self.emb_dropout(x), key_padding_mask=attention_mask,
                                          need_weights=return_attention)
        return WithAttention(hidden, weights) if return_attention else hidden

    def pool(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """The text's vector ``(B, D)``: the state at the first ``eos_id`` of each row, or, with ``eos_id=None``,
        at the highest id of each row (OpenAI's rule; argmax returns the first maximum).

        Raises:
            ValueError: a row without the end-of-text token (checked for ids on the CPU).
        """
        eos = self.config.eos_id
        if eos is None:
            where = ids.argmax(dim=-1)  # (B,)
        else:
            found = ids == eos  # (B, T)
            if ids.device.type == "cpu" and not torch.compiler.is_compiling() and not found.any(dim=-1).all():
                row = int((~found.any(dim=-1)).nonzero()[0])
                raise ValueError(f"row {row} of ids has no end-of-text token eos_id={eos}: CLIP reads the text's "
                                 "vector there; let the tokenizer append it")
            where = found.int().argmax(dim=-1)  # (B,)
        return hidden[torch.arange(ids.size(0), device=ids.device), where]  # (B, D)


class CLIP(common.Model):
    """An image encoder and a text encoder, each followed by a linear projection (no bias) into one space.

    Shape:
        pixels ``(B_img, C, H, W)``, ids ``(B_txt, T)`` -> logits ``(B_img, B_txt)``; the embeddings of
        :meth:`encode_image` and :meth:`encode_text` are ``(B, projection_dim)``.
    """

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = ViT(config.vision)
        self.text = TextEncoder(config.text)
        self.visual_projection = nn.Linear(config.vision.d_model, config.projection_dim, bias=False)
        self.text_projection = nn.Linear(config.text.d_model, config.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(float(config.logit_scale_init)))  # s = log(1/τ)
        for projection in (self.visual_projection, self.text_projection):
            nn.init.normal_(projection.weight, std=projection.in_features**-0.5)  # as CLIP: width^-1/2

    @overload
    def encode_image(self, pixels: Tensor, *, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def encode_image(self, pixels: Tensor, *, return_attention: Literal[True]) -> WithAttention: ...

    def encode_image(self, pixels: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        """Projected image embeddings ``(B, projection_dim)``, not normalised (``get_image_features``).

        With ``return_attention``, ``WithAttention(embeddings, attention)``, attention as :class:`ViT` gives it.

        Raises:
            ValueError, TypeError: images of the wrong type, channels or size (see ``check_pixels``).
        """
        out = self.vision(pixels, return_attention=return_attention)
        hidden = out.output if return_attention else out  # (B, 1 + N, D)
        embeddings = self.visual_projection(self.vision.pool(hidden))  # (B, d_proj)
        return WithAttention(embeddings, out.attention) if return_attention else embeddings

    @overload
    def encode_text(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                    return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def encode_text(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                    return_attention: Literal[True]) -> WithAttention: ...

    def encode_text(self, ids: Tensor, attention_mask: Tensor | None = None, *,
                    return_attention: bool = False) -> Tensor | WithAttention:
        """Projected text embeddings ``(B, projection_dim)``, not normalised (``get_text_features``).

        With ``return_attention``, ``WithAttention(embeddings, attention)``, attention as
        :class:`TextEncoder` gives it.
        """
        out = self.text(ids, attention_mask, return_attention=return_attention)
        hidden = out.output if return_attention else out  # (B, T, D)
        embeddings = self.text_projection(self.text.pool(hidden, ids))  # (B, d_proj)
        return WithAttention(embeddings, out.attention) if return_attention else embeddings

    def forward(self, pixels: Tensor, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Scaled cosine similarities of every image with every text: ``min(exp(s), 100) · I Tᵀ``.

        Returns:
            logits ``(B_img, B_txt)``, images in rows (``logits_per_image``); the transpose is per text.
        """
        images = F.normalize(self.encode_image(pixels), dim=-1)  # (B_img, d_proj)
        texts = F.normalize(self.encode_text(ids, attention_mask), dim=-1)  # (B_txt, d_proj)
        return self.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE) * images @ texts.t()


def contrastive_loss(logits: Tensor) -> Tensor:
    """CLIP's symmetric cross-entropy: ½ [CE(logits, diag) + CE(logitsᵀ, diag)], in float32.

    Row i of ``logits`` is image i against every text; its caption is text i, so the targets are the diagonal.

    Raises:
        ValueError: logits that are not a square ``(B, B)`` matrix of paired images and texts.
    """
    if logits.dim() != 2 or logits.size(0) != logits.size(1):
        raise ValueError(f"contrastive_loss needs square (B, B) logits of B paired images and texts, "
                         f"got shape {tuple(logits.shape)}")
    logits = logits.float()
    targets = torch.arange(logits.size(0), device=logits.device)  # (B,)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


@torch.no_grad()
def zero_shot_classifier(
    model: CLIP,
    tokenize: Callable[[str], list[int]],
    class_names: Sequence[str],
    templates: Sequence[str] = ("a photo of a {}.",),
) -> Tensor:
    """A classifier written in words: for each class, the mean of its normalised text embeddings under every
    template, renormalised.

    Args:
        model: a CLIP (in eval mode, so that dropout is off).
        tokenize: text -> token ids, the end-of-text token included.
        class_names: one name per class, e.g. ``["T-shirt", "trouser", ...]``.
        templates: prompts with ``{}`` (or ``{label}``) where the name goes, e.g. ``"a photo of a {}."``.

    Returns:
        ``(n_classes, projection_dim)``, unit rows.

    Raises:
        ValueError: no classes, no templates, or a template without a place for the name.
    """
    if not class_names:
        raise ValueError("class_names is empty: zero-shot classification needs at least one class")
    if not templates:
        raise ValueError("templates is empty: give at least one, e.g. 'a photo of a {}.'")
    bad = [t for t in templates if "{}" not in t and "{label}" not in t]
    if bad:
        raise ValueError(f"every template needs {{}} or {{label}} where the class name goes, got {bad}")
    pad = 0 if model.config.text.pad_id is None else model.config.text.pad_id  # masked anyway
    device = model.logit_scale.device
    rows = []
    for name in class_names:
        ids, mask = pad_with_mask([tokenize(t.format(name, label=name)) for t in templates], pad)  # (n_templates, T)
        texts = F.normalize(model.encode_text(ids.to(device), mask.to(device)), dim=-1)  # (n_templates, d_proj)
        rows.append(F.normalize(texts.mean(dim=0), dim=-1))
    return torch.stack(rows)  # (n_classes, d_proj)


@torch.no_grad()
def zero_shot_predict(model: CLIP, pixels: Tensor, classifier: Tensor) -> Tensor:
    """The class of each image: the row of ``classifier`` nearest its embedding (highest cosine).

    Returns:
        class indices ``(B,)``.

    Raises:
        ValueError: a classifier that is not ``(n_classes, projection_dim)``.
    """
    if classifier.dim() != 2 or classifier.size(1) != model.config.projection_dim:
        raise ValueError(f"classifier must have shape (n_classes, {model.config.projection_dim}), "
                         f"got {tuple(classifier.shape)}; build it with zero_shot_classifier")
    images = F.normalize(model.encode_image(pixels), dim=-1)  # (B, d_proj)
    return (images @ classifier.t()).argmax(dim=-1)  # (B,)


def retrieval_recall(image_emb: Tensor, text_emb: Tensor, ks: Sequence[int] = (1, 5), *,
                     labels: tuple[Tensor, Tensor] | None = None) -> dict[str, float]:
    """Recall@k both ways: the share of queries whose partner is among the k candidates of highest cosine
    similarity. A candidate tied with the partner does not push it down.

    Without ``labels`` the rows are pairs: image i's caption is text i. With ``labels`` ``(image_labels (N,),
    text_labels (M,))`` any candidate of the query's label is a partner, and the N images and M texts need not
    pair up (captions made from class labels cannot tell two images of one class apart): recall@k is then the
    share of queries with a candidate of the right class among the top k.

    Returns:
        ``{"image_to_text@k": ..., "text_to_image@k": ...}`` for every k, each in [0, 1].

    Raises:
        ValueError: embeddings that are not paired ``(N, d)`` matrices (or, with labels, of unequal widths),
            labels that do not match them, or a k below 1.
    """
    if image_emb.dim() != 2 or text_emb.dim() != 2 or image_emb.size(1) != text_emb.size(1) or (
            labels is None and image_emb.shape != text_emb.shape):
        raise ValueError(f"image_emb and text_emb must be {'paired ' if labels is None else ''}(N, d) matrices, got "
                         f"{tuple(image_emb.shape)} and {tuple(text_emb.shape)}")
    if labels is not None and (labels[0].shape != image_emb.shape[:1] or labels[1].shape != text_emb.shape[:1]):
        raise ValueError(f"labels must be ({image_emb.size(0)},) for the images and ({text_emb.size(0)},) for the "
                         f"texts, got {tuple(labels[0].shape)} and {tuple(labels[1].shape)}")
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got ks={tuple(ks)}")
    sims = F.normalize(image_emb.float(), dim=-1) @ F.normalize(text_emb.float(), dim=-1).t()  # (N, M)
    same = (torch.eye(len(sims), dtype=torch.bool, device=sims.device) if labels is None
            else labels[0][:, None].to(sims.device) == labels[1][None, :].to(sims.device))
    best_text = sims.masked_fill(~same, -2).amax(dim=1)  # (N,) each image's best-placed partner
    best_image = sims.masked_fill(~same, -2).amax(dim=0)  # (M,) each text's best-placed partner
    ranks = {  # how many others score strictly above the best partner: 0 is first place
        "image_to_text": ((sims > best_text[:, None]) & ~same).sum(dim=1),  # (N,)
        "text_to_image": ((sims > best_image[None, :]) & ~same).sum(dim=0),  # (M,)
    }
    return {f"{way}@{k}": (rank < k).float().mean().item() for k in ks for way, rank in ranks.items()}
