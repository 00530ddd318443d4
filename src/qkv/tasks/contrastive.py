"""Contrastive image-text training: a CLIP learns from labelled images and captions made from their labels.

Each batch pairs B images with one caption each (a random training template and wording of the image's class,
see :mod:`qkv.tasks.captions`); the loss is CLIP's symmetric cross-entropy over the B×B similarities
(:func:`qkv.models.clip.contrastive_loss`). Images of the same class are also "negatives" of each other's
captions: with 10 classes and a batch of 256 that is unavoidable, and zero-shot classification does not suffer
from it, since it only asks which class's captions an image is nearest.

The temperature's logarithm is clamped at ln 100 before every step, as CLIP does after each one: past the clamp
``forward`` would give it no gradient. Validation reports the loss on held-out images and the zero-shot accuracy
with the held-out templates, which picks the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import pad_with_mask
from ..device import device_of, move
from ..distributed import SINGLE, Group
from ..images import ImageSet, augment, normalize
from ..models.clip import CLIP, MAX_LOGIT_SCALE, contrastive_loss, retrieval_recall, zero_shot_classifier
from ..tokenizers import EOS_ID, PAD_ID
from .captions import CaptionSet
from .image_classify import EpochBatches


@dataclass
class PairBatch:
    pixels: Tensor  # (B, C, H, W) normalised
    ids: Tensor  # (B, T) caption tokens, end-of-text included
    mask: Tensor  # (B, T) True for real tokens
    n_tokens: int  # pairs


def caption_ids(tokenizer, caption: str, max_length: int) -> list[int]:
    """A caption's token ids, cut to ``max_length`` with the end-of-text token last (CLIP reads its state)."""
    return [*tokenizer.encode(caption)[: max_length - 1], EOS_ID]


def caption_tokens(tokenizer, captions: Sequence[str], max_length: int) -> tuple[Tensor, Tensor]:
    """Ids ``(B, T)`` and mask ``(B, T)`` of captions (see :func:`caption_ids`)."""
    return pad_with_mask([caption_ids(tokenizer, c, max_length) for c in captions], PAD_ID)


@torch.no_grad()
def embed_images(model: CLIP, pixels: Tensor, *, mean: list[float], std: list[float], batch_size: int = 512
                 ) -> Tensor:
    """Unit image embeddings ``(N, d_proj)`` of uint8 images ``(N, C, H, W)``."""
    device = device_of(model)
    return torch.cat([F.normalize(model.encode_image(normalize(pixels[k : k + batch_size].to(device), mean, std)),
                                  dim=-1).float().cpu() for k in range(0, len(pixels), batch_size)])


@torch.no_grad()
def embed_captions(model: CLIP, tokenizer, captions: Sequence[str], *, batch_size: int = 512) -> Tensor:
    """Unit text embeddings ``(N, d_proj)``."""
    device, out = device_of(model), []
    for k in range(0, len(captions), batch_size):
        ids, mask = caption_tokens(tokenizer, captions[k : k + batch_size], model.config.text.max_seq_len)
        out.append(F.normalize(model.encode_text(ids.to(device), mask.to(device)), dim=-1).float().cpu())
    return torch.cat(out)


def text_classifier(model: CLIP, tokenizer, names: Sequence[str], templates: Sequence[str]) -> Tensor:
    """The zero-shot classifier ``(n_classes, d_proj)`` of class names under templates (on the CPU)."""
    max_length = model.config.text.max_seq_len
    return zero_shot_classifier(model, lambda text: caption_ids(tokenizer, text, max_length), names,
                                templates).float().cpu()


def zero_shot_accuracy(model: CLIP, tokenizer, images: ImageSet, names: Sequence[str], templates: Sequence[str], *,
                       mean: list[float], std: list[float]) -> float:
    """Share of ``images`` whose nearest class name (under ``templates``) is their label."""
    model.eval()
    classifier = text_classifier(model, tokenizer, names, templates)
    predicted = (embed_images(model, images.pixels, mean=mean, std=std) @ classifier.t()).argmax(-1)
    return (predicted == images.labels).float().mean().item()


