"""Image classification: train a ViT or a Swin from scratch on labelled images.

Each batch is a random draw of the training images, augmented (a random shift by crop-after-padding, and
mirror images where they keep the label), normalised with the training set's per-channel mean and spread,
and scored with cross-entropy (optionally label-smoothed: the target keeps 1 − ε on the label and spreads ε
evenly over all the classes). Validation reports the loss and the accuracy on the held-out images; the best
accuracy picks the checkpoint. The mean and spread go into the checkpoint, so ``qkv classify-image`` reads a
new image exactly as training did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..device import device_of, move
from ..distributed import SINGLE, Group
from ..images import ImageSet, augment, normalize


@dataclass
class ImageBatch:
    pixels: Tensor  # (B, C, H, W) float, normalised
    labels: Tensor  # (B,)
    n_tokens: int  # images in the batch: what the loss is summed over


class EpochBatches(Sequence):
    """An epoch's batches, made when they are read (augmenting 60,000 images up front would hold them all):
    batch *k* of epoch *e* depends only on (seed, e, k), so a resumed run sees the same batches."""

    def __init__(self, task, epoch: int) -> None:  # a task with train, batch_size, seed and batch()
        self.task, self.epoch = task, epoch
        g = torch.Generator().manual_seed(task.seed * 100_003 + epoch)
        self.order = torch.randperm(len(task.train), generator=g)

    def __len__(self) -> int:
        return -(-len(self.order) // self.task.batch_size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        size = self.task.batch_size
        rows = self.order[index * size : (index + 1) * size]
        # Folded into the 64 bits a generator takes: a large --seed would otherwise overflow it
        g = torch.Generator().manual_seed(((self.task.seed * 100_003 + self.epoch) * 1_000_003 + index) % 2**64)
        return self.task.batch(self.task.train, rows, generator=g)


class ImageClassifyTask:
    """Image classification, validated by loss and accuracy."""

    selection_metric = "val_accuracy"
    higher_is_better = True
    unit = "images"

    def __init__(self, model: nn.Module, train: ImageSet, valid: ImageSet, *, batch_size: int, pad: int = 0,
                 flip: bool = False, mean: list[float], std: list[float], label_smoothing: float = 0.0, seed: int = 0,
                 meta: dict[str, Any] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not len(train) or not len(valid):
            raise ValueError(f"need training and validation images, got {len(train)} and {len(valid)}")
        self.model, self.tokenizers = model, {}
        self.train, self.valid = train, valid
        self.batch_size, self.pad, self.flip, self.seed = batch_size, pad, flip, seed
        self.mean, self.std, self.label_smoothing = mean, std, label_smoothing
        self.meta = {"task": "classify-image", "labels": train.classes, "mean": mean, "std": std,
                     "image_shape": list(train.pixels.shape[1:]), **(meta or {})}

    def batch(self, images: ImageSet, rows: Tensor, *, generator: torch.Generator | None = None) -> ImageBatch:
        pixels = images.pixels[rows]
        if generator is not None:
            pixels = augment(pixels, pad=self.pad, flip=self.flip, generator=generator)
        return ImageBatch(normalize(pixels, self.mean, self.std), images.labels[rows], len(rows))

    def cool_down(self) -> None:
        """wsd's cool-down (the trainer calls this before each of its steps): a ViT trained on part of each image
        (patch dropout) reads every patch from here on, so the model ends fitted to the whole images it is
        tested on (Fashion-MNIST, 10 minutes: 90.6% against 90.0%; 30 minutes: 91.8% against 91.5%)."""
        from ..models.vit import ViT

        for module in self.model.modules():
            if isinstance(module, ViT):
                module.patch_dropout = 0.0

    def batches(self, epoch: int) -> Sequence[ImageBatch]:
        return EpochBatches(self, epoch)

    def loss(self, model: nn.Module, batch: ImageBatch) -> tuple[Tensor, int]:
        batch = move(batch, device_of(model))
        logits = model(batch.pixels)  # (B, n_classes)
        loss = F.cross_entropy(logits.float(), batch.labels, label_smoothing=self.label_smoothing, reduction="sum")
        return loss, batch.n_tokens

    @torch.no_grad()
    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Loss and accuracy on the held-out images (shared out across the ranks of a distributed run)."""
        total, correct, size = 0.0, 0, 4 * self.batch_size
        for k in group.shard(range(0, len(self.valid), size)):
            batch = move(self.batch(self.valid, torch.arange(k, min(k + size, len(self.valid)))), device_of(model))
            logits = model(batch.pixels).float()
            total += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == batch.labels).sum())
        sums, n = group.sum({"loss": total, "correct": correct}), len(self.valid)
        return {"val_loss": sums["loss"] / n, "val_accuracy": sums["correct"] / n}


@torch.no_grad()
def predict_images(model: nn.Module, pixels: Tensor, *, mean: list[float], std: list[float],
                   batch_size: int = 256) -> Tensor:
    """Class probabilities ``(N, n_classes)`` for uint8 images ``(N, C, H, W)``."""
    model.eval()
    device = device_of(model)
    return torch.cat([model(normalize(pixels[k : k + batch_size].to(device), mean, std)).float().softmax(-1).cpu()
                      for k in range(0, len(pixels), batch_size)])