def retrieval(model: CLIP, tokenizer, images: ImageSet, captions: CaptionSet, *, mean: list[float], std: list[float]
              ) -> dict[str, float]:
    """Recall@1 and @5, image->text and text->image, between ``images`` and every distinct held-out caption (each
    held-out template with each training wording); a hit is a result of the right class (see
    :func:`retrieval_recall`)."""
    model.eval()
    texts, text_labels = [], []
    for label, wordings in enumerate(captions.train_wordings):
        for template in captions.held_out_templates:
            texts += [template.format(w) for w in wordings]
            text_labels += [label] * len(wordings)
    return retrieval_recall(embed_images(model, images.pixels, mean=mean, std=std),
                            embed_captions(model, tokenizer, texts), labels=(images.labels, torch.tensor(text_labels)))


class ContrastiveTask:
    """CLIP on labelled images with captions from :class:`CaptionSet`; validated by zero-shot accuracy."""

    selection_metric = "val_zero_shot"
    higher_is_better = True
    unit = "pairs"

    def __init__(self, model: CLIP, tokenizer, captions: CaptionSet, train: ImageSet, valid: ImageSet, *,
                 batch_size: int, pad: int = 0, flip: bool = False, mean: list[float], std: list[float],
                 seed: int = 0, meta: dict[str, Any] | None = None) -> None:
        if batch_size < 2:
            raise ValueError(f"contrastive batches need at least 2 pairs, got batch_size={batch_size}")
        if not len(train) or not len(valid):
            raise ValueError(f"need training and validation images, got {len(train)} and {len(valid)}")
        self.model, self.tokenizers = model, {"text": tokenizer}
        self.captions, self.train, self.valid = captions, train, valid
        self.batch_size, self.pad, self.flip, self.seed, self.mean, self.std = batch_size, pad, flip, seed, mean, std
        self.meta = {"task": "contrastive", "labels": train.classes, "class_names": list(captions.names),
                     "templates": list(captions.held_out_templates), "mean": mean, "std": std,
                     "image_shape": list(train.pixels.shape[1:]), **(meta or {})}

    def batch(self, images: ImageSet, rows: Tensor, *, generator: torch.Generator, held_out: bool = False
              ) -> PairBatch:
        pixels = images.pixels[rows]
        if not held_out:
            pixels = augment(pixels, pad=self.pad, flip=self.flip, generator=generator)
        texts = self.captions.sample(images.labels[rows], generator=generator, held_out=held_out)
        ids, mask = caption_tokens(self.tokenizers["text"], texts, self.model.config.text.max_seq_len)
        return PairBatch(normalize(pixels, self.mean, self.std), ids, mask, len(rows))

    def batches(self, epoch: int) -> Sequence[PairBatch]:
        return EpochBatches(self, epoch)

    def loss(self, model: nn.Module, batch: PairBatch) -> tuple[Tensor, int]:
        with torch.no_grad():  # on the CLIP itself: a DDP wrapper (its .module) has no logit_scale of its own
            getattr(model, "module", model).logit_scale.clamp_(max=math.log(MAX_LOGIT_SCALE))
        batch = move(batch, device_of(model))
        return contrastive_loss(model(batch.pixels, batch.ids, batch.mask)) * batch.n_tokens, batch.n_tokens

    @torch.no_grad()
    def evaluate(self, model: CLIP, group: Group = SINGLE) -> dict[str, float]:
        """Contrastive loss on held-out pairs (held-out templates) and zero-shot accuracy with the held-out
        templates, on the held-out images (shared out across the ranks of a distributed run)."""
        classifier = text_classifier(model, self.tokenizers["text"], self.captions.names,
                                     self.captions.held_out_templates)
        g = torch.Generator().manual_seed(self.seed)
        chunks = [torch.arange(k, min(k + self.batch_size, len(self.valid))) for k in range(0, len(self.valid),
                                                                                          self.batch_size)]
        batches = [self.batch(self.valid, rows, generator=g, held_out=True) for rows in chunks]  # alike on every rank
        total, correct = 0.0, 0
        for rows, batch in group.shard(list(zip(chunks, batches, strict=True))):
            batch = move(batch, device_of(model))
            images = F.normalize(model.encode_image(batch.pixels), dim=-1)
            texts = F.normalize(model.encode_text(batch.ids, batch.mask), dim=-1)
            scale = model.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
            total += contrastive_loss(scale * images @ texts.t()).item() * batch.n_tokens
            correct += int(((images.float().cpu() @ classifier.t()).argmax(-1) == self.valid.labels[rows]).sum())
        sums = group.sum({"loss": total, "correct": correct})
        return {"val_loss": sums["loss"] / len(self.valid), "val_zero_shot": sums["correct"] / len(self.valid)}
